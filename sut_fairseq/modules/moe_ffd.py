"""Mixture of feed-forward experts, MoE-FFD (E, k, D) — docs/model.md#mixture-of-feed-forward-experts.

``y(h) = Σ_{e in top-k} g_e · (W2_e · act(W1_e h + b1_e) + b2_e)``: the up projection
``up`` (W1, b1: E maps d -> D) and the down projection ``down`` (W2, b2: E maps D -> d) are
``ExpertLinear``s. With E = k = 1 it is the dense FFN of a Transformer layer, and runs as
one: no router, the active rows through ``ExpertLinear.dense``. On the Triton kernels (CUDA)
the activation and its dropout are formed by the up projection's kernel as it stores its
rows (``routed_linear_activated``), and their gradient is applied by the down projection's
input-gradient kernel (``routed_linear``'s input activation): no pass of their own over the
(N k, D) rows, forward or backward.
"""
import torch
import torch.nn as nn
from fairseq import utils

from ..compiler import tracing
from ..ops.routed_linear import kernel_backend
from .dropout import Dropout, keep_mask
from .expert_linear import ExpertLinear, rename_parameters
from .router import Router


class MoEFeedForward(nn.Module):
    def __init__(self, embed_dim: int, hidden_dim: int, num_experts: int, top_k: int,
                 router_hidden_dim: int, activation_fn: str = "relu",
                 activation_dropout: float = 0.0, gating_dropout: float = 0.0,
                 sample_topk: int = 0):
        super().__init__()
        router = Router(embed_dim, num_experts, top_k, router_hidden_dim, gating_dropout, sample_topk,
                        gated_dim=hidden_dim)
        self.up = ExpertLinear(num_experts, embed_dim, hidden_dim)
        self.down = ExpertLinear(num_experts, hidden_dim, embed_dim)
        self.router = router  # registered after the experts: see MixtureOfMultiHeadAttention
        self.activation_fn = utils.get_activation_fn(activation_fn)
        self.activation_dropout = Dropout(activation_dropout)
        #: the activations the kernels form themselves (fairseq's "gelu" is the erf form)
        self.kernel_activation = activation_fn if activation_fn in ("gelu", "relu") else ""

    def forward(self, x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """x: (..., d); active: (...) bool. Returns (..., d), zero on inactive rows."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.router.num_experts == 1:  # the dense FFN on the active rows
            active = active.reshape(-1)
            h = self.activation_dropout(self.activation_fn(self.up.dense(x, active)))
            return self.down.dense(h, active).reshape(shape)
        routing = self.router(x, active.reshape(-1))
        backend = kernel_backend(x)
        if backend == "triton" and self.kernel_activation:  # the activation in the kernels
            # the activation dropout's mask over the up projection's (M, D) sorted rows
            keep, scale = keep_mask(x, self.activation_dropout.p, self.training,
                                    (routing.num_slots, self.up.weight.size(2)))
            h, x = self.up.activated(x, routing, routing.k, self.kernel_activation, keep, scale)
            return self.down(x, routing, fan_out=1, grouped_in=True, gates=routing.kernel_gates,
                             activation=self.kernel_activation, pre=h, keep=keep,
                             keep_scale=scale).reshape(shape)
        h = self.up(x, routing, fan_out=routing.k, grouped_out=True)
        if backend == "reference" and not tracing():
            # (M, D) sorted, the no-op slots last: the reference down projection reads only
            # the routed rows, so only they need the activation (a host read, free on CPU)
            h = h[: int(routing.expert_offsets[-1])]
        h = self.activation_dropout(self.activation_fn(h))
        return self.down(h, routing, fan_out=1, grouped_in=True, gates=routing.gates).reshape(shape)

    def upgrade_state_dict_named(self, state_dict, name):
        """Checkpoints before ``ExpertLinear``: ``w1 b1 w2 b2`` -> ``up.*``, ``down.*``."""
        rename_parameters(state_dict, name, {"w1": "up.weight", "b1": "up.bias",
                                             "w2": "down.weight", "b2": "down.bias"})
