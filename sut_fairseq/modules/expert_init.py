"""Initialisation of stacked expert weights (E, in, out)."""
import math

import torch


def init_expert_weight_(weight: torch.Tensor) -> torch.Tensor:
    """Xavier-uniform per expert, as fairseq initialises a dense nn.Linear(in, out)."""
    fan_in, fan_out = weight.size(1), weight.size(2)
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    with torch.no_grad():
        return weight.uniform_(-bound, bound)
