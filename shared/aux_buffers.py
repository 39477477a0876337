"""CPU buffers for the per-room aux metadata, one slot per room in flight.

The aux record is the fixed little-endian layout below. It arrives as the
third frame of a DONE_AUX message, is copied into the room's slot, and the
room is validated from what landed in the slot, not from the frame.
"""

import collections
import struct
from dataclasses import dataclass

from shared.errors import AuxValidationError, PoolExhausted

# room id (int64), first output token (int32), cached-token count (int32),
# logprob of the first token (float32)
AUX_RECORD = struct.Struct("<qiif")
_ZERO_RECORD = bytes(AUX_RECORD.size)  # what a freed slot holds


@dataclass(frozen=True)
class Aux:
    room: int
    first_token: int
    cached_tokens: int
    logprob: float

    def pack(self) -> bytes:
        return AUX_RECORD.pack(self.room, self.first_token, self.cached_tokens, self.logprob)


class AuxBuffers:
    """``slots`` aux records back to back in one CPU buffer, in the wire layout.

    A record is copied in and out whole: one memory copy per room, where a
    store per field would cost a Python call each.
    """

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError("aux buffers need at least one slot")
        self.slots = slots
        # Always on the CPU: the aux never rides the asynchronous KV transport.
        self._records = memoryview(bytearray(slots * AUX_RECORD.size))
        self._free: collections.deque[int] = collections.deque(range(slots))
        self._used: set[int] = set()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise PoolExhausted("no free aux slot")
        slot = self._free.popleft()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"aux slot {slot} freed but not in use")
        self._record(slot)[:] = _ZERO_RECORD
        self._used.remove(slot)
        self._free.append(slot)

    def write(self, slot: int, record: memoryview | bytes) -> None:
        """Copy a wire record into ``slot``; the caller owns the slot."""
        if slot not in self._used:
            raise AuxValidationError(f"aux slot {slot} is not allocated")
        if len(record) != AUX_RECORD.size:
            raise AuxValidationError(f"aux record of {len(record)} bytes, expected {AUX_RECORD.size}")
        self._record(slot)[:] = record

    def read(self, slot: int) -> Aux:
        return Aux(*AUX_RECORD.unpack(self._record(slot)))

    def _record(self, slot: int) -> memoryview:
        return self._records[slot * AUX_RECORD.size : (slot + 1) * AUX_RECORD.size]

    def validate(self, slot: int, room: int, prompt_len: int, vocab_size: int) -> Aux:
        """The record in ``slot`` as landed, or AuxValidationError if it is not this room's."""
        aux = self.read(slot)
        if aux.room != room:
            raise AuxValidationError(f"aux slot {slot} holds room {aux.room}, expected {room}")
        if aux.cached_tokens != prompt_len:
            raise AuxValidationError(f"aux says {aux.cached_tokens} cached tokens, expected {prompt_len}")
        if not 0 <= aux.first_token < vocab_size:
            raise AuxValidationError(f"aux first token {aux.first_token} outside vocabulary")
        return aux
