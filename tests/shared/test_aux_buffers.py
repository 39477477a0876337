import pytest

from shared.aux_buffers import AUX_RECORD, Aux, AuxBuffers
from shared.errors import AuxValidationError, PoolExhausted


def test_slots_alloc_free_and_zero():
    buffers = AuxBuffers(2)
    a, b = buffers.alloc(), buffers.alloc()
    assert {a, b} == {0, 1} and buffers.free_slots == 0
    with pytest.raises(PoolExhausted):
        buffers.alloc()
    buffers.write(a, Aux(room=9, first_token=65, cached_tokens=3, logprob=-0.5).pack())
    buffers.free(a)
    assert buffers.read(a) == Aux(0, 0, 0, 0.0)
    with pytest.raises(ValueError):
        buffers.free(a)


def test_write_then_validate_reads_what_landed():
    buffers = AuxBuffers(4)
    slot = buffers.alloc()
    record = Aux(room=(1 << 63) - 1, first_token=120, cached_tokens=17, logprob=-1.25)
    buffers.write(slot, memoryview(record.pack()))
    assert buffers.validate(slot, room=(1 << 63) - 1, prompt_len=17, vocab_size=256) == record


@pytest.mark.parametrize(
    ("record", "why"),
    [
        (Aux(room=8, first_token=1, cached_tokens=3, logprob=0.0), "holds room 8"),
        (Aux(room=0, first_token=1, cached_tokens=3, logprob=0.0), "holds room 0"),
        (Aux(room=7, first_token=1, cached_tokens=4, logprob=0.0), "cached tokens"),
        (Aux(room=7, first_token=300, cached_tokens=3, logprob=0.0), "vocabulary"),
        (Aux(room=7, first_token=-1, cached_tokens=3, logprob=0.0), "vocabulary"),
    ],
)
def test_validation_rejects_another_rooms_record(record, why):
    buffers = AuxBuffers(1)
    slot = buffers.alloc()
    buffers.write(slot, record.pack())
    with pytest.raises(AuxValidationError, match=why):
        buffers.validate(slot, room=7, prompt_len=3, vocab_size=256)


def test_wrong_size_or_unowned_slot_is_refused():
    buffers = AuxBuffers(2)
    slot = buffers.alloc()
    with pytest.raises(AuxValidationError):
        buffers.write(slot, b"\x00" * (AUX_RECORD.size - 1))
    with pytest.raises(AuxValidationError):
        buffers.write(slot, b"\x00" * (AUX_RECORD.size + 1))
    with pytest.raises(AuxValidationError):
        buffers.write(1, b"\x00" * AUX_RECORD.size)  # not allocated
    with pytest.raises(AuxValidationError):
        buffers.write(99, b"\x00" * AUX_RECORD.size)  # out of range
