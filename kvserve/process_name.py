"""Name the current process as ``ps`` / ``top`` show it (Linux ``/proc/<pid>/comm``, 15 characters),
as vLLM titles its processes: ``EngineCore``, ``ApiServer_<i>``. A no-op where prctl is missing."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15


def set_process_name(name: str) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
