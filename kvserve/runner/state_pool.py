"""Recurrent-state slots of hybrid models (Gated DeltaNet layers): one slot per running sequence.

A GDN layer keeps, per sequence, a conv state ``[conv_dim, W - 1]`` (model dtype) and an SSM state
``[HV, K, V]`` (float32), in tensors of ``num_slots`` rows bound to the layer; the slot of a
request is the row it reads and writes. Slots live in their own pool next to the attention pages
(DESIGN.md §3), ``max_num_seqs`` of them, so admission never waits for one. A request takes a slot
when it is first scheduled and gives it back when it finishes, is aborted or is preempted (its state
is then rebuilt by recomputing the prompt, like its KV pages).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StateSpec:
    """Shapes and dtypes of one GDN layer's per-sequence state (for the memory planner and log)."""

    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, int, int]
    conv_bytes_per_elem: int
    ssm_bytes_per_elem: int = 4

    @property
    def bytes_per_sequence(self) -> int:
        conv = self.conv_shape[0] * self.conv_shape[1] * self.conv_bytes_per_elem
        ssm = self.ssm_shape[0] * self.ssm_shape[1] * self.ssm_shape[2] * self.ssm_bytes_per_elem
        return conv + ssm


class StatePool:
    """Maps request ids to state slots ``0 .. num_slots - 1``; never hands one slot to two requests."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot first
        self._slot_of: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holds(self, request_id: str) -> bool:
        return request_id in self._slot_of

    def slot(self, request_id: str) -> int:
        """The request's slot, taken from the free list on first use."""
        slot = self._slot_of.get(request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(
                    f"no free recurrent-state slot for request {request_id!r}: all {self.num_slots} are held "
                    f"(more running sequences than max_num_seqs)"
                )
            slot = self._slot_of[request_id] = self._free.pop()
        return slot

    def free(self, request_id: str) -> None:
        """Give the request's slot back (no-op if it holds none)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_invariants(self) -> None:
        held = list(self._slot_of.values())
        assert len(set(held)) == len(held), "a slot is held by two requests"
        assert not set(held) & set(self._free), "a held slot is also free"
        assert sorted(held + self._free) == list(range(self.num_slots)), "a slot leaked"
