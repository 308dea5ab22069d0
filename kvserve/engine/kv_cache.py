"""Paged KV bookkeeping: a block pool with reference counts and an LRU free queue, chained
block hashes for prefix caching, and the per-request manager the scheduler talks to."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvserve.engine.request import Request
from kvserve.engine.state_cache import StateSnapshotCache


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block is in the prefix cache


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Chained hash of a full block: depends on every token before it, not only its own."""
    h = hashlib.sha256(parent or b"kvserve")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockPool:
    """All KV blocks; free ones in LRU order (evicted from the head), cached ones by hash."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > len(self.free_queue):
            raise ValueError(f"Cannot get {n} free blocks from the pool ({len(self.free_queue)} free).")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference to prefix-cache hits (removing free ones from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop a reference; blocks reaching zero go to the tail of the free queue in the given order."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block.block_id}"
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Enter a full block into the prefix cache; False if caching is off or the hash is taken."""
        if self.enable_caching and block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            return True
        return False

    def uncache(self, block: KVBlock) -> None:
        """Drop a block's hash (its K/V cannot be trusted); the block itself stays where it is."""
        self._evict(block)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True


class KVCacheManager:
    """Maps requests to blocks: prefix-cache lookup, slot allocation, freeing. For hybrid models
    with prefix caching, ``snapshots`` holds the recurrent states a cache hit must resume from."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True,
        snapshots: StateSnapshotCache | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.snapshots = snapshots if enable_caching else None
        if self.snapshots is not None and self.snapshots.interval % block_size:
            raise ValueError(
                f"the state snapshot interval ({self.snapshots.interval}) must be a multiple of "
                f"block_size ({block_size})"
            )
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}  # the same blocks as ids, kept in step
        self._num_cached_blocks: dict[str, int] = {}
        # Blocks are entered into the prefix cache when their slots are allocated, i.e. before the
        # step that writes their K/V has run (vLLM does the same; it lets a request admitted later
        # in the same step hit them). Until the next step begins they are "unconfirmed": should
        # that step fail, ``uncache_unconfirmed`` takes them out again.
        self._unconfirmed: dict[str, list[KVBlock]] = {}
        # hybrid models: snapshot slots being written by the step not yet confirmed, per request,
        # with the token count their prefix ends at (its hash is taken when the step is confirmed)
        self._snapshots_in_flight: dict[str, list[tuple[Request, int, int]]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def _update_block_hashes(self, request: Request) -> None:
        bs, hashes = self.block_size, request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks; the last token is always recomputed (for logits)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed (vLLM skips the cache read)
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.snapshots is not None:  # hybrid: only a prefix whose end state was snapshotted counts
            n = len(hits)
            while n > 0 and self.snapshots.lookup(request.block_hashes[n - 1]) is None:
                n -= 1
            del hits[n:]
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Reserve blocks so that ``num_new_tokens`` more tokens fit; False (nothing changed) if not."""
        rid, bs = request.request_id, self.block_size
        blocks = self.req_to_blocks.get(rid)
        if blocks is not None and not new_computed_blocks:
            # a running request (a decode, or the next prefill chunk): the common case, kept short
            total = request.num_computed_tokens + num_new_tokens
            num_needed = -(-total // bs) - len(blocks)
            if num_needed > 0:  # a decode needs a block every block_size steps
                if num_needed > self.pool.num_free_blocks:
                    return False
                new = self.pool.get_new_blocks(num_needed)
                blocks.extend(new)
                self._block_ids[rid].extend(b.block_id for b in new)
            if self.enable_caching:
                full = min(total, len(request.all_token_ids))
                if full // bs > self._num_cached_blocks.get(rid, 0):
                    self._cache_full_blocks(request, blocks, full)
            return True
        new_computed_blocks = new_computed_blocks or []
        blocks = blocks if blocks is not None else []
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        total = num_computed + num_new_tokens
        num_needed = -(-total // bs) - len(blocks) - len(new_computed_blocks)
        reclaimable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - reclaimable:
            return False
        self.pool.touch(new_computed_blocks)
        blocks = self.req_to_blocks.setdefault(rid, blocks)
        blocks.extend(new_computed_blocks)
        if num_needed > 0:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        self._block_ids[rid] = [b.block_id for b in blocks]
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(total, request.num_tokens))
        return True

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        self._update_block_hashes(request)
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        for i in range(start, end):
            if self.pool.cache_block(blocks[i], request.block_hashes[i]):
                self._unconfirmed.setdefault(request.request_id, []).append(blocks[i])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def confirm_cached_blocks(self) -> None:
        """The previous step ran to completion: the blocks it cached hold valid K/V (and the
        snapshots it took, valid states)."""
        self._unconfirmed.clear()
        if self._snapshots_in_flight:
            for entries in self._snapshots_in_flight.values():
                for request, end, slot in entries:
                    self._publish_snapshot(request, end, slot)
            self._snapshots_in_flight.clear()

    def _publish_snapshot(self, request: Request, end: int, slot: int) -> None:
        assert self.snapshots is not None
        if len(request.all_token_ids) < end:  # cannot happen: the step's input tokens are known now
            self.snapshots.release(slot)
            return
        self._update_block_hashes(request)
        self.snapshots.publish(request.block_hashes[end // self.block_size - 1], slot)

    def uncache_unconfirmed(self, request: Request) -> None:
        """Take the blocks this request cached for the step not yet confirmed out of the prefix
        cache (the step may never have written them). Call before ``free``."""
        for block in self._unconfirmed.pop(request.request_id, []):
            self.pool.uncache(block)
        for _, _, slot in self._snapshots_in_flight.pop(request.request_id, []):
            assert self.snapshots is not None
            self.snapshots.release(slot)

    def snapshot_to_restore(self, request: Request, num_hit_tokens: int) -> int | None:
        """The snapshot slot a request admitted with this many cached tokens resumes from."""
        if self.snapshots is None or num_hit_tokens == 0:
            return None
        slot = self.snapshots.lookup(request.block_hashes[num_hit_tokens // self.block_size - 1])
        assert slot is not None, "a hybrid prefix hit without its state snapshot"
        return slot

    def prefix_junction(self, request: Request, num_hit_tokens: int) -> int | None:
        """Where a hybrid request's cached attention prefix ends when it goes past its state hit
        (``num_hit_tokens``): the point where this prompt leaves one seen before, e.g. the end of a
        shared system prompt. A snapshot there lets the next request sharing it resume there."""
        if self.snapshots is None or request.sampling_params.prompt_logprobs is not None:
            return None
        n, max_blocks = num_hit_tokens // self.block_size, (request.num_tokens - 1) // self.block_size
        while n < max_blocks and self.pool.lookup(request.block_hashes[n]) is not None:
            n += 1
        return n * self.block_size if n * self.block_size > num_hit_tokens else None

    def snapshot_to_save(self, request: Request, end: int, junction: int | None = None) -> int | None:
        """A snapshot slot for the state a step ending at token ``end`` reaches, when ``end`` is a
        snapshot position or the request's prefix junction (and, if its tokens are known, no
        snapshot of that prefix exists). With async scheduling a decode's input token may still be
        on the device: the prefix is named when the step is confirmed."""
        snaps = self.snapshots
        if snaps is None or (end % snaps.interval and end != junction):
            return None
        if end <= request.num_tokens:
            self._update_block_hashes(request)
            if request.block_hashes[end // self.block_size - 1] in snaps:
                return None
        slot = snaps.take()
        if slot is not None:
            self._snapshots_in_flight.setdefault(request.request_id, []).append((request, end, slot))
        return slot

    def align_prefill(self, request: Request, num_computed: int, num_new: int, junction: int | None = None) -> int:
        """'align' mode (vLLM's Mamba chunk alignment): cut a prefill step so that it ends on a
        snapshot position; the last whole interval of the known tokens ends a step of its own,
        the tail after it runs in the next one. A step too short to reach a position is kept.
        A prefix junction inside the step ends it there (so it can be snapshotted)."""
        if self.snapshots is None:
            return num_new
        interval, end = self.snapshots.interval, num_computed + num_new
        last = request.num_tokens // interval * interval
        if end < last:
            aligned = end // interval * interval
            end = aligned if aligned > num_computed else end
        elif num_computed < last < end:
            end = last
        if junction is not None and num_computed < junction < end:
            end = junction
        return end - num_computed

    def free(self, request: Request) -> None:
        """Release all of a request's blocks, tail first (so a prefix outlives its suffix in the cache)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._unconfirmed.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block ids."""
        return list(self._block_ids.get(request_id, ()))

    def block_ids_view(self, request_id: str) -> list[int]:
        """The request's block ids without a copy (grows as blocks are added): for this step only."""
        return self._block_ids.get(request_id, [])

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.snapshots is not None:
            self._snapshots_in_flight.clear()
            self.snapshots.reset()
        return True

    def check_invariants(self) -> None:
        """Every reference is accounted for; used by tests."""
        if self.snapshots is not None:
            self.snapshots.check_invariants()
            in_flight = [slot for entries in self._snapshots_in_flight.values() for _, _, slot in entries]
            assert sorted(in_flight) == sorted(self.snapshots._taken), "snapshot slots in flight out of step"
        counts = [0] * self.pool.num_blocks
        assert self._block_ids.keys() == self.req_to_blocks.keys()
        for rid, blocks in self.req_to_blocks.items():
            assert self._block_ids[rid] == [b.block_id for b in blocks], f"block ids of {rid} out of step"
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                counts[b.block_id] += 1
        for b in self.pool.blocks:
            assert b.ref_cnt == counts[b.block_id], f"block {b.block_id}: ref {b.ref_cnt} != {counts[b.block_id]}"
            assert (b.ref_cnt == 0) == (b.block_id in self.pool.free_queue), f"block {b.block_id} free-queue mismatch"
