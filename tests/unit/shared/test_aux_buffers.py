"""Aux records (24 bytes ending in their own crc32) and the CPU slots they land in."""

import struct
import zlib

import pytest

from shared.errors import AuxValidationError, PoolExhausted
from shared.kv.aux_buffers import AUX_RECORD, Aux, AuxBuffers, record_digest, unpack

RECORD = Aux(transfer=(1 << 53) - 1, first_token=120, cached_tokens=17, logprob=-1.25)


def test_record_layout_is_24_bytes_ending_in_the_crc_of_the_rest():
    packed = RECORD.pack()
    assert AUX_RECORD.format == "<qiifI" and AUX_RECORD.size == len(packed) == 24
    assert packed[:20] == struct.pack("<qiif", RECORD.transfer, 120, 17, -1.25)
    assert packed[20:] == struct.pack("<I", zlib.crc32(packed[:20]))
    assert record_digest(packed) == zlib.crc32(packed[:20])
    assert record_digest(memoryview(packed)) == record_digest(packed)


def test_an_intact_record_unpacks_to_its_fields():
    assert unpack(RECORD.pack()) == RECORD
    assert unpack(memoryview(RECORD.pack())) == RECORD
    assert unpack(Aux(0, 0, 0, 0.0).pack()) == Aux(0, 0, 0, 0.0)  # room 0 is intact, just not a room


@pytest.mark.parametrize("bit", range(AUX_RECORD.size * 8))
def test_any_single_flipped_bit_makes_the_record_unreadable(bit):
    packed = bytearray(RECORD.pack())
    packed[bit // 8] ^= 1 << (bit % 8)
    assert unpack(bytes(packed)) is None


@pytest.mark.parametrize("size", [0, 20, 23, 25, 48])
def test_a_record_of_the_wrong_size_is_unreadable(size):
    assert unpack((RECORD.pack() * 2)[:size]) is None


def test_a_freed_slot_reads_as_zeros_and_no_record():
    assert unpack(bytes(AUX_RECORD.size)) is None  # crc32 of 20 zero bytes is not 0


def test_slots_alloc_free_and_zero():
    buffers = AuxBuffers(2)
    a, b = buffers.alloc(), buffers.alloc()
    assert {a, b} == {0, 1} and buffers.free_slots == 0
    with pytest.raises(PoolExhausted):
        buffers.alloc()
    buffers.write(a, RECORD.pack())
    buffers.write(b, RECORD.pack())
    buffers.free(a)
    assert buffers.read(a) == bytes(AUX_RECORD.size)
    assert buffers.read(b) == RECORD.pack()  # the neighbour is untouched
    assert buffers.free_slots == 1
    with pytest.raises(ValueError):
        buffers.free(a)
    assert buffers.alloc() == a


def test_at_least_one_slot():
    with pytest.raises(ValueError):
        AuxBuffers(0)


def test_write_returns_the_record_as_it_landed():
    buffers = AuxBuffers(4)
    slot = buffers.alloc()
    landed = buffers.write(slot, memoryview(RECORD.pack()))
    assert landed == RECORD.pack() == buffers.read(slot)
    assert isinstance(landed, bytes)
    other = Aux(transfer=9, first_token=1, cached_tokens=2, logprob=0.0).pack()
    assert buffers.write(slot, other) == other  # a second record replaces the first whole


def test_wrong_size_or_unowned_slot_is_refused():
    buffers = AuxBuffers(2)
    slot = buffers.alloc()
    with pytest.raises(AuxValidationError):
        buffers.write(slot, b"\x00" * (AUX_RECORD.size - 1))
    with pytest.raises(AuxValidationError):
        buffers.write(slot, b"\x00" * (AUX_RECORD.size + 1))
    with pytest.raises(AuxValidationError):
        buffers.write(1, RECORD.pack())  # not allocated
    with pytest.raises(AuxValidationError):
        buffers.write(99, RECORD.pack())  # out of range
    assert buffers.read(slot) == buffers.read(1) == bytes(AUX_RECORD.size)  # nothing was written
