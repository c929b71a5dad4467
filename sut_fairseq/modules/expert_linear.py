"""``ExpertLinear``: E linear maps in -> out, one per expert, applied to routed rows.

    y_s = x_s W[e_s] + b[e_s]        W (E, in, out), b (E, out): every expert's in one tensor

MoE-FFD's up/down and MoMHA's query/output projections; it owns the parameters and calls
the custom op ``sut::routed_linear`` (``ops/routed_linear.py``: row layouts, backends).
With one expert (the UT, GUT and the chunk-wise models) there is nothing to route:
``dense`` maps the active rows in token order (``masked_affine``: one GEMM on their rows).
"""
import math
from typing import Optional

import torch
import torch.nn as nn

from ..ops.masked_linear_op import masked_affine
from ..ops.routed_linear import routed_linear, routed_linear_activated
from ..ops.routing import Routing
from ..ops.weight_grads import new_tag


def init_expert_weight_(weight: torch.Tensor) -> torch.Tensor:
    """Xavier-uniform U(-a, a), a = sqrt(6 / (in + out)), on each expert's (in, out) slice."""
    bound = math.sqrt(6.0 / (weight.size(1) + weight.size(2)))
    with torch.no_grad():
        return weight.uniform_(-bound, bound)


class ExpertLinear(nn.Module):
    """Weight (E, in, out), Xavier-uniform per expert; zero bias (E, out), or with
    ``shared_bias`` one (out,) added after the gated sum of a token's slots (MoMHA's b_o):

        y_s = x_s W[e_s] + b[e_s]            or, shared:  y_n = Σ_j g_nj x_nj W[e_nj] + b
    """

    def __init__(self, num_experts: int, in_dim: int, out_dim: int, shared_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(init_expert_weight_(torch.empty(num_experts, in_dim, out_dim)))
        self.bias = nn.Parameter(torch.zeros(out_dim if shared_bias else (num_experts, out_dim)))
        self.shared_bias = shared_bias
        self.tag = new_tag()  # its weight gradients' bucket across recurrence steps (weight_grads)

    def forward(self, x: torch.Tensor, routing: Routing, fan_out: int, grouped_in: bool = False,
                grouped_out: bool = False, gates: Optional[torch.Tensor] = None,
                activation: str = "", pre: Optional[torch.Tensor] = None,
                keep: Optional[torch.Tensor] = None, keep_scale: float = 1.0) -> torch.Tensor:
        """x and the result in the layouts of ``routed_linear`` (token, slot or sorted rows;
        (M, out), or (N, out) summed over each token's slots with ``gates`` (N, k)); with
        ``activation``, x = act(pre) ⊙ keep · keep_scale and the gradient goes to ``pre``."""
        bias = None if self.shared_bias else self.bias
        y = routed_linear(x, self.weight, bias, routing, fan_out, grouped_in, grouped_out, gates,
                          tag=self.tag, activation=activation, pre=pre, keep=keep,
                          keep_scale=keep_scale)
        return y + self.bias if self.shared_bias else y

    def activated(self, x: torch.Tensor, routing: Routing, fan_out: int, activation: str,
                  keep: Optional[torch.Tensor] = None, keep_scale: float = 1.0):
        """(u, act(u) ⊙ keep · keep_scale): u the sorted (M, out) rows, the second the next
        map's input without a gradient (``routed_linear_activated``; own bias only)."""
        if self.shared_bias:
            raise ValueError("an output activation needs the experts' own biases")
        return routed_linear_activated(x, self.weight, self.bias, routing, fan_out, activation,
                                       keep, keep_scale, tag=self.tag)

    def dense(self, x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """E = 1: the routed map without routing, x (N, in), active (N,) bool -> (N, out):

            y_n = x_n W[0] + b[0]  where active_n, 0 elsewhere;   shared: y_n = [x_n W[0]] + b

        (with one expert every active token's one slot goes to it with gate 1)."""
        if self.weight.size(0) != 1:
            raise ValueError(f"dense is the map of one expert; this layer has {self.weight.size(0)}")
        bias = None if self.shared_bias else self.bias[0]
        y = masked_affine(x, self.weight.squeeze(0).t(), bias, active)  # a view: no gradient copy
        return y + self.bias if self.shared_bias else y

    def extra_repr(self) -> str:
        E, i, o = self.weight.shape
        return f"experts={E}, in={i}, out={o}, shared_bias={self.shared_bias}"


def rename_parameters(state_dict: dict, prefix: str, renames: dict) -> None:
    """In place, ``{prefix}.{old}`` -> ``{prefix}.{new}`` (checkpoints before ExpertLinear)."""
    for old, new in renames.items():
        key = f"{prefix}.{old}" if prefix else old
        if key in state_dict:
            state_dict[f"{prefix}.{new}" if prefix else new] = state_dict.pop(key)
