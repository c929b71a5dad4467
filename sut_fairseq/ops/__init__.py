"""Routed (expert) linear algebra: ``routing.py`` turns a top-k expert choice into the sorted
layout every expert op uses; ``routed_linear.py`` is the one operation MoE-FFD and MoMHA are
built from (a PyTorch reference backend and a Triton one)."""
from .routing import Routing, make_routing
from .routed_linear import routed_linear

__all__ = ["Routing", "make_routing", "routed_linear"]
