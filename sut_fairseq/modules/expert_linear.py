"""``ExpertLinear``: E linear maps in -> out, one per expert, applied to routed rows.

    y_s = x_s W[e_s] + b[e_s]        W (E, in, out), b (E, out): every expert's in one tensor

The layer of MoE-FFD's up and down projections and of MoMHA's query and output
projections; it owns the parameters and their initialisation, and calls the one custom
op, ``sut::routed_linear`` (``ops/routed_linear.py``: row layouts, backends), with a
``Routing`` (``ops/routing.py``).
"""
import math
from typing import Optional

import torch
import torch.nn as nn

from ..ops.routed_linear import routed_linear
from ..ops.routing import Routing


def init_expert_weight_(weight: torch.Tensor) -> torch.Tensor:
    """Xavier-uniform per expert, as fairseq initialises a dense nn.Linear(in, out):
    U(-a, a) with a = sqrt(6 / (in + out)) on each (in, out) slice."""
    bound = math.sqrt(6.0 / (weight.size(1) + weight.size(2)))
    with torch.no_grad():
        return weight.uniform_(-bound, bound)


class ExpertLinear(nn.Module):
    """``num_experts`` maps ``in_dim -> out_dim``: weight (E, in, out), Xavier-uniform per
    expert, and a zero bias: one per expert, (E, out), or with ``shared_bias`` one (out,)
    added once after the gated sum of a token's slots (MoMHA's b_o):

        y_s = x_s W[e_s] + b[e_s]            or, shared:  y_n = Σ_j g_nj x_nj W[e_nj] + b
    """

    def __init__(self, num_experts: int, in_dim: int, out_dim: int, shared_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(init_expert_weight_(torch.empty(num_experts, in_dim, out_dim)))
        self.bias = nn.Parameter(torch.zeros(out_dim if shared_bias else (num_experts, out_dim)))
        self.shared_bias = shared_bias

    def forward(self, x: torch.Tensor, routing: Routing, fan_out: int, grouped_in: bool = False,
                grouped_out: bool = False, gates: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x and the result in the layouts of ``routed_linear`` (token, slot or sorted rows;
        (M, out), or (N, out) summed over each token's slots with ``gates`` (N, k))."""
        if self.shared_bias:
            return routed_linear(x, self.weight, None, routing, fan_out, grouped_in, grouped_out,
                                 gates) + self.bias
        return routed_linear(x, self.weight, self.bias, routing, fan_out, grouped_in, grouped_out, gates)

    def extra_repr(self) -> str:
        E, i, o = self.weight.shape
        return f"experts={E}, in={i}, out={o}, shared_bias={self.shared_bias}"


def rename_parameters(state_dict: dict, prefix: str, renames: dict) -> None:
    """Checkpoints written before the expert layers were ``ExpertLinear``s: rename
    ``{prefix}.{old}`` to ``{prefix}.{new}`` for each (old, new) of ``renames`` (in place)."""
    for old, new in renames.items():
        key = f"{prefix}.{old}" if prefix else old
        if key in state_dict:
            state_dict[f"{prefix}.{new}" if prefix else new] = state_dict.pop(key)
