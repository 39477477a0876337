"""A seeded generator of random and mutated kvroom frames."""

import random
import struct

from shared.kv.aux_buffers import Aux
from shared.wire import protocol

Frames = list[bytes]


def _room(rng: random.Random) -> int:
    return rng.choice([0, 1, -1, 1 << 53, (1 << 53) - 1, rng.getrandbits(52), rng.getrandbits(64)])


def _int(rng: random.Random) -> int:
    return rng.choice([0, 1, -1, 7, 1 << 31, 1 << 40, rng.getrandbits(20), -rng.getrandbits(20)])


def _peers(rng: random.Random) -> list[protocol.PeerRank]:
    return [
        protocol.PeerRank(
            _int(rng),
            f"127.0.0.1:{rng.randrange(1, 65536)}",
            rng.choice(
                ["tcp://127.0.0.1:1", "not an endpoint", "", f"tcp://127.0.0.1:{rng.randrange(1, 65536)}"]
            ),
            rng.choice(["", "x" * 40, "?" * 40]),
            _int(rng),
            _int(rng),
        )
        for _ in range(rng.randrange(0, 3))
    ]


def forgery(rng: random.Random) -> Frames:
    """A well-formed message that only the bootstrap or a room's peer may send."""
    room = rng.getrandbits(52) + 1
    peer = protocol.PeerRank(0, "127.0.0.1:1", "tcp://127.0.0.1:1", "x" * 40, 0, 4)
    return protocol.encode(
        rng.choice(
            [
                protocol.PrefillRoom(room, [65, 66], "decode-0", [peer]),
                protocol.DecodeRoom(room, 2, 3, "prefill-0", [peer]),
                protocol.AbortRoom(room, 0, "aborted"),
                protocol.RevokeLease(room, 0, "aborted"),
                protocol.RoomReports(
                    "decode-0",
                    [protocol.RoomStatus(transfer=room, state=4, output_ids=[33], outcome="completed")],
                ),
            ]
        )
    )


def random_message(rng: random.Random) -> Frames:
    """A message of a random kind with random, often invalid, field values."""
    room, rank = _room(rng), _int(rng)
    builders = [
        lambda: protocol.PrefillRoom(
            room, [rng.randrange(-5, 300) for _ in range(rng.randrange(0, 50))], "d", _peers(rng)
        ),
        lambda: protocol.DecodeRoom(room, _int(rng), _int(rng), "p", _peers(rng)),
        lambda: protocol.AbortRoom(room, rank, "aborted", rng.random() < 0.5),
        lambda: protocol.RevokeLease(room, rank, "aborted"),
        lambda: protocol.Assignments(
            [protocol.PrefillRoom(room, [rng.randrange(-5, 300)], "d", _peers(rng))],
            [protocol.DecodeRoom(room, _int(rng), _int(rng), "p", _peers(rng))],
            [protocol.AbortRoom(room, rank, "aborted")],
        ),
        lambda: protocol.TransferRequest(
            room,
            rank,
            _int(rng),
            _int(rng),
            _int(rng),
            _int(rng),
            [_int(rng) for _ in range(rng.randrange(0, 20))],
            _int(rng),
        ),
        lambda: protocol.TransferRequests(
            [protocol.TransferRequest(room, rank, _int(rng), _int(rng), _int(rng), _int(rng), [_int(rng)], 0)]
        ),
        lambda: protocol.TransferAccepted(room, rank, _int(rng)),
        lambda: protocol.TransferStarted(room, rank, _int(rng)),
        lambda: protocol.RoomReleased(room, rank, _int(rng), rng.choice(["", "aborted"])),
        lambda: protocol.RoomReports("node", [protocol.RoomStatus(transfer=room, state=_int(rng))]),
        lambda: protocol.RoomReports(
            "decode-0", [protocol.RoomStatus(transfer=room, state=4, output_ids=[65], outcome="completed")]
        ),
        lambda: protocol.RoomTokens("decode-0", [protocol.TokenChunk(room, 0, [65])]),
        lambda: protocol.RankStates(rank, [protocol.RankState(room, 4)]),
        lambda: protocol.RankAgreed([protocol.RankState(room, 4)]),
    ]
    if rng.random() < 0.2:
        digests = [rng.getrandbits(63) for _ in range(rng.randrange(3))] if rng.random() < 0.5 else None
        done = protocol.DoneAux(room, rank, _int(rng), _int(rng), _int(rng), _int(rng), 0.0, digests)
        aux = Aux(rng.getrandbits(52), rng.randrange(300), rng.randrange(100), 0.0).pack()
        return protocol.encode(done, aux[: rng.choice([24, 24, 23, 0, 8])] + b"\0" * rng.choice([0, 0, 1]))
    return protocol.encode(rng.choice(builders)())


def mutate(rng: random.Random, frames: Frames) -> Frames:
    frames = [bytearray(f) for f in frames]
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(6)
        i = rng.randrange(len(frames))
        f = frames[i]
        if op == 0 and f:
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        elif op == 1 and f:
            del f[rng.randrange(len(f)) :]
        elif op == 2:
            f.extend(rng.randbytes(rng.randrange(1, 16)))
        elif op == 3 and len(frames) > 1:
            del frames[i]
        elif op == 4:
            frames.insert(i, bytearray(rng.randbytes(rng.randrange(0, 10))))
        elif op == 5 and f:
            f[rng.randrange(len(f))] = rng.randrange(256)
    return [bytes(f) for f in frames]


def garbage(rng: random.Random) -> Frames:
    header = struct.pack("!4sHB", b"KVRM", rng.choice([2, 2, 1, 3]), rng.randrange(256))
    first = header if rng.random() < 0.5 else rng.randbytes(rng.randrange(0, 12))
    return [first, *(rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(0, 4)))]


def fuzz_frames(seed: int, count: int) -> list[Frames]:
    rng = random.Random(seed)
    out: list[Frames] = []
    for _ in range(count):
        r = rng.random()
        if r < 0.1:
            out.append(forgery(rng))
        elif r < 0.35:
            out.append(random_message(rng))
        elif r < 0.8:
            out.append(mutate(rng, random_message(rng)))
        else:
            out.append(garbage(rng))
    # A few bodies over the protocol's limit, still under the socket's.
    for i in range(0, count, max(1, count // 4)):
        out[i] = [
            struct.pack("!4sHB", b"KVRM", protocol.PROTOCOL_VERSION, 4),
            b"\x90" * (protocol.MAX_BODY_BYTES + 1),
        ]
    return out
