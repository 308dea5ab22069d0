"""Prefix caching for hybrid models ('align' mode): recurrent-state snapshots keyed by block hash.

A cached attention prefix is only usable together with the GDN state reached at its end. The
scheduler ends prefill steps on multiples of the snapshot interval (``--mamba-block-size``); at
the end of such a step the runner copies the sequence's live state into a snapshot slot, entered
here under the chained hash of the prefix's last block. A later request whose cached attention
prefix reaches that block resumes from a copy of the snapshot.

A snapshot written by a step becomes readable when the next step is scheduled (by then the step
that writes it is ahead of any reader on the device's stream), and is dropped if its request is
aborted before that (the step may never have run). Confirmed snapshots are evicted LRU-first.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshotCache:
    """Snapshot slots ``0 .. num_slots - 1``: block hash -> slot, with pending entries per request."""

    def __init__(self, num_slots: int, interval: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}.")
        self.num_slots = num_slots
        self.interval = interval  # tokens between snapshot positions (a multiple of the block size)
        self._free = list(range(num_slots - 1, -1, -1))
        self._confirmed: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._pending: dict[str, list[tuple[bytes, int]]] = {}  # written by the step not yet confirmed
        self._pending_hashes: set[bytes] = set()

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding the state at the end of this block, if confirmed (marks it recently used)."""
        slot = self._confirmed.get(block_hash)
        if slot is not None:
            self._confirmed.move_to_end(block_hash)
        return slot

    def reserve(self, request_id: str, block_hash: bytes) -> int | None:
        """A slot for the state the request reaches at the end of this block, or None when the block
        already has one (or every slot is pending). Evicts the least recently used snapshot."""
        if block_hash in self._confirmed or block_hash in self._pending_hashes:
            return None
        if self._free:
            slot = self._free.pop()
        elif self._confirmed:
            _, slot = self._confirmed.popitem(last=False)
        else:
            return None
        self._pending.setdefault(request_id, []).append((block_hash, slot))
        self._pending_hashes.add(block_hash)
        return slot

    def confirm(self) -> None:
        """The step that wrote the pending snapshots ran (or runs ahead of every later reader)."""
        for entries in self._pending.values():
            for block_hash, slot in entries:
                self._confirmed[block_hash] = slot
        self._pending.clear()
        self._pending_hashes.clear()

    def drop_pending(self, request_id: str) -> None:
        """Forget the request's unconfirmed snapshots (its step may not have written them)."""
        for block_hash, slot in self._pending.pop(request_id, []):
            self._pending_hashes.discard(block_hash)
            self._free.append(slot)

    def reset(self) -> None:
        """Forget every snapshot (``reset_prefix_cache``, called with no request holding blocks)."""
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._confirmed.clear()
        self._pending.clear()
        self._pending_hashes.clear()

    @property
    def num_cached(self) -> int:
        return len(self._confirmed)

    def check_invariants(self) -> None:
        pending = [slot for entries in self._pending.values() for _, slot in entries]
        held = list(self._confirmed.values()) + pending
        assert len(set(held)) == len(held), "a snapshot slot is held twice"
        assert sorted(held + self._free) == list(range(self.num_slots)), "a snapshot slot leaked"
        assert self._pending_hashes == {h for entries in self._pending.values() for h, _ in entries}
        assert not self._pending_hashes & self._confirmed.keys(), "a block has two snapshots"
