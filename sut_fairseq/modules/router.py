"""Top-k router with gating dropout and the routing statistics for the auxiliary losses.

``g(e | h) = softmax(W2 · dropout(tanh(W1 h)))`` (docs/model.md#routers, the reference code's MLP
router); the k largest gates are kept and renormalised to sum to 1. Inactive rows
(halted or padding positions) go to the no-op expert E with gate 0.

While recording (``RoutingStats`` attached, see ``routing_stats.py``), each call adds,
over the active rows x in X, ``Σ_x g(·|x)``, ``Σ_x Σ_e g(e|x) log g(e|x)``, ``|X|`` and the
per-expert assignment counts: sums only, O(E) memory for the L_MIM of a whole forward.
"""
from typing import Optional

import torch
import torch.nn as nn

from ..ops import Routing, make_routing
from ..compiler import tracing
from ..ops.masked_linear_op import masked_linear
from ..ops.reference_linear import _autocast_dtype, expert_gemm, kernel_backend
from ..ops.route_op import EPS, routing_sums, top_k_by_argmax
from ..ops.short_softmax import softmax_lastdim
from .dropout import Dropout, keep_mask


class RouterStats:
    """Sums over the (position, step) pairs a router saw during one recorded forward, in
    one vector ``sums`` (..., 2 E + 2) = [Σ_x g(·|x) (E) | top-k picks per expert (E) |
    Σ_x Σ_e g log g | |X|], the layout of ``route_op.routing_sums``, which
    ``sut::route_top_k`` adds to (a leading dimension: ``stack_stats``' R routers)."""

    def __init__(self, num_experts: int, device=None, grad: bool = False):
        """Zeros on ``device`` (fixed attribute types for a compiled step). ``grad``: the
        sums start as a leaf requiring grad, as they are after the first call, so that
        dynamo (which specialises on ``requires_grad``) compiles one step graph."""
        self.num_experts = num_experts
        self.sums = torch.zeros(2 * num_experts + 2, device=device, requires_grad=grad)

    @classmethod
    def of_sums(cls, sums: torch.Tensor, num_experts: int) -> "RouterStats":
        """Statistics over sums (..., 2 E + 2) already made (e.g. several routers' stacked)."""
        stats = cls.__new__(cls)
        stats.num_experts, stats.sums = num_experts, sums
        return stats

    @property
    def sum_probs(self) -> torch.Tensor:
        """(..., E) Σ_x g(e|x)."""
        return self.sums[..., :self.num_experts]

    @property
    def assignments(self) -> torch.Tensor:
        """(..., E) top-k picks per expert (no gradient)."""
        return self.sums[..., self.num_experts:2 * self.num_experts].detach()

    @property
    def sum_neg_entropy(self) -> torch.Tensor:
        """(...) Σ_x Σ_e g(e|x) log g(e|x)."""
        return self.sums[..., 2 * self.num_experts]

    @property
    def count(self) -> torch.Tensor:
        """(...) |X| (no gradient)."""
        return self.sums[..., 2 * self.num_experts + 1].detach()

    def add(self, probs: torch.Tensor, expert_idxs: torch.Tensor,
            active: Optional[torch.Tensor] = None):
        """probs: (N, E) fp32 router distributions of one call; expert_idxs: (N, k) their
        top-k picks; active: (N,) bool, the rows that count (None: all). No host sync."""
        self.sums = self.sums + routing_sums(probs, expert_idxs, active)


class Router(nn.Module):
    """Picks k of E experts per row (E = 1: no parameters, every active row to expert 0).
    ``sample_topk``: how many of the k are sampled from g(·|h) rather than taken greedily,
    in training only (``sut_big`` used 1)."""

    def __init__(self, input_dim: int, num_experts: int, top_k: int, hidden_dim: int,
                 gating_dropout: float = 0.0, sample_topk: int = 0, gated_dim: int = 0):
        """``gated_dim``: the input width of the expert map the gates weigh (MoMHA's output
        projection, MoE-FFD's down projection; 0: none), whose kernels return the gates'
        gradient as partial sums over its column tiles (``_gate_rows``)."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top-k must satisfy 1 <= k <= E; got k={top_k}, E={num_experts}")
        if not 0 <= sample_topk <= top_k:
            raise ValueError(f"sample-topk must be in [0, k={top_k}]; got {sample_topk}")
        self.num_experts, self.top_k, self.sample_topk = num_experts, top_k, sample_topk
        self.gated_dim = gated_dim
        self.stats: Optional[RouterStats] = None
        if num_experts > 1:
            self.fc1 = nn.Linear(input_dim, hidden_dim)
            self.fc2 = nn.Linear(hidden_dim, num_experts, bias=False)
            self.dropout = Dropout(gating_dropout)
            nn.init.xavier_uniform_(self.fc1.weight)
            nn.init.zeros_(self.fc1.bias)
            nn.init.xavier_uniform_(self.fc2.weight)

    def forward(self, x: torch.Tensor, active: torch.Tensor) -> Routing:
        """x: (N, d); active: (N,) bool. Returns the Routing of the N rows."""
        E = self.num_experts
        if E == 1:
            idx = torch.where(active, 0, 1).unsqueeze(1)
            return make_routing(idx, active.to(x.dtype).unsqueeze(1), 1)
        # data-independent shapes: inactive rows skip the hidden layer (sut::masked_linear),
        # go to the no-op expert E with gate 0 and are left out of the statistics
        if self._one_op(x):  # CUDA: the hidden layer, the logits, the choice, its sorted layout
            running = None if self.stats is None else self.stats.sums  # and statistics in two kernels
            # the op forms dropout(tanh(u)) itself on the active rows: u of every row, one GEMM
            u = self.fc1(x)
            keep, scale = self._keep_mask(u)
            rows = self._gate_rows(x)
            gates, *layout, sums = torch.ops.sut.route_top_k(
                u, self.fc2.weight, active, self.top_k, torch.float32 if rows else x.dtype,
                running, keep, scale, True, rows)
            if self.stats is not None:
                self.stats.sums = sums  # the running sums with this call's added
            if rows:  # the gates' rows for the gated map's kernels, one of them for the rest
                return Routing(layout[0], gates[0], *layout[1:], E, gate_rows=gates)
            return Routing(layout[0], gates, *layout[1:], E)
        probs, top_idx, top_gates = self._route(x, active)
        if self.stats is not None:
            self.stats.add(probs, top_idx, active)
        keep = active.unsqueeze(1)
        return make_routing(top_idx.masked_fill(~keep, E), (top_gates * keep).to(x.dtype), E)

    def _one_op(self, x: torch.Tensor) -> bool:
        """Whether the choice is ``sut::route_top_k`` (``ops/route_op.py``): where the routed
        ops run Triton (CUDA tensors, or ``SUT_KERNELS=triton``), unless some picks are
        sampled."""
        return kernel_backend(x) == "triton" and (self.sample_topk == 0 or not self.training)

    def _gate_rows(self, x: torch.Tensor) -> int:
        """R for ``sut::route_top_k``'s gates (R, N, k) (0: (N, k)): the column tiles of the
        gated map's input-gradient kernel, whose partial sums of the gate gradient then
        arrive as the R rows' gradients and the router's backward kernel adds them up as it
        reads them (no kernel of their own that sums and casts them); the gates are then
        fp32, which the kernels read. Where the gated map runs on the Triton kernels and
        autograd records (no gradient, no partials: decoding keeps (N, k) gates)."""
        if (not self.gated_dim or not torch.is_grad_enabled() or kernel_backend(x) != "triton"
                or expert_gemm() != "kernels"):
            return 0
        from ..kernels.routed_linear_triton import max_column_tiles

        dtype = _autocast_dtype(x.device.type) or x.dtype
        return max_column_tiles(self.gated_dim, dtype, x.device)

    def _keep_mask(self, u: torch.Tensor):
        """The gating dropout's mask for ``sut::route_top_k`` (``pre_tanh``): (keep (n,
        hidden) bool, 1 / (1 - p)), or (None, 1.0) in evaluation and at p = 0."""
        return keep_mask(u, self.dropout.p, self.training)

    def _hidden(self, x: torch.Tensor, active: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: (n, d) -> dropout(tanh(W1 x)) (n, hidden), in the compute dtype; rows outside
        ``active`` (n,) bool get a zero hidden layer (the caller drops them)."""
        hidden = self.fc1(x) if active is None else masked_linear(x, self.fc1, active)
        return self.dropout(torch.tanh(hidden))

    def _logits(self, x: torch.Tensor, active: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: (n, d) -> W2 · ``_hidden`` (n, E), in the compute dtype (``sut::route_top_k``
        multiplies by W2 itself)."""
        return self.fc2(self._hidden(x, active))

    def _route(self, x: torch.Tensor, active: Optional[torch.Tensor] = None):
        """x: (n, d) -> g(·|x) (n, E) fp32, the k picks (n, k) and their renormalised gates;
        rows outside ``active`` (n,) bool get a zero hidden layer (the caller drops them)."""
        logits = self._logits(x, active)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least
        probs = softmax_lastdim(logits)  # g(e|h)
        top_idx = self._select(logits, probs)
        top = probs.gather(1, top_idx)
        return probs, top_idx, top / top.sum(1, keepdim=True).clamp_min(EPS)

    def _select(self, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        k, n_sample = self.top_k, self.sample_topk if self.training else 0
        if n_sample == 0:
            return top_k_by_argmax(probs, k) if _argmax_top_k(probs) else probs.topk(k, dim=1).indices
        greedy = probs.topk(k - n_sample, dim=1).indices
        # Gumbel-top-n over the experts not already taken = sampling without replacement.
        gumbel = -torch.log(-torch.log(torch.rand_like(logits).clamp(EPS, 1 - EPS)))
        scores = (logits + gumbel).scatter(1, greedy, float("-inf"))
        return torch.cat([greedy, scores.topk(n_sample, dim=1).indices], 1)

    def extra_repr(self) -> str:
        return f"E={self.num_experts}, k={self.top_k}, sample_topk={self.sample_topk}"


def _argmax_top_k(probs: torch.Tensor) -> bool:
    """Whether ``_select`` picks by ``top_k_by_argmax`` (a compiled step on CUDA, where the
    reductions fuse) rather than ``topk`` (eager, and the CPU)."""
    return probs.is_cuda and tracing()
