"""Routed (expert) linear algebra: the routing bookkeeping and the routed-linear op.

`routing.py` turns a top-k expert choice into the sorted layout every expert op uses;
`routed_linear.py` is the one operation both MoE-FFD and MoMHA are built from, with a
plain-PyTorch reference path (the CPU path and the test oracle) and a Triton path on CUDA.
"""
from .routing import Routing, make_routing
from .routed_linear import routed_linear

__all__ = ["Routing", "make_routing", "routed_linear"]
