"""Routed (expert) linear algebra: ``routing.py`` turns a top-k expert choice into the sorted
layout every expert op uses; ``routed_linear.py`` is the one operation MoE-FFD and MoMHA are
built from (a PyTorch reference backend, a Triton one, and PyTorch's grouped GEMM:
``grouped_linear.py``)."""
from .routing import Routing, make_routing
from .routed_linear import routed_linear

__all__ = ["Routing", "make_routing", "routed_linear"]
