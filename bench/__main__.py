"""Benchmark kvroom against the raw Mooncake engine on the same bytes.

    python -m bench [--quick] [--out bench/results]
    python -m bench --vllm-only [--quick] [--out bench/results]
    python -m bench --against REF [--quick] [--out bench/results]
    python -m bench --vllm-only --against REF [--quick] [--out bench/results]

Runs real services on 127.0.0.1 over TCP in synthetic-KV mode (pages stamped,
not computed; checked on the decode side after SUCCESS, outside the timing).
Every comparison is interleaved: within one run each side takes its turn, in an
order reversed every other run, and a ratio or a difference is taken between
neighbours of one run before the median over runs. Nothing here asserts a timing.

With ``--against REF`` the rooms, the control plane and the model run on this tree's
stacks and on REF's (checked out beside, each version's services importing their own
tree) in turn, and each row is judged: not worse, or worse (bench/against.py). With
``--vllm-only --against REF`` so does kvroom's vLLM pair (bench/vllm.py), into against-vllm.md.

A full run ends with the vLLM section (bench/vllm.py): real vLLM CPU servers, one plain, a PD pair
with vLLM's MooncakeConnector and a PD pair with KvroomConnector, taking turns (about ten minutes;
it needs .venv-vllm). ``--vllm-only`` runs that section alone and puts it into the results.json
already in ``--out`` (the other sections as they were), or into a new one.
"""

import argparse
import asyncio
import functools
import json
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench.against import ROOT, compare, describe, tree_env, worktree
from bench.http_load import Connection
from bench.raw import RawPair
from bench.report import size_label, write_against_report, write_against_vllm_report, write_report
from bench.vllm import code_env as vllm_code_env
from bench.vllm import run as run_vllm
from bench.vllm import run_against as run_vllm_against
from bench.zmq_pair import ZmqPair
from bootstrap.settings import BootstrapSettings
from launcher.local_stack import LocalStack, Service
from shared.heap import freeze_startup_heap
from shared.kv.layout import KVLayout

KIB, MIB = 1 << 10, 1 << 20
# The KV layout of an 8B-class model: 32 layers, 8 KV heads of 128, bfloat16, one token a page
# (128 KiB): a room of N KiB moves N KiB.
BIG = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "page_size": 1}
# The reference model's own layout (1 KiB a token), for the control plane: 64 tokens = 64 KiB.
SMALL: dict[str, Any] = {"page_size": 16}
# The stages of a room from the decode's transfer request to SUCCESS, by the nodes' wall clocks.
STAGES = {
    "request_hop": ("requested_at", "request_received_at"),
    "hand_off": ("request_received_at", "write_started_at"),
    "engine_write": ("write_started_at", "write_done_at"),
    "done_hop": ("write_done_at", "done_received_at"),
    "gate_to_success": ("done_received_at", "success_at"),
}


def layout_of(shape: dict[str, Any]) -> KVLayout:
    return KVLayout(
        shape.get("num_layers", 2),
        shape.get("num_kv_heads", 4),
        shape.get("head_dim", 8),
        shape["page_size"],
        shape.get("dtype", "float32"),
    )


def node_args(shape: dict[str, Any], pool_bytes: int, *extra: str) -> list[str]:
    layout = layout_of(shape)
    args = ["--model", "synthetic", "--log-level", "WARNING"]
    args += ["--num-pages", str(max(16, -(-pool_bytes // layout.page_bytes)))]
    for key, value in shape.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args + list(extra)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def service_rss(service: Service) -> float:
    """Resident memory of a service with all its rank processes."""
    assert service.proc is not None
    pids = [service.proc.pid]
    children = Path(f"/proc/{service.proc.pid}/task/{service.proc.pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    return sum(rss_mib(p) for p in pids if Path(f"/proc/{p}").exists())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(seconds: float) -> float:
    return seconds * 1000


def interleaved(sides: dict[str, Callable[[], Any]], runs: int) -> dict[str, list[Any]]:
    """Each side once a run, the order reversed every other run (A B C, C B A, ...)."""
    samples: dict[str, list[Any]] = {name: [] for name in sides}
    order = list(sides)
    for run in range(runs):
        for name in order if run % 2 == 0 else order[::-1]:
            samples[name].append(sides[name]())
    return samples


def paired_median(a: list[float], b: list[float]) -> float:
    """Median of the differences between neighbours of one run."""
    return statistics.median(x - y for x, y in zip(a, b, strict=True))


def stages_ms(timings: list[dict[str, float]]) -> dict[str, float]:
    return {
        name: statistics.median(ms(t[end] - t[start]) for t in timings)
        for name, (start, end) in STAGES.items()
    }


class Bench:
    def __init__(self, quick: bool, workdir: Path):
        self.quick = quick
        self.workdir = workdir
        self.runs = 5 if quick else 31
        self.stacks: list[LocalStack] = []

    def stack(
        self,
        name: str,
        prefill: list[str],
        decode: list[str],
        secure: bool = True,
        verify_kv: bool = False,
        bootstrap: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> LocalStack:
        stack = LocalStack(
            self.workdir / name,
            env=env,
            bootstrap_args=["--log-level", "WARNING", "--max-prompt-tokens", "131072", *(bootstrap or [])],
            secure=secure,
            verify_kv=verify_kv,
        )
        self.stacks.append(stack)
        stack.start(prefill, decode)
        return stack

    def close(self) -> None:
        for stack in self.stacks:
            stack.stop()
        self.stacks = []

    @staticmethod
    def room(client: httpx.Client, tokens: int) -> dict[str, float]:
        """One room of ``tokens`` tokens, posted with ``?wait=`` (the client is silent while it
        transfers); its timings once both nodes reported."""
        created = client.post(
            "/rooms", params={"wait": 30}, json={"input_ids": [65] * tokens, "max_new_tokens": 1}
        )
        created.raise_for_status()
        body: dict[str, Any] = created.json()
        while not body["finished"]:
            body = client.get(f"/rooms/{body['room']}", params={"wait": 30}).json()
        if body["state"] != "SUCCESS" or body["outcome"] != "completed":  # synthetic KV checked its stamps
            raise RuntimeError(f"room {body['room']} did not deliver intact KV: {body}")
        for _ in range(200):  # the prefill's own report (its writes) may trail the decode's
            if "write_done_at" in body["timings"]:
                return body["timings"]
            time.sleep(0.005)
            body = client.get(f"/rooms/{body['room']}").json()
        raise RuntimeError(f"room {body['room']}: the prefill never reported its writes")

    @classmethod
    def request_to_success(cls, client: httpx.Client, tokens: int) -> float:
        return cls.room(client, tokens)["request_to_success_s"]

    # -- transfer: kvroom against the raw engine ---------------------------------------

    def transfer(self, sizes_kib: list[int]) -> list[dict[str, Any]]:
        """A room (decode's transfer request to SUCCESS) against the raw engine writing the same
        bytes in the same writes: blocking, and submitted and polled as the nodes wait over TCP;
        and two bare ZMQ messages, the least the room's request and done+aux could cost."""
        layout = layout_of(BIG)
        pool = max(sizes_kib) * KIB + 8 * layout.page_bytes
        stack = self.stack("transfer", node_args(BIG, pool), node_args(BIG, pool))
        raw = RawPair(pool)
        messages = ZmqPair()
        rows = []
        try:
            with stack.client() as client:
                self.room(client, 1)  # the engines' connection, opened once
                for size in sizes_kib:
                    tokens = size * KIB // layout.page_bytes
                    first = self.room(client, tokens)
                    moved, count = int(first["bytes_written"]), int(first["engine_writes"])
                    samples = interleaved(
                        {
                            "kvroom": functools.partial(self.room, client, tokens),
                            "raw": functools.partial(raw.write, moved, count),
                            "raw_polled": functools.partial(raw.write, moved, count, polled=True),
                            "messages": messages.round_trip,
                        },
                        self.runs,
                    )
                    ours = [t["request_to_success_s"] for t in samples["kvroom"]]
                    rows.append(
                        {
                            "kv_kib": size,
                            "moved_kib": moved // KIB,
                            "engine_writes": count,
                            "kvroom_ms": ms(statistics.median(ours)),
                            "raw_ms": ms(statistics.median(samples["raw"])),
                            "raw_polled_ms": ms(statistics.median(samples["raw_polled"])),
                            "added_ms": ms(paired_median(ours, samples["raw_polled"])),
                            "messages_ms": ms(statistics.median(samples["messages"])),
                            # kvroom's bytes/s over raw polled's, neighbour by neighbour
                            "speed_vs_polled": statistics.median(
                                p / o for p, o in zip(samples["raw_polled"], ours, strict=True)
                            ),
                            "stages_ms": stages_ms(samples["kvroom"]),
                        }
                    )
        finally:
            raw.close()
            messages.close()
        return rows

    # -- what CURVE and verified KV cost ---------------------------------------------------

    def options(self, sizes_kib: list[int]) -> list[dict[str, Any]]:
        """Rooms of each size on three stacks side by side: the default (CURVE, no digests),
        plain ZMQ, and verified KV; each against the default, neighbour by neighbour."""
        layout = layout_of(BIG)
        pool = max(sizes_kib) * KIB + 8 * layout.page_bytes
        args = node_args(BIG, pool)
        variants = {
            "CURVE, KV not verified (the default)": self.stack("opt-default", args, args),
            "plain ZMQ": self.stack("opt-plain", args, args, secure=False),
            "CURVE and --verify-kv": self.stack("opt-verify", args, args, verify_kv=True),
        }
        clients = {name: s.client() for name, s in variants.items()}
        rows = []
        try:
            for client in clients.values():
                self.room(client, 1)
            for size_kib in sizes_kib:
                tokens = size_kib * KIB // layout.page_bytes
                samples = interleaved(
                    {
                        name: functools.partial(self.request_to_success, c, tokens)
                        for name, c in clients.items()
                    },
                    3 * self.runs,  # a difference of tenths of a millisecond to find
                )
                base = samples[next(iter(variants))]
                rows += [
                    {
                        "variant": name,
                        "kv_kib": size_kib,
                        "kvroom_ms": ms(statistics.median(values)),
                        "vs_default_ms": ms(paired_median(values, base)),
                        "vs_default_ratio": statistics.median(
                            v / b for v, b in zip(values, base, strict=True)
                        ),
                    }
                    for name, values in samples.items()
                ]
        finally:
            for client in clients.values():
                client.close()
        return rows

    # -- tensor parallelism ----------------------------------------------------------------

    def tensor_parallel(self, size_kib: int, shapes: list[tuple[int, int, str]]) -> list[dict[str, Any]]:
        """Rooms between nodes of (prefill TP, decode TP) ranks, the decode's ranks agreeing
        over ``agreement``, all stacks up at once and taking turns."""
        layout = layout_of(BIG)
        tokens = size_kib * KIB // layout.page_bytes
        pool = size_kib * KIB + 8 * layout.page_bytes
        stacks = {}
        for np_, nd, agreement in shapes:
            stacks[(np_, nd, agreement)] = self.stack(
                f"tp-{np_}-{nd}-{agreement}",
                node_args(BIG, pool, "--tp-size", str(np_), "--agreement", agreement),
                node_args(BIG, pool, "--tp-size", str(nd), "--agreement", agreement),
            )
        clients = {shape: s.client() for shape, s in stacks.items()}
        try:
            firsts = {shape: self.room(c, tokens) for shape, c in clients.items()}
            samples = interleaved(
                {str(shape): functools.partial(self.room, c, tokens) for shape, c in clients.items()},
                self.runs,
            )
        finally:
            for client in clients.values():
                client.close()
        return [
            {
                "prefill_tp": shape[0],
                "decode_tp": shape[1],
                "agreement": shape[2],
                "kv_kib": size_kib,
                # The writes of prefill rank 0: the leader reports its own rank's timings.
                "engine_writes": int(firsts[shape]["engine_writes"]),
                "kvroom_ms": ms(statistics.median(t["request_to_success_s"] for t in samples[str(shape)])),
            }
            for shape in stacks
        ]

    # -- control plane and memory --------------------------------------------------------

    def control_plane(
        self, levels: list[int], rooms_per_level: int, curve_blocks: int, blocks: int, block_rooms: int
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        """Rooms through POST /rooms with 64 KiB of KV at each in-flight level; then CURVE on
        and off at the highest, block by block in turn; then ``blocks`` blocks of
        ``block_rooms`` rooms one after another, with each service's resident memory."""
        secure = self.stack("control", node_args(SMALL, 64 * MIB), node_args(SMALL, 64 * MIB))
        plain = self.stack(
            "control-plain", node_args(SMALL, 64 * MIB), node_args(SMALL, 64 * MIB), secure=False
        )
        rows = []
        for in_flight in levels:
            count = rooms_per_level if in_flight > 1 else max(8, rooms_per_level // 8)
            rows.append(
                {"in_flight": in_flight, **asyncio.run(drive(secure.bootstrap.url, in_flight, count))}
            )
        curve: dict[str, list[dict[str, Any]]] = {"CURVE": [], "plain ZMQ": []}
        for block in range(2 * curve_blocks):
            name, stack = (("CURVE", secure), ("plain ZMQ", plain))[block % 2]
            curve[name].append(asyncio.run(drive(stack.bootstrap.url, max(levels), rooms_per_level)))
        curve_rows = [
            {
                "zmq": name,
                "in_flight": max(levels),
                "rooms_per_s": statistics.median(b["rooms_per_s"] for b in got),
                "p50_ms": statistics.median(b["p50_ms"] for b in got),
                "aux_p99_ms": statistics.median(b["aux_p99_ms"] for b in got),
            }
            for name, got in curve.items()
        ]
        services = dict(zip(("bootstrap", "prefill", "decode"), secure.services, strict=True))
        sustained = []
        served = sum(r["rooms"] for r in rows) + curve_blocks * rooms_per_level
        for _ in range(blocks):
            got = asyncio.run(drive(secure.bootstrap.url, max(levels), block_rooms))
            sustained.append(
                {"served_before": served, **got, "rss_mib": {n: service_rss(s) for n, s in services.items()}}
            )
            served += block_rooms
        return rows, curve_rows, sustained

    # -- a Hugging Face model: time to first token ------------------------------------------

    def model(self, levels: list[tuple[int, int]], max_tokens: int) -> list[dict[str, Any]]:
        """A tiny Llama through /v1/completions with ``stream``: time to the first token,
        ``(concurrency, requests)`` per level."""
        from launcher.tiny_model import write_tiny_model

        path = str(write_tiny_model("llama", self.workdir / "tiny-llama"))
        args = ["--model", path, "--log-level", "WARNING"]
        stack = self.stack("model", args, args, bootstrap=["--model", path])
        rows = []
        for concurrency, requests in levels:
            ttft, total = asyncio.run(
                stream_completions(stack.bootstrap.url, concurrency, requests, max_tokens)
            )
            rows.append(
                {
                    "model": "tiny-llama",
                    "concurrency": concurrency,
                    "requests": requests,
                    "max_tokens": max_tokens,
                    "ttft_p50_ms": ms(percentile(ttft, 0.5)),
                    "ttft_p99_ms": ms(percentile(ttft, 0.99)),
                    "total_p50_ms": ms(percentile(total, 0.5)),
                }
            )
        return rows


async def drive(url: str, in_flight: int, count: int) -> dict[str, Any]:
    """``count`` rooms through POST /rooms, ``in_flight`` at a time."""
    latencies: list[float] = []
    to_success: list[float] = []
    aux: list[float] = []
    todo = iter(range(count))

    async def worker() -> None:
        conn = await Connection.open(url)
        try:
            for _ in todo:
                started = time.perf_counter()
                status, body = await conn.request(
                    "POST", "/rooms?wait=30", {"input_ids": [66] * 64, "max_new_tokens": 1}
                )
                if status != 201:
                    raise RuntimeError(f"POST /rooms answered {status}: {body}")
                while not body["finished"]:
                    _, body = await conn.request("GET", f"/rooms/{body['room']}?wait=30")
                latencies.append(time.perf_counter() - started)
                if body["state"] != "SUCCESS":
                    raise RuntimeError(f"room {body['room']} ended {body['state']}: {body['reason']}")
                to_success.append(body["timings"]["request_to_success_s"])
                aux.append(body["timings"]["aux_latency_s"])
        finally:
            await conn.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    seconds = time.perf_counter() - started
    return {
        "rooms": count,
        "rooms_per_s": count / seconds,
        "p50_ms": ms(percentile(latencies, 0.5)),
        "p99_ms": ms(percentile(latencies, 0.99)),
        "send_to_success_p50_ms": ms(percentile(to_success, 0.5)),
        "aux_p50_ms": ms(percentile(aux, 0.5)),
        "aux_p99_ms": ms(percentile(aux, 0.99)),
    }


async def stream_completions(
    url: str, concurrency: int, requests: int, max_tokens: int
) -> tuple[list[float], list[float]]:
    """Seconds to the first streamed token, and to the last, of each request."""
    first: list[float] = []
    total: list[float] = []
    todo = iter(range(requests))
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def worker() -> None:
            for i in todo:
                body = {
                    "model": "tiny-llama",
                    "prompt": f"request {i} of the benchmark",
                    "max_tokens": max_tokens,
                }
                started = time.perf_counter()
                seen = None
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                    resp.raise_for_status()
                    async for line in resp.aiter_lines():
                        if (
                            seen is None
                            and line.startswith("data: {")
                            and json.loads(line[6:])["choices"][0]["text"]
                        ):
                            seen = time.perf_counter() - started
                if seen is None:
                    raise RuntimeError(f"request {i}: no token was streamed")
                first.append(seen)
                total.append(time.perf_counter() - started)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return first, total


def success_ms(client: httpx.Client, tokens: int) -> float:
    return ms(Bench.room(client, tokens)["request_to_success_s"])


def drive_block(url: str, in_flight: int, count: int) -> dict[str, Any]:
    return asyncio.run(drive(url, in_flight, count))


def ttft_p50_ms(url: str, concurrency: int, requests: int, max_tokens: int) -> float:
    ttft, _ = asyncio.run(stream_completions(url, concurrency, requests, max_tokens))
    return ms(percentile(ttft, 0.5))


class Versions:
    """Each point on two versions' stacks side by side, taking turns; each row the new version's
    samples against the old's, run by run."""

    def __init__(self, bench: Bench, trees: dict[str, Path]):
        self.bench = bench
        self.envs = {version: tree_env(tree) for version, tree in trees.items()}
        self.rows: list[dict[str, Any]] = []

    def stacks(
        self, name: str, prefill: list[str], decode: list[str], **options: Any
    ) -> dict[str, LocalStack]:
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower())  # a log directory's name
        with ThreadPoolExecutor(len(self.envs)) as pool:  # started together: half the wait
            starting = {
                version: pool.submit(
                    self.bench.stack, f"{slug}-{version}", prefill, decode, env=env, **options
                )
                for version, env in self.envs.items()
            }
        return {version: future.result() for version, future in starting.items()}

    def add(self, section: str, point: str, samples: dict[str, list[float]], lower_is_better: bool) -> None:
        row = compare(samples["old"], samples["new"], lower_is_better)
        self.rows.append({"section": section, "point": point, **row, "samples": samples})

    def rooms(
        self,
        section: str,
        sizes_kib: list[int],
        prefill: tuple[str, ...] = (),
        decode: tuple[str, ...] = (),
        **options: Any,
    ) -> None:
        """Request to SUCCESS of rooms of each size, in the 8B-class layout."""
        layout = layout_of(BIG)
        pool = max(sizes_kib) * KIB + 8 * layout.page_bytes
        stacks = self.stacks(
            section, node_args(BIG, pool, *prefill), node_args(BIG, pool, *decode), **options
        )
        clients = {version: stack.client() for version, stack in stacks.items()}
        try:
            for size_kib in sizes_kib:
                tokens = size_kib * KIB // layout.page_bytes
                for client in clients.values():
                    self.bench.room(client, tokens)  # untimed: the engines' connection, the pages' first use
                samples = interleaved(
                    {version: partial(success_ms, client, tokens) for version, client in clients.items()},
                    self.bench.runs,
                )
                self.add(section, f"{size_label(size_kib)} room, request→SUCCESS ms", samples, True)
        finally:
            for client in clients.values():
                client.close()
            self.bench.close()

    def control_plane(self, levels: list[int], rooms_per_level: int, blocks: int) -> None:
        """Blocks of rooms through POST /rooms, 64 KiB of KV each, at each in-flight level."""
        stacks = self.stacks("control", node_args(SMALL, 64 * MIB), node_args(SMALL, 64 * MIB))
        try:
            for in_flight in levels:
                count = rooms_per_level if in_flight > 1 else max(8, rooms_per_level // 8)
                got = interleaved(
                    {v: partial(drive_block, s.bootstrap.url, in_flight, count) for v, s in stacks.items()},
                    blocks,
                )
                section = f"control plane, {in_flight} in flight"
                for key, point, lower in (("rooms_per_s", "rooms/s", False), ("p50_ms", "p50 ms", True)):
                    self.add(section, point, {v: [b[key] for b in got[v]] for v in got}, lower)
        finally:
            self.bench.close()

    def model(self, levels: list[tuple[int, int]], max_tokens: int, blocks: int) -> None:
        """Blocks of completions streamed from the tiny Llama: time to the first token."""
        from launcher.tiny_model import write_tiny_model

        path = str(write_tiny_model("llama", self.bench.workdir / "tiny-llama"))
        args = ["--model", path, "--log-level", "WARNING"]
        stacks = self.stacks("model", args, args, bootstrap=["--model", path])
        try:
            for concurrency, requests in levels:
                samples = interleaved(
                    {
                        v: partial(ttft_p50_ms, s.bootstrap.url, concurrency, requests, max_tokens)
                        for v, s in stacks.items()
                    },
                    blocks,
                )
                section = f"tiny Llama, {concurrency} concurrent, {requests} requests"
                self.add(section, "TTFT p50 ms", samples, True)
        finally:
            self.bench.close()


def host() -> dict[str, Any]:
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "transport": "tcp (loopback)",
    }


def against(ref: str, quick: bool, out: Path) -> int:
    """This tree against ``ref``: the default stack's rooms and the control plane; a full run
    adds plain ZMQ, verified KV, tensor parallelism and the model."""
    started = time.time()
    load_before = os.getloadavg()[0]
    freeze_startup_heap()
    sizes = [256, 1024] if quick else [256, 1024, 16 * 1024, 64 * 1024]
    blocks = 3 if quick else 11
    with worktree(ref) as old_tree, tempfile.TemporaryDirectory(prefix="kvroom-bench-") as tmp:
        bench = Bench(quick, Path(tmp))
        versions = Versions(bench, {"old": old_tree, "new": ROOT})
        compared = {"old": {"ref": ref, **describe(old_tree)}, "new": describe(ROOT)}
        print("rooms", flush=True)
        versions.rooms("CURVE, KV not verified (the default)", sizes)
        if not quick:
            versions.rooms("plain ZMQ", sizes, secure=False)
            versions.rooms("CURVE and --verify-kv", sizes, verify_kv=True)
            print("tensor parallelism", flush=True)
            for np_, nd, agreement in [(1, 1, "ipc"), (2, 2, "ipc"), (2, 4, "ipc"), (2, 4, "gloo")]:
                versions.rooms(
                    f"prefill TP {np_}, decode TP {nd}, ranks agree over {agreement}",
                    [1024],
                    ("--tp-size", str(np_), "--agreement", agreement),
                    ("--tp-size", str(nd), "--agreement", agreement),
                )
        print("control plane", flush=True)
        versions.control_plane([8] if quick else [1, 8, 64], 16 if quick else 512, blocks)
        if not quick:
            print("a Hugging Face model", flush=True)
            versions.model([(1, 16), (16, 64)], max_tokens=8, blocks=blocks)
    fields = {"runs": bench.runs, "blocks": blocks, **compared, "rows": versions.rows}
    return judged(out / "against", started, load_before, quick, fields, write_against_report)


def judged(
    path: Path,
    started: float,
    load_before: float,
    quick: bool,
    fields: dict[str, Any],
    write: Callable[[dict[str, Any], Path], None],
) -> int:
    """A side-by-side run's results, with the host and the verdict over its rows, into
    ``path``.json and (by ``write``) ``path``.md, which is printed."""
    worse = any(row["verdict"] == "worse" for row in fields["rows"])
    results = {
        "machine": {**host(), "load_average": [load_before, os.getloadavg()[0]]},
        "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "quick": quick,
        "seconds": round(time.time() - started, 1),
        **fields,
        "verdict": "worse" if worse else "not worse",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(results, indent=2))
    write(results, path.parent)
    print(path.with_suffix(".md").read_text())
    return 0


def against_vllm(ref: str, quick: bool, out: Path) -> int:
    """kvroom's vLLM pair on this tree against ``ref``'s, side by side: against-vllm.{json,md}."""
    started = time.time()
    load_before = os.getloadavg()[0]
    with worktree(ref) as old_tree, tempfile.TemporaryDirectory(prefix="kvroom-bench-") as tmp:
        code_envs = {"old": vllm_code_env(old_tree), "new": None}
        compared = {"old": {"ref": ref, **describe(old_tree)}, "new": describe(ROOT)}
        vllm = run_vllm_against(Path(tmp), quick, code_envs)
    return judged(
        out / "against-vllm", started, load_before, quick, {**compared, **vllm}, write_against_vllm_report
    )


def vllm_only(quick: bool, out: Path) -> int:
    """The vLLM section alone, put into ``out``'s results.json beside the sections already there."""
    with tempfile.TemporaryDirectory(prefix="kvroom-bench-") as tmp:
        vllm = run_vllm(Path(tmp), quick)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"machine": host()}
    results["vllm"] = vllm
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    write_report(results, out)
    print((out / "results.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and few runs: checks the benchmark works; prints no ratio",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--vllm-only",
        action="store_true",
        help="only the vLLM section (real vLLM servers: plain, MooncakeConnector, KvroomConnector)",
    )
    parser.add_argument(
        "--against",
        metavar="REF",
        help="this tree against the commit REF, side by side; writes against.{json,md} "
        "(with --vllm-only: kvroom's vLLM pair, into against-vllm.{json,md})",
    )
    args = parser.parse_args(argv)
    if args.against and args.vllm_only:
        return against_vllm(args.against, args.quick, args.out)
    if args.against:
        return against(args.against, args.quick, args.out)
    if args.vllm_only:
        return vllm_only(args.quick, args.out)
    quick = args.quick
    started = time.time()
    freeze_startup_heap()  # the client's own collector pauses would count as room latency
    with tempfile.TemporaryDirectory(prefix="kvroom-bench-") as tmp:
        bench = Bench(quick, Path(tmp))
        try:
            print("transfer against the raw engine", flush=True)
            transfer = bench.transfer([256, 1024] if quick else [256, 1024, 16 * 1024, 64 * 1024])
            print("CURVE and verified KV", flush=True)
            options = bench.options([256, 1024] if quick else [256, 1024, 16 * 1024, 64 * 1024])
            bench.close()
            print("tensor parallelism", flush=True)
            tp_shapes = [(1, 1, "ipc"), (2, 2, "ipc")]
            if not quick:
                tp_shapes += [(2, 4, "ipc"), (2, 4, "gloo")]
            tensor_parallel = bench.tensor_parallel(1024, tp_shapes)
            bench.close()
            print("control plane", flush=True)
            control, curve, sustained = (
                bench.control_plane([1, 8], 16, curve_blocks=1, blocks=2, block_rooms=16)
                if quick
                else bench.control_plane([1, 8, 64], 512, curve_blocks=3, blocks=11, block_rooms=2048)
            )
            bench.close()
            print("a Hugging Face model", flush=True)
            model = bench.model([(1, 4), (4, 8)] if quick else [(1, 16), (16, 64)], max_tokens=8)
        finally:
            bench.close()
        # A quick run checks kvroom's own sections; the vLLM one has its own (--vllm-only --quick).
        vllm = None
        if not quick:
            print("vLLM: plain, MooncakeConnector, KvroomConnector", flush=True)
            vllm = run_vllm(Path(tmp), quick)
    results = {
        "machine": host(),
        "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "quick": quick,
        "runs": bench.runs,
        "seconds": round(time.time() - started, 1),
        "transfer": transfer,
        "options": options,
        "tensor_parallel": tensor_parallel,
        "control_plane": control,
        "curve_control_plane": curve,
        "sustained": sustained,
        "room_history": BootstrapSettings.model_fields["room_history"].default,
        "model": model,
        "vllm": vllm,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    write_report(results, args.out)
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
