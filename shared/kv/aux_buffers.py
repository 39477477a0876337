"""CPU buffers for the per-room aux metadata, one slot per room and prefill rank in flight.

The aux record is the fixed little-endian layout below, ending in a crc32 of
everything before it (the room id included), so a record changed anywhere on
the way never reads as intact. It arrives as the third frame of a DONE_AUX
message, is copied into its slot, and the room is validated from what landed
in the slot, not from the frame.
"""

import collections
import struct
import zlib
from dataclasses import dataclass

from shared.errors import AuxValidationError, PoolExhausted

# transfer id (int64), first output token (int32), cached-token count (int32),
# logprob of the first token (float32), crc32 of the 20 bytes before it (uint32)
AUX_RECORD = struct.Struct("<qiifI")
_FIELDS = struct.Struct("<qiif")
_ZERO_RECORD = bytes(AUX_RECORD.size)  # what a freed slot holds


@dataclass(frozen=True)
class Aux:
    transfer: int
    first_token: int
    cached_tokens: int
    logprob: float

    def pack(self) -> bytes:
        fields = _FIELDS.pack(self.transfer, self.first_token, self.cached_tokens, self.logprob)
        return fields + struct.pack("<I", zlib.crc32(fields))


def record_digest(record: bytes | memoryview) -> int:
    """The crc32 a record carries in its last four bytes."""
    return int(struct.unpack_from("<I", record, _FIELDS.size)[0])


def unpack(record: bytes | memoryview) -> Aux | None:
    """The record's fields, or None if it is not an intact record."""
    if len(record) != AUX_RECORD.size:
        return None
    transfer, first, cached, logprob, crc = AUX_RECORD.unpack(record)
    if zlib.crc32(memoryview(record)[: _FIELDS.size]) != crc:
        return None
    return Aux(transfer, first, cached, logprob)


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

    def write(self, slot: int, record: memoryview | bytes) -> bytes:
        """Copy a wire record into ``slot`` (the caller owns it); return the record as it landed."""
        if slot not in self._used:
            raise AuxValidationError(f"aux slot {slot} is not allocated")
        if len(record) != AUX_RECORD.size:
            raise AuxValidationError(f"aux record of {len(record)} bytes, expected {AUX_RECORD.size}")
        view = self._record(slot)
        view[:] = record
        return bytes(view)

    def read(self, slot: int) -> bytes:
        return bytes(self._record(slot))

    def _record(self, slot: int) -> memoryview:
        return self._records[slot * AUX_RECORD.size : (slot + 1) * AUX_RECORD.size]
