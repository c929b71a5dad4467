"""What every Triton kernel module here (``routed_linear_triton``, ``cross_entropy``,
``routing_triton``) shares to launch its kernels: the launch recorder, and the
interpreter that runs them on CPU tensors.

* ``recorder``: when set (``benchmarks/gpu_model.py``, ``aot.record_launches``), every
  launch calls ``recorder(kernel, args)`` instead of running, e.g. on "meta" tensors.
* ``interpreted(kernel)``: the kernel as Triton's interpreter runs it (tests on CPU
  tensors); it needs ``TRITON_INTERPRET=1`` set before ``triton`` was imported
  (``testing.py``), and says so otherwise.
* ``helper(fn)``: a function the kernels call: a ``JITFunction`` where they are compiled;
  in the interpreter one that runs ``fn`` as plain Python when called (the interpreter
  runs the kernels as Python) and still hashes as a ``JITFunction`` (a kernel's cache key,
  taken e.g. when it keys a dict, covers the helpers it calls).
"""
import functools

import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

recorder = None


def interpreting() -> bool:
    """Whether Triton runs ``@jit`` code (its own library included) in its interpreter."""
    return isinstance(tl.sum, InterpretedFunction)


class _PlainHelper(JITFunction):
    """A kernel helper in the interpreter: called, it runs as plain Python."""

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def helper(fn):
    """``fn`` as a function the kernels call (module docstring)."""
    return _PlainHelper(fn) if interpreting() else JITFunction(fn)


def interpreted(kernel):
    """The CPU-interpreter version of ``kernel`` (a ``JITFunction``)."""
    if not interpreting():
        raise RuntimeError("the Triton kernels run on CPU tensors only in Triton's interpreter: "
                           "set TRITON_INTERPRET=1 before triton is imported")
    return _interpreted(kernel.fn)  # keyed by the function: hashing a kernel hashes its source


@functools.lru_cache(maxsize=None)
def _interpreted(fn):
    _fix_interpreter_bf16_dot()
    return InterpretedFunction(fn)


@functools.lru_cache(maxsize=None)
def _fix_interpreter_bf16_dot():
    """Triton 3.9's interpreter keeps bf16 data as raw uint16 bits and ``tl.dot`` multiplies
    those bits as integers; widen bf16 operands to fp32 first (exact)."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(handle):
        if handle.dtype == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, *args, **kwargs):
        return original(self, widen(a), widen(b), d, *args, **kwargs)

    builder.create_dot = create_dot
