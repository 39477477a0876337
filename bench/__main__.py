"""Benchmark kvroom against the raw Mooncake engine on the same bytes.

    python -m bench [--quick] [--out bench/results]

Runs real services on 127.0.0.1 over TCP in synthetic-KV mode (pages stamped,
not computed; checked on the decode side after SUCCESS, outside the timing).
Every kvroom room is interleaved with two raw-engine writes of the same bytes
(blocking, and polled as the nodes wait), A B C C B A, and the median of the
runs is reported. Nothing here asserts a timing.
"""

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.http_load import Connection
from bench.raw import RawPair
from bench.report import write_report
from launcher.local_stack import LocalStack, Service
from shared.heap import freeze_startup_heap
from shared.kv_layout import KVLayout

MIB = 1 << 20
# A KV layout of an 8B-class model: 32 layers, 8 KV heads of 128, bfloat16 (128 KiB a token).
BIG = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
# The reference model's own layout (1 KiB a token), for the control plane: 64 KiB = 64 tokens.
SMALL: dict[str, Any] = {}


def layout_of(shape: dict[str, Any], page_size: int) -> KVLayout:
    return KVLayout(
        shape.get("num_layers", 2),
        shape.get("num_kv_heads", 4),
        shape.get("head_dim", 8),
        page_size,
        shape.get("dtype", "float32"),
    )


def node_args(shape: dict[str, Any], page_size: int, pool_bytes: int, *extra: str) -> list[str]:
    layout = layout_of(shape, page_size)
    args = [
        "--model",
        "synthetic",
        "--page-size",
        str(page_size),
        "--log-level",
        "WARNING",
        "--num-pages",
        str(max(16, -(-pool_bytes // layout.page_bytes))),
    ]
    for key, value in shape.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args + list(extra)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency_row(rooms: int, seconds: float, latencies: list[float]) -> dict[str, float]:
    return {
        "rooms": rooms,
        "rooms_per_s": rooms / seconds,
        "p50_ms": percentile(latencies, 0.5) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
    }


class Bench:
    def __init__(self, quick: bool, workdir: Path):
        self.quick = quick
        self.workdir = workdir
        self.runs = 1 if quick else 51
        # Aux latency samples by load: rooms one at a time, and at each in-flight level.
        self.aux_latencies: dict[str, list[float]] = {}

    def stack(self, name: str, prefill: list[str], decode: list[str]) -> tuple[LocalStack, Service, Service]:
        stack = LocalStack(
            self.workdir / name,
            bootstrap_args=["--log-level", "WARNING", "--max-prompt-tokens", "131072"],
            verify_kv=False,
        )
        p, d = stack.start(prefill, decode)
        return stack, p, d

    def room(self, client: httpx.Client, tokens: int) -> dict[str, Any]:
        # One request that answers when the room finished: no client traffic during the transfer.
        created = client.post(
            "/rooms", params={"wait": 30}, json={"input_ids": [65] * tokens, "max_new_tokens": 1}
        )
        created.raise_for_status()
        body: dict[str, Any] = created.json()
        while not body["finished"]:
            body = client.get(f"/rooms/{body['room']}", params={"wait": 30}).json()
        room = body["room"]
        if body["state"] != "SUCCESS" or body["outcome"] != "completed":  # synthetic KV checked its stamps
            raise RuntimeError(f"room {room} did not deliver intact KV: {body}")
        for _ in range(100):  # the prefill's own report (its writes) may trail the decode's
            if "bytes_written" in body["timings"]:
                break
            time.sleep(0.01)
            body = client.get(f"/rooms/{room}").json()
        self.aux_latencies.setdefault("1", []).append(body["timings"]["aux_latency_s"])
        return body

    def transfer(
        self,
        sizes_mib: list[int],
        page_size: int,
        raw: RawPair,
        scatter: bool = False,
    ) -> list[dict[str, Any]]:
        """kvroom (decode request to SUCCESS) against the raw engine, same bytes, same write count.

        The raw engine writes twice per run: with its blocking batch call, the
        baseline, and submitted and polled the way the nodes wait over TCP. The
        three alternate A B C C B A, so none always runs right after another.
        """
        layout = layout_of(BIG, page_size)
        pool = max(sizes_mib) * MIB + 8 * layout.page_bytes
        decode_extra = ["--scatter-pages"] if scatter else []
        stack, _, _ = self.stack(
            f"transfer-p{page_size}{'-scatter' if scatter else ''}",
            node_args(BIG, page_size, pool),
            node_args(BIG, page_size, pool, *decode_extra),
        )
        rows = []
        try:
            with stack.client() as client:
                self.room(client, layout.page_size)  # warm the connection between the engines
                for size in sizes_mib:
                    tokens = size * MIB // (layout.page_bytes // layout.page_size)
                    # A first room of the size tells what moves: whole pages, in how many writes.
                    timings = self.room(client, tokens)["timings"]
                    moved, count = int(timings["bytes_written"]), int(timings["engine_writes"])
                    ours, blocking, polled, writes, engine = self._side_by_side(
                        client, raw, tokens, moved, count
                    )
                    kv, rw, rp = (statistics.median(v) for v in (ours, blocking, polled))
                    rows.append(
                        {
                            "kv_mib": size,
                            "moved_mib": moved / MIB,
                            "page_size": page_size,
                            "page_kib": layout.page_bytes // 1024,
                            "scattered": scatter,
                            "engine_writes": statistics.median(writes),
                            "kvroom_s": kv,
                            "raw_s": rw,
                            "raw_polled_s": rp,
                            # The prefill's own engine call, inside the room's time.
                            "kvroom_engine_s": statistics.median(engine),
                            "kvroom_gbps": moved / kv / 1e9,
                            "raw_gbps": moved / rw / 1e9,
                            "raw_polled_gbps": moved / rp / 1e9,
                            "ratio": rw / kv,
                            "ratio_polled": rp / kv,
                            # What kvroom adds to the same writes waited for the same way,
                            # from runs side by side.
                            "added_ms": statistics.median(o - t for o, t in zip(ours, polled, strict=True))
                            * 1000,
                        }
                    )
        finally:
            stack.stop()
        return rows

    def _side_by_side(
        self, client: httpx.Client, raw: RawPair, tokens: int, moved: int, count: int
    ) -> tuple[list[float], list[float], list[float], list[int], list[float]]:
        """Per run: seconds of a kvroom room, a raw blocking write and a raw polled write;
        the room's engine writes and engine seconds."""
        ours: list[float] = []
        blocking: list[float] = []
        polled: list[float] = []
        writes: list[int] = []
        engine: list[float] = []

        def kvroom() -> None:
            timings = self.room(client, tokens)["timings"]
            ours.append(timings["request_to_success_s"])
            writes.append(int(timings["engine_writes"]))
            engine.append(timings["transfer_s"])

        sides = [
            kvroom,
            lambda: blocking.append(raw.write(moved, count)),
            lambda: polled.append(raw.write(moved, count, polled=True)),
        ]
        for run in range(self.runs):
            for side in sides if run % 2 == 0 else sides[::-1]:
                side()
        return ours, blocking, polled, writes, engine

    def control_plane(
        self, levels: list[int], rooms_per_level: int, blocks: int, block_rooms: int
    ) -> tuple[list[dict[str, Any]], dict, list[dict[str, Any]]]:
        """Rooms per second through POST /rooms with 64 KiB of KV, and resident memory.

        Then ``blocks`` blocks of ``block_rooms`` rooms at the highest level, one
        after another: whether a room costs more once many rooms were served.
        """
        stack, p, d = self.stack("control", node_args(SMALL, 16, 64 * MIB), node_args(SMALL, 16, 64 * MIB))
        pids = {"bootstrap": stack.bootstrap, "prefill": p, "decode": d}
        memory: dict[str, dict[str, float]] = {
            n: {"idle_mib": rss_mib(s.proc.pid), "peak_mib": 0.0} for n, s in pids.items() if s.proc
        }
        rows = []
        try:
            for in_flight in levels:
                sampling = threading.Event()

                def sample(level: int = in_flight, stop: threading.Event = sampling) -> None:
                    while not stop.is_set():
                        for n, s in pids.items():
                            if s.proc and level == max(levels):
                                memory[n]["peak_mib"] = max(memory[n]["peak_mib"], rss_mib(s.proc.pid))
                        time.sleep(0.05)

                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                count = rooms_per_level if in_flight > 1 else max(8, rooms_per_level // 8)
                seconds, latencies = asyncio.run(self._drive(stack.bootstrap.url, in_flight, count))
                sampling.set()
                sampler.join()
                rows.append({"in_flight": in_flight, **latency_row(count, seconds, latencies)})
            sustained = []
            served = sum(r["rooms"] for r in rows)
            for _ in range(blocks):
                seconds, latencies = asyncio.run(
                    self._drive(stack.bootstrap.url, max(levels), block_rooms, record_aux=False)
                )
                sustained.append(
                    {
                        "served_before": served,
                        **latency_row(block_rooms, seconds, latencies),
                        "rss_mib": {n: rss_mib(s.proc.pid) for n, s in pids.items() if s.proc},
                    }
                )
                served += block_rooms
        finally:
            stack.stop()
        return rows, memory, sustained

    async def _drive(
        self, url: str, in_flight: int, count: int, record_aux: bool = True
    ) -> tuple[float, list[float]]:
        """``count`` rooms through POST /rooms, ``in_flight`` at a time; wall seconds and latencies."""
        latencies: list[float] = []
        todo = iter(range(count))

        async def worker() -> None:
            conn = await Connection.open(url)
            try:
                for _ in todo:
                    started = time.perf_counter()
                    status, room = await conn.request(
                        "POST", "/rooms", {"input_ids": [66] * 64, "max_new_tokens": 1}
                    )
                    if status != 201:
                        raise RuntimeError(f"POST /rooms answered {status}: {room}")
                    body = room
                    while not body["finished"]:
                        _, body = await conn.request("GET", f"/rooms/{room['room']}?wait=30")
                    latencies.append(time.perf_counter() - started)
                    if body["state"] != "SUCCESS":
                        raise RuntimeError(f"room {room['room']} ended {body['state']}: {body['reason']}")
                    if record_aux:
                        self.aux_latencies.setdefault(str(in_flight), []).append(
                            body["timings"]["aux_latency_s"]
                        )
            finally:
                await conn.close()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(in_flight)))
        return time.perf_counter() - started, latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, one run: checks the benchmark works"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    sizes = [1] if args.quick else [1, 4, 16, 64, 256]
    page_sizes = [16] if args.quick else [1, 4, 16, 64]
    started = time.time()
    freeze_startup_heap()  # the client's own collector pauses would count as room latency
    with tempfile.TemporaryDirectory(prefix="kvroom-bench-") as tmp:
        bench = Bench(args.quick, Path(tmp))
        # Rooms move whole pages: room for the largest size plus one of the largest pages.
        raw = RawPair(max(sizes) * MIB + layout_of(BIG, max(page_sizes)).page_bytes)
        try:
            print("transfer efficiency", flush=True)
            transfer = bench.transfer(sizes, 16, raw)
            print("page-size sweep", flush=True)
            sweep = [
                row for ps in page_sizes for row in bench.transfer([16 if not args.quick else 1], ps, raw)
            ]
            print("scattered versus contiguous pages", flush=True)
            scatter_size = [1 if args.quick else 16]
            scatter = bench.transfer(scatter_size, 1, raw) + bench.transfer(
                scatter_size, 1, raw, scatter=True
            )
        finally:
            raw.close()
        print("control plane", flush=True)
        control, memory, sustained = (
            bench.control_plane([1, 8], 16, blocks=2, block_rooms=16)
            if args.quick
            else bench.control_plane([1, 8, 64], 512, blocks=12, block_rooms=1024)
        )
    results = {
        "machine": {
            "cpus": len(__import__("os").sched_getaffinity(0)),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "transport": "tcp (loopback)",
        },
        "quick": args.quick,
        "runs": bench.runs,
        "seconds": round(time.time() - started, 1),
        "transfer": transfer,
        "page_sweep": sweep,
        "scatter": scatter,
        "control_plane": control,
        "sustained": sustained,
        "aux_latency_ms": [
            {
                "in_flight": int(level),
                "samples": len(values),
                "p50": percentile(values, 0.5) * 1000,
                "p99": percentile(values, 0.99) * 1000,
            }
            for level, values in sorted(bench.aux_latencies.items(), key=lambda kv: int(kv[0]))
        ],
        "memory": memory,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    write_report(results, args.out)
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
