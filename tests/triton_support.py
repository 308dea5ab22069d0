"""Helpers for tests of the Triton kernels: interpreter detection, the kernel device, and fixes for
two Triton-interpreter bugs: its float down-conversion (shared/docs/reference/cpu-environment.md §3)
and ``tl.dot`` on bf16 operands (it multiplies the raw uint16 bit patterns).

``triton.jit`` picks interpreter or compiler when a kernel module is imported, so conftest.py sets
``TRITON_INTERPRET=1`` (no CUDA) before any ``kvserve.kernels.triton_*`` import."""

from __future__ import annotations

import os

import pytest
import torch

_TRUE = ("1", "true", "on", "yes")


def interpreter_active() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET`` set to a true value)."""
    try:
        from triton import knobs  # triton >= 3.4 parses the variable here

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def kernel_device() -> str:
    """The device for kernel tests: "cuda" when available, else "cpu" (needs the interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def skip_without_triton_device() -> pytest.MarkDecorator:
    """Skip marker for kernel tests: they need CUDA or ``TRITON_INTERPRET=1`` (and triton)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return pytest.mark.skip(reason="triton is not installed")
    return pytest.mark.skipif(
        not torch.cuda.is_available() and not interpreter_active(),
        reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1 "
        "(set before importing kvserve.kernels.triton_*)",
    )


def patch_interpreter_downcast() -> bool:
    """Make the interpreter's float down-casts (fp32/fp16/bf16 -> fp16/bf16/fp8) torch's casts:
    round to nearest even, e4m3fn saturation, no dropped mantissa carry. Idempotent; returns
    whether the patch is in place (False when triton is missing)."""
    try:
        import numpy as np
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    if getattr(interp._convert_float, "_kvserve_patched", False):
        return True
    original = interp._convert_float
    torch_of = {
        tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2, tl.bfloat16: torch.bfloat16,
        tl.float16: torch.float16, tl.float32: torch.float32,
    }
    int_bits = {8: np.uint8, 16: np.int16, 32: np.int32}
    out_bits = {8: (torch.uint8, np.uint8), 16: (torch.int16, np.uint16)}

    def convert(inp, in_dt, out_dt, rounding_mode):
        if in_dt in torch_of and out_dt in torch_of and out_dt.primitive_bitwidth < in_dt.primitive_bitwidth:
            raw = np.ascontiguousarray(inp).view(int_bits[in_dt.primitive_bitwidth]).copy()
            out = torch.from_numpy(raw).view(torch_of[in_dt]).to(torch_of[out_dt])
            t_int, np_int = out_bits[out_dt.primitive_bitwidth]
            return out.view(t_int).numpy().view(np_int).reshape(np.shape(inp))
        return original(inp, in_dt, out_dt, rounding_mode)

    convert._kvserve_patched = True  # type: ignore[attr-defined]
    interp._convert_float = convert
    return True


def patch_interpreter_dot() -> bool:
    """Make the interpreter's ``tl.dot`` read bf16 operands as numbers: triton 3.9 hands their
    uint16 storage to ``np.matmul`` (triton-lang/triton#11584; the fix PR #11585 was closed
    unmerged). They are widened exactly to fp32 first. Idempotent."""
    try:
        import numpy as np
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    builder = interp.InterpreterBuilder
    if getattr(builder.create_dot, "_kvserve_patched", False):
        return True
    original = builder.create_dot

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = np.ascontiguousarray(h.data).view(np.uint16).astype(np.uint32) << 16
        return interp.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._kvserve_patched = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot
    return True


def patch_interpreter() -> bool:
    """Both interpreter fixes (down-casts, bf16 ``tl.dot``); what conftest.py applies."""
    return patch_interpreter_downcast() and patch_interpreter_dot()
