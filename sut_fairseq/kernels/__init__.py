"""Triton kernels for the sparse layers (docs/model.md#kernels).

``triton_routed_linear(x, weight, bias, routing, fan_out, grouped_in, grouped_out, gates)``
is the Triton implementation of ``sut_fairseq.ops.routed_linear`` (same signature and
result as ``reference_routed_linear``), used for CUDA tensors or ``SUT_KERNELS=triton``.
Kernels and their autotuning configurations live in ``grouped_gemm``; the autograd
Function and launchers in ``routed_linear_function``.
"""
from .routed_linear_function import RoutedLinearFunction, triton_routed_linear

__all__ = ["RoutedLinearFunction", "triton_routed_linear"]
