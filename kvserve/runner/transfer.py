"""Host -> device copies that do not wait for the device.

A copy from pageable host memory can block the host until the stream has drained, which would
undo async scheduling (the next step is prepared while the current one runs). Inputs are
therefore staged in pinned memory (torch's caching host allocator) and copied with
``non_blocking=True``; several small arrays travel as one tensor."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


_NUMPY_DTYPE = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32, torch.bool: np.bool_}


def to_device(data: Sequence | np.ndarray | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``data`` as a ``dtype`` tensor on ``device``; from pinned memory when the device is CUDA."""
    if isinstance(data, torch.Tensor):
        host = data.to(dtype)
    elif isinstance(data, np.ndarray):
        host = torch.from_numpy(data).to(dtype)
    else:  # via numpy: a third of torch.tensor's time for a list of Python numbers
        host = torch.from_numpy(np.array(data, dtype=_NUMPY_DTYPE[dtype]))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def rows_to_device(rows: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Several int lists in one copy; returns one contiguous device view per list, each starting
    16-byte aligned (Triton specializes kernels on pointer alignment: a view whose alignment
    followed the batch size would compile a second variant of a kernel mid-serving)."""
    per = max(1, 16 // dtype.itemsize)
    flat: list[int] = []
    starts: list[int] = []
    for r in rows:
        starts.append(len(flat))
        flat.extend(r)
        flat.extend([0] * (-len(flat) % per))
    packed = to_device(flat, dtype, device)
    return [packed[s : s + len(r)] for s, r in zip(starts, rows)]
