"""Prefix caching for hybrid models ('align' mode): recurrent-state snapshots keyed by block hash.

A cached attention prefix is only usable together with the GDN state reached at its end. The
scheduler ends prefill steps on multiples of the snapshot interval (``--mamba-block-size``); at
the end of such a step the runner copies the sequence's live state into a snapshot slot, which is
published here under the chained hash of the prefix's last block. A later request whose cached
attention prefix reaches that block resumes from a copy of the snapshot.

A slot is taken when the step that writes it is scheduled and published when the next step is
scheduled (by then the writing step is ahead of any reader on the device's stream, and the step's
input tokens, which name the prefix, are known even under async scheduling); it is released if its
request is aborted first (the step may never have run). Published snapshots are evicted LRU-first.
"""

from __future__ import annotations

from collections import OrderedDict


def snapshot_interval_tokens(state_bytes_per_layer: int, kv_bytes_per_token_per_layer: int, block_size: int) -> int:
    """vLLM's align-mode hit granularity: the smallest multiple of the block size whose attention
    page of one layer holds one GDN layer's state (784 tokens on Qwen3.6-27B with bf16 KV, 1,568
    with fp8: a smaller KV element makes prefix hits coarser)."""
    tokens = -(-state_bytes_per_layer // kv_bytes_per_token_per_layer)
    return max(1, -(-tokens // block_size)) * block_size


class StateSnapshotCache:
    """Snapshot slots ``0 .. num_slots - 1``: free, taken (being written) or published under a hash."""

    def __init__(self, num_slots: int, interval: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}.")
        self.num_slots = num_slots
        self.interval = interval  # tokens between snapshot positions (a multiple of the block size)
        self._free = list(range(num_slots - 1, -1, -1))
        self._published: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._taken: set[int] = set()

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding the state at the end of this block, if published (marks it recently used)."""
        slot = self._published.get(block_hash)
        if slot is not None:
            self._published.move_to_end(block_hash)
        return slot

    def take(self) -> int | None:
        """A slot to write a snapshot into: a free one, else the least recently used published one
        (evicted); None when every slot is being written."""
        if self._free:
            slot = self._free.pop()
        elif self._published:
            _, slot = self._published.popitem(last=False)
        else:
            return None
        self._taken.add(slot)
        return slot

    def publish(self, block_hash: bytes, slot: int) -> None:
        """The taken slot now holds the state at the end of this block (released if the block
        already has a snapshot: two requests wrote the same prefix in one step)."""
        if block_hash in self._published:
            self.release(slot)
            return
        self._taken.remove(slot)
        self._published[block_hash] = slot

    def release(self, slot: int) -> None:
        """Give a taken slot back unpublished."""
        self._taken.remove(slot)
        self._free.append(slot)

    def reset(self) -> None:
        """Forget every snapshot (``reset_prefix_cache``, called with no request holding blocks)."""
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._published.clear()
        self._taken.clear()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._published

    @property
    def num_cached(self) -> int:
        return len(self._published)

    @property
    def num_taken(self) -> int:
        return len(self._taken)

    def check_invariants(self) -> None:
        held = list(self._published.values()) + list(self._taken)
        assert len(set(held)) == len(held), "a snapshot slot is held twice"
        assert sorted(held + self._free) == list(range(self.num_slots)), "a snapshot slot leaked"
