"""Triton kernels for the sparse layers (docs/model.md#kernels).

The kernels and their autotuning configurations live in ``grouped_gemm``; the backend of
the custom op ``sut::routed_linear`` (``sut_fairseq/ops/routed_linear.py``) that launches
them, ``triton_forward`` / ``triton_backward``, in ``routed_linear_triton``. The op runs
them for CUDA tensors or under ``SUT_KERNELS=triton``; ``triton_routed_linear`` is the op
with this backend forced (re-exported here).
"""
from ..ops.routed_linear import triton_routed_linear

__all__ = ["triton_routed_linear"]
