"""Programmatic dependent launch (PDL, sm_90+) for the Triton kernels of a step.

A decode step is hundreds of kernels back to back in a CUDA graph (~980 for the 27B hybrid), most
of them a few microseconds long, so the gap between one kernel's last programs and the next one's
first is a real share of the step. Launched with PDL, a kernel's programs may start while the
previous kernel's last ones still run: each kernel here first lets the next one launch
(``griddepcontrol.launch_dependents``), then waits for the previous one to finish and its writes
to be visible (``griddepcontrol.wait``), before any load or store. So no kernel touches memory
early, and the order of effects is the stream's, as without PDL; what overlaps is the launch and
the programs' start (H200, 27B MIXED_PRECISION decode step: -4.3% at c32, -4.0% at c1).

A kernel takes ``PDL: tl.constexpr`` and calls ``start(PDL)`` first; its launch passes
``**launch_options(device)``. Off the GPU (the interpreter), before sm_90, with a triton without
``griddepcontrol``, or with ``enabled`` False (benchmarks compare both), PDL is False and the
kernel is the plain one. The Gluon W4A16 kernel has its own (``GluonTiles.pdl``).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover (no triton, or one without griddepcontrol: PDL stays off)
    triton = tl = gdc_launch_dependents = gdc_wait = None

enabled = True  # the switch (benchmarks A/B it); read at each launch


@functools.lru_cache(maxsize=None)
def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch with PDL: CUDA sm_90+ and a triton with griddepcontrol."""
    return gdc_wait is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def launch_options(device: torch.device) -> dict:
    """The keyword arguments of a launch on ``device``: the kernel's ``PDL`` and, when it is on,
    triton's ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if enabled and supported(device) else {"PDL": False}


if triton is not None:

    @triton.jit
    def start(PDL: tl.constexpr):
        """A kernel's first statement: with PDL, let the next kernel launch, then wait for the previous one."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
