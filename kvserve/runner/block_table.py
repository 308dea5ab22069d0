"""Persistent block table for the triton backend (vLLM's ``BlockTable`` idea).

Each live request owns a row of a ``[max_num_seqs, max_blocks]`` int32 table kept on the host and
on the device. A step writes only the block ids that are new since the request's last step (a
decode adds one block every ``block_size`` tokens), copies the changed rows to the device in one
transfer, and gathers the step's rows on the device; rebuilding the whole table per step costs a
numpy row copy per request on the host."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.runner.transfer import to_device


class BlockTable:
    def __init__(self, max_rows: int, max_blocks: int, device: torch.device) -> None:
        self.max_blocks = max_blocks
        self.device = device
        self.host = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self.table = torch.zeros((max_rows, max_blocks), dtype=torch.int32, device=device)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.synced = [0] * max_rows  # entries of each row already on the device
        self.source: list[list[int] | None] = [None] * max_rows  # the KV manager's list a row mirrors

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.source[row] = None
            self.synced[row] = 0
            self.free_rows.append(row)

    def rows(self, request_ids: list[str], block_ids: list[list[int]]) -> torch.Tensor:
        """The block table of a step's sequences (``[len(request_ids), max_blocks]`` on the
        device): new entries written, changed rows copied, the step's rows gathered."""
        rows: list[int] = []
        dirty: list[int] = []
        for rid, ids in zip(request_ids, block_ids):
            row = self.row_of.get(rid)
            if row is None:
                row = self.row_of[rid] = self.free_rows.pop()
            done = self.synced[row]
            if self.source[row] is not ids or len(ids) < done:  # new request, or re-allocated after preemption
                self.source[row], done = ids, 0
            if len(ids) > done:
                self.host[row, done : len(ids)] = ids[done:]
                self.synced[row] = len(ids)
                dirty.append(row)
            rows.append(row)
        if dirty:
            changed = to_device(dirty, torch.long, self.device)
            self.table.index_copy_(0, changed, to_device(self.host[dirty], torch.int32, self.device))
        return self.table.index_select(0, to_device(rows, torch.long, self.device))
