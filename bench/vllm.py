"""The benchmark's vLLM section: real vLLM CPU servers serving the same tiny Llama three ways.

- ``plain``: one vLLM server, prefill and decode on one instance (the colocated reference);
- ``mooncake``: a vLLM prefill and decode with vLLM's own MooncakeConnector over TCP, behind a
  proxy as vLLM's example has it (bench/mooncake_proxy.py; on CPU through bench/mooncake_cpu.py);
- ``kvroom``: a vLLM prefill and decode with KvroomConnector behind the kvroom bootstrap
  (/v1/completions on the bootstrap).

Every request is a streamed /v1/completions of its own token-id prompt (no two share a first
block, so vLLM's prefix cache never stands in for the transfer): time to the first streamed text,
and to the end. The prompts are drawn from the tokens that are whole ASCII text, and kept only
where the model's first output token is whole text too, so the first token streams at once on
every configuration (a token that is part of a character is held back until the character is
whole, which would add later tokens' time to the TTFT).

Each server holds its core while it lives (prefill core 0, decode core 1; the plain one core 0),
so only one configuration runs at a time: a round starts each in turn, measures every point on it
and stops it, the order reversed every other round. A ratio is taken between the medians of one
round, then the median over rounds. Nothing here asserts a timing.

Time to the first token is measured with each worker inside its engine core (SERVER_ENV); then
each configuration is started again under vLLM's default executor, as users run it, for its CPU
seconds a request: every process of it counted (bench/process_cpu.py), 128-token prompts, one at a
time and 8 at once. On two cores wall-time ratios move 2x between rounds; CPU per request does not.
"""

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench.against import compare, tree_env
from bench.process_cpu import cpu_seconds
from launcher.local_stack import free_port
from launcher.vllm_servers import ROOT, VLLM_PYTHON, VllmCluster, VllmServer, tiny_llama

CONFIGS = ("plain", "mooncake", "kvroom")
LABELS = {
    "plain": "plain vLLM (one instance)",
    "mooncake": "vLLM PD, MooncakeConnector (TCP)",
    "kvroom": "vLLM PD, KvroomConnector",
}
MAX_TOKENS = 16
LOADED = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
# The targets the report judges: kvroom's TTFT against MooncakeConnector's at every point, and
# against the plain instance's at (concurrency, prompt tokens).
VS_MOONCAKE = 0.9
VS_PLAIN = 1.5
VS_PLAIN_POINT = (1, 400)
# And kvroom's CPU a request (pair and bootstrap) against MooncakeConnector's (pair and proxy), and
# the bootstrap's own against the proxy's, at every concurrency of the CPU points.
CPU_VS_MOONCAKE = 1.0
CPU_PROMPT_TOKENS = 128
# vLLM's periodic log of a connector's transfers (the Mooncake prefill's sends).
XFER_LOG = re.compile(
    r"KV Transfer metrics: Num successful transfers=(\d+), .*?Avg MB per transfer=([\d.]+), "
    r".*?Avg number of descriptors=([\d.]+)"
)
# kvroom's connector's counters on the prefill's /metrics (kvroom_vllm/stats.py).
KVROOM_COUNTS = ("sends", "writes", "bytes_written")


class Plan:
    """What a run measures: prompt sizes, (concurrency, requests) levels, rounds."""

    def __init__(self, quick: bool):
        self.quick = quick
        self.sizes = [16, 128, 400]
        self.levels = [(1, 3), (8, 8)] if quick else [(1, 8), (8, 24)]
        self.cpu_levels = [(1, 4), (8, 8)] if quick else [(1, 40), (8, 40)]  # (concurrency, requests)
        self.rounds = 1 if quick else 3  # an odd count: the median is one round's

    def points(self) -> list[tuple[int, int, int]]:
        return [(size, c, n) for c, n in self.levels for size in self.sizes]


class Prompts:
    """Token-id prompts whose first output token is whole text (greedy, by the checkpoint run
    with transformers here, before any server starts)."""

    def __init__(self, model: Path):
        import torch
        from tokenizers import Tokenizer
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.torch = torch
        self.tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.ascii = [i for i in range(3, self.tokenizer.get_vocab_size()) if self.whole(i)]

    def whole(self, token: int) -> bool:
        text = self.tokenizer.decode([token])
        return bool(text) and text.isascii() and "\ufffd" not in text

    def draw(self, tokens: int, count: int, key: tuple[Any, ...]) -> list[list[int]]:
        rng = random.Random(repr(key))
        found: list[list[int]] = []
        while len(found) < count:
            batch = [[rng.choice(self.ascii) for _ in range(tokens)] for _ in range(16)]
            with self.torch.no_grad():
                first = self.model(self.torch.tensor(batch)).logits[:, -1].argmax(-1).tolist()
            found += [ids for ids, token in zip(batch, first, strict=True) if self.whole(token)]
        return found[:count]


def bytes_per_token(model: Path) -> int:
    """KV bytes of one token: keys and values of every layer, float32."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


def _get(url: str) -> Any:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = httpx.get(url, timeout=2.0)
        if response.status_code == 200:
            return response.json()
    return None


def wait(predicate: Callable[[], Any], timeout: float, what: str, proc: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)
    return value


class Proxy:
    """bench/mooncake_proxy.py as its own process group on 127.0.0.1."""

    def __init__(self, log_dir: Path, prefill: str, decode: str, bootstrap: str, engine_id: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "mooncake-proxy.log"
        self.args = [
            *("--port", str(self.port), "--prefill", prefill, "--decode", decode),
            *("--bootstrap", bootstrap, "--engine-id", engine_id),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.mooncake_proxy", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )
        wait(lambda: _get(f"{self.url}/health"), 30, "the Mooncake proxy", self.proc)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


class Running:
    """One configuration's servers, up: where completions go, the decode (its metrics), and the
    prefill whose log (Mooncake) or metrics (kvroom) tell its transfers."""

    def __init__(
        self,
        url: str,
        decode: VllmServer,
        stop: Callable[[], None],
        parts: dict[str, int],
        sender: VllmServer | None = None,
        rooms: bool = False,
    ):
        self.url = url
        self.decode = decode
        self.stop = stop
        self.parts = parts  # each process tree of the configuration by name: its root's pid
        self.sender = sender
        self.rooms = rooms  # the kvroom bootstrap: a room's output ids are at /rooms/{room}

    def output_ids(self, model: str, ids: list[int]) -> list[int]:
        """The greedy output of one whole (not streamed) completion, as token ids."""
        body = {"model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
        with httpx.Client(base_url=self.url, timeout=120, trust_env=False) as client:
            if not self.rooms:
                answer = client.post("/v1/completions", json={**body, "return_token_ids": True})
                answer.raise_for_status()
                return list(answer.json()["choices"][0]["token_ids"])
            answer = client.post("/v1/completions", json=body)
            answer.raise_for_status()
            room = answer.json()["id"].split("-", 1)[1]
            return list(client.get(f"/rooms/{room}").json()["output_ids"])

    def loaded(self) -> float:
        name, labels = LOADED
        return self.decode.metric(name, **labels)

    def transfers(self) -> dict[str, float] | None:
        """The prefill's sends: transfers, the mean descriptors (writes) and KiB of one; None
        where it had none. kvroom's connector counts them on the prefill's /metrics; Mooncake's
        logs them every 10 s."""
        if self.sender is None:
            return None
        if self.rooms:
            sends, writes, nbytes = (self.sender.metric(f"vllm:kvroom_{n}_total") for n in KVROOM_COUNTS)
            if not sends:
                return None
            return {
                "transfers": int(sends),
                "descriptors_per_transfer": writes / sends,
                "kib_per_transfer": nbytes / 1024 / sends,
            }
        found = XFER_LOG.findall(self.sender.log_path.read_text(errors="replace"))
        count = sum(int(n) for n, _, _ in found)
        if not count:
            return None
        return {
            "transfers": count,
            "descriptors_per_transfer": sum(int(n) * float(d) for n, _, d in found) / count,
            "kib_per_transfer": sum(int(n) * float(mb) for n, mb, _ in found) * 1024 / count,
        }


# Every server of every configuration, the plain one too: the worker runs inside vLLM's engine-core
# process (the uni-process executor, which vLLM's CPU platform keeps when this is 0) instead of a
# process of its own that polls a shared-memory queue between steps and so holds a core. On two
# cores a PD pair's two polling workers left the API servers, engine cores, proxy or bootstrap and
# the connectors' threads waiting for what was left, and a run's medians moved by up to 4x.
SERVER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _pid(proc: subprocess.Popen[bytes] | None) -> int:
    assert proc is not None
    return proc.pid


def start(config: str, model: Path, log_dir: Path, server_env: dict[str, str]) -> Running:
    log_dir.mkdir(parents=True, exist_ok=True)
    if config == "plain":
        server = VllmServer("plain", model, log_dir, 0, server_env).start()
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
        return Running(server.url, server, server.stop, {"server": _pid(server.proc)})
    if config == "kvroom":
        return start_kvroom(model, log_dir, server_env)
    return start_mooncake(model, log_dir, server_env)


def start_kvroom(
    model: Path, log_dir: Path, server_env: dict[str, str], code_env: dict[str, str] | None = None
) -> Running:
    """kvroom's pair behind its bootstrap; with ``code_env``, on another checkout's code."""
    guard = code_env is None or (Path(code_env["PYTHONPATH"]) / "kvroom_vllm" / "guard.py").exists()
    cluster = VllmCluster(
        log_dir, model, ["--log-level", "WARNING"], env=server_env, code_env=code_env, guard=guard
    )
    try:
        prefill, decode = cluster.start()
    except BaseException:
        cluster.stop()
        raise
    parts = {
        "prefill": _pid(prefill.proc),
        "decode": _pid(decode.proc),
        "bootstrap": _pid(cluster.bootstrap.proc),
    }
    return Running(cluster.bootstrap.url, decode, cluster.stop, parts, sender=prefill, rooms=True)


def start_mooncake(model: Path, log_dir: Path, server_env: dict[str, str]) -> Running:
    bootstrap_port = free_port()
    env = {
        **server_env,
        # get_ip(): the host the transfer engine and the decode's side channel name; loopback here.
        "VLLM_HOST_IP": "127.0.0.1",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",  # the transfer engine's TCP listener (else 0.0.0.0)
        "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap_port),
    }
    servers = []
    for role, name, core in (("kv_producer", "mooncake-prefill", 0), ("kv_consumer", "mooncake-decode", 1)):
        server = VllmServer(name, model, log_dir, core, env)
        server.transfer_config = {
            "kv_connector": "CpuMooncakeConnector",
            "kv_connector_module_path": "bench.mooncake_cpu",
            "kv_role": role,
            "engine_id": name,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }
        servers.append(server)
    prefill, decode = servers
    bootstrap = f"http://127.0.0.1:{bootstrap_port}"
    proxy = Proxy(log_dir, prefill.url, decode.url, bootstrap, prefill.name)

    def stop() -> None:
        proxy.stop()
        for server in servers:
            server.stop()

    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        # The prefill's worker registered with its Mooncake bootstrap server under its engine id.
        wait(lambda: prefill.name in json.dumps(_get(f"{bootstrap}/query")), 60, "Mooncake's bootstrap")
        proxy.start()
    except BaseException:
        stop()
        raise
    parts = {"prefill": _pid(prefill.proc), "decode": _pid(decode.proc), "proxy": _pid(proxy.proc)}
    return Running(proxy.url, decode, stop, parts, sender=prefill)


async def stream(client: httpx.AsyncClient, model: str, ids: list[int]) -> tuple[float, float, str]:
    """One streamed completion: seconds to the first text, to the end; the text."""
    body = {"model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    started = time.perf_counter()
    first = None
    text = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.is_error:
            await response.aread()
            raise RuntimeError(f"/v1/completions answered {response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            for choice in event.get("choices", []):
                if choice.get("text"):
                    first = first if first is not None else time.perf_counter() - started
                    text.append(choice["text"])
    if first is None:
        raise RuntimeError("no text was streamed")
    return first, time.perf_counter() - started, "".join(text)


async def load(
    url: str, model: str, prompts: list[list[int]], concurrency: int
) -> list[tuple[float, float, str]]:
    todo = iter(enumerate(prompts))
    out: list[tuple[float, float, str]] = [(0.0, 0.0, "")] * len(prompts)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, trust_env=False) as client:

        async def worker() -> None:
            for i, ids in todo:
                out[i] = await stream(client, model, ids)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def measure(
    running: Running, model: Path, plan: Plan, prompts: dict[tuple[Any, ...], list[list[int]]], round_: int
) -> dict[str, Any]:
    """Every point on one configuration's servers, and the warm-up's outputs as token ids (one
    prompt a size, whole and then streamed, untimed: the servers' first requests)."""
    name = model.name
    warm = {}
    for size in plan.sizes:
        warm[str(size)] = running.output_ids(name, prompts[(size,)][0])
        asyncio.run(load(running.url, name, prompts[(size,)], 1))
    points = {}
    for size, concurrency, requests in plan.points():
        before = running.loaded()
        got = asyncio.run(load(running.url, name, prompts[(size, concurrency, round_)], concurrency))
        points[f"{size}/{concurrency}"] = {
            "ttft_s": [g[0] for g in got],
            "latency_s": [g[1] for g in got],
            "loaded_tokens_per_request": (running.loaded() - before) / requests,
        }
    return {"outputs": warm, "points": points, "transfers": running.transfers()}


def measure_cpu(
    running: Running, model: Path, plan: Plan, prompts: dict[tuple[Any, ...], list[list[int]]], round_: int
) -> dict[str, Any]:
    """CPU seconds a request of every process of the configuration, at each concurrency, after an
    untimed warm-up request."""
    asyncio.run(load(running.url, model.name, prompts[(CPU_PROMPT_TOKENS,)], 1))
    levels = {}
    for concurrency, requests in plan.cpu_levels:
        before = cpu_seconds(running.parts)
        started = time.perf_counter()
        asyncio.run(load(running.url, model.name, prompts[("cpu", concurrency, round_)], concurrency))
        wall = time.perf_counter() - started
        after = cpu_seconds(running.parts)
        parts = {name: (after[name] - before[name]) / requests for name in running.parts}
        levels[str(concurrency)] = {"cpu_s": sum(parts.values()), "parts": parts, "wall_s": wall}
    return levels


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def percentile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000


def summarise(rounds: list[dict[str, dict[str, Any]]], plan: Plan, per_token: int) -> list[dict[str, Any]]:
    rows = []
    for size, concurrency, requests in plan.points():
        key = f"{size}/{concurrency}"
        row: dict[str, Any] = {"prompt_tokens": size, "concurrency": concurrency, "requests": requests}
        for config in CONFIGS:
            got = [r[config]["points"][key] for r in rounds]
            ttft = [t for g in got for t in g["ttft_s"]]
            loaded = statistics.median(g["loaded_tokens_per_request"] for g in got)
            row[config] = {
                "ttft_p50_ms": median_ms(ttft),
                "ttft_p90_ms": percentile_ms(ttft, 0.9),
                "latency_p50_ms": median_ms([t for g in got for t in g["latency_s"]]),
                "round_ttft_p50_ms": [median_ms(g["ttft_s"]) for g in got],
                "loaded_tokens_per_request": loaded,
                "loaded_kib_per_request": loaded * per_token / 1024,
            }
        for other in ("mooncake", "plain"):
            ours, theirs = row["kvroom"]["round_ttft_p50_ms"], row[other]["round_ttft_p50_ms"]
            row[f"ttft_kvroom_vs_{other}"] = statistics.median(
                o / t for o, t in zip(ours, theirs, strict=True)
            )
        rows.append(row)
    return rows


def summarise_cpu(rounds: list[dict[str, dict[str, Any]]], plan: Plan) -> list[dict[str, Any]]:
    """Per concurrency: each configuration's CPU a request (median and range over rounds, and the
    median of each process tree's), and kvroom's against Mooncake's (median of one round's ratios)."""
    rows = []
    for concurrency, requests in plan.cpu_levels:
        row: dict[str, Any] = {"concurrency": concurrency, "requests": requests}
        for config in CONFIGS:
            got = [r[config]["cpu"][str(concurrency)] for r in rounds]
            totals = [g["cpu_s"] for g in got]
            row[config] = {
                "cpu_s": statistics.median(totals),
                "cpu_s_range": [min(totals), max(totals)],
                "parts": {name: statistics.median(g["parts"][name] for g in got) for name in got[0]["parts"]},
                "wall_s": statistics.median(g["wall_s"] for g in got),
            }
        kvroom = [r["kvroom"]["cpu"][str(concurrency)] for r in rounds]
        mooncake = [r["mooncake"]["cpu"][str(concurrency)] for r in rounds]
        row["cpu_kvroom_vs_mooncake"] = statistics.median(
            k["cpu_s"] / m["cpu_s"] for k, m in zip(kvroom, mooncake, strict=True)
        )
        row["cpu_bootstrap_vs_proxy"] = statistics.median(
            k["parts"]["bootstrap"] / m["parts"]["proxy"] for k, m in zip(kvroom, mooncake, strict=True)
        )
        rows.append(row)
    return rows


Starter = Callable[[Path, dict[str, str]], Running]  # a configuration's start: its logs, servers' env


def _start(label: str, starter: Starter, log_dir: Path, server_env: dict[str, str]) -> tuple[Running, float]:
    """A configuration up, and the seconds that took; once more where a server did not come up."""
    begun = time.monotonic()
    try:
        running = starter(log_dir, server_env)
    except RuntimeError as exc:  # a server that did not come up; its errors are printed
        print(f"  {label} did not start, starting it once more: {exc}", flush=True)
        begun = time.monotonic()
        running = starter(log_dir.with_name(log_dir.name + "-again"), server_env)
    return running, time.monotonic() - begun


def measured(
    label: str,
    starter: Starter,
    log_dir: Path,
    model: Path,
    plan: Plan,
    prompts: dict[tuple[Any, ...], list[list[int]]],
    round_: int,
) -> tuple[dict[str, Any], float]:
    """One configuration's round: its points with each worker in its engine core, then its CPU a
    request under vLLM's default executor; and the seconds its first start took."""
    running, took = _start(label, starter, log_dir, SERVER_ENV)
    try:
        got = measure(running, model, plan, prompts, round_)
    finally:
        running.stop()
    running, _ = _start(label, starter, log_dir.with_name(log_dir.name + "-cpu"), {})
    try:
        got["cpu"] = measure_cpu(running, model, plan, prompts, round_)
    finally:
        running.stop()
    return got, took


def draw_prompts(model: Path, plan: Plan) -> dict[tuple[Any, ...], list[list[int]]]:
    """Every prompt of a run, before any server starts: a warm-up one a size; each point's and
    each CPU level's, every round."""
    drawn = Prompts(model)
    prompts: dict[tuple[Any, ...], list[list[int]]] = {
        (size,): drawn.draw(size, 1, ("warm", size)) for size in plan.sizes
    }
    for round_ in range(plan.rounds):
        for size, concurrency, requests in plan.points():
            prompts[(size, concurrency, round_)] = drawn.draw(size, requests, (size, concurrency, round_))
        for concurrency, requests in plan.cpu_levels:
            key = ("cpu", concurrency, round_)
            prompts[key] = drawn.draw(CPU_PROMPT_TOKENS, requests, key)
    return prompts


def run(workdir: Path, quick: bool) -> dict[str, Any]:
    """The section: every configuration in turn, every round; its results for results.json."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: bash setup.sh vllm makes it")
    started = time.time()
    plan = Plan(quick)
    model = tiny_llama(workdir / "models")
    prompts = draw_prompts(model, plan)
    rounds: list[dict[str, dict[str, Any]]] = []
    starts: dict[str, list[float]] = {config: [] for config in CONFIGS}
    for round_ in range(plan.rounds):
        got: dict[str, dict[str, Any]] = {}
        for config in CONFIGS if round_ % 2 == 0 else CONFIGS[::-1]:
            print(f"  round {round_ + 1}/{plan.rounds}: {LABELS[config]}", flush=True)
            starter = partial(start, config, model)
            log_dir = workdir / f"vllm-{config}-{round_}"
            got[config], took = measured(LABELS[config], starter, log_dir, model, plan, prompts, round_)
            starts[config].append(took)
        rounds.append(got)
    transfers = {
        config: [r[config]["transfers"] for r in rounds if r[config]["transfers"]] for config in CONFIGS[1:]
    }
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "quick": quick,
        "rounds": plan.rounds,
        "max_tokens": MAX_TOKENS,
        "model": {"name": model.name, **_shape(model)},
        "kv_bytes_per_token": bytes_per_token(model),
        # Greedy outputs of one prompt a size, token for token: a PD pair that moved the KV intact
        # answers as one instance does.
        "outputs": {config: rounds[0][config]["outputs"] for config in CONFIGS},
        "outputs_agree": {
            config: all(r[config]["outputs"] == r["plain"]["outputs"] for r in rounds)
            for config in CONFIGS[1:]
        },
        "start_s": {config: statistics.median(s) for config, s in starts.items()},
        # Each PD pair's prefill: its transfers and the writes of one, over every round.
        "transfers": {config: _merge(logged) if logged else None for config, logged in transfers.items()},
        "seconds": round(time.time() - started, 1),
        "rows": summarise(rounds, plan, bytes_per_token(model)),
        "cpu_prompt_tokens": CPU_PROMPT_TOKENS,
        "cpu_rows": summarise_cpu(rounds, plan),
    }


def _merge(logged: list[dict[str, float]]) -> dict[str, float]:
    count = sum(t["transfers"] for t in logged)
    return {
        "transfers": count,
        "descriptors_per_transfer": sum(t["transfers"] * t["descriptors_per_transfer"] for t in logged)
        / count,
        "kib_per_transfer": sum(t["transfers"] * t["kib_per_transfer"] for t in logged) / count,
    }


def _shape(model: Path) -> dict[str, int]:
    config = json.loads((model / "config.json").read_text())
    keys = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    return {k: config[k] for k in keys if k in config}


def code_env(tree: Path) -> dict[str, str]:
    """bench/against.py's environment for ``tree``'s kvroom, checked for the connector too, under
    vLLM's Python."""
    env = tree_env(tree)
    probe = "import kvroom_vllm.connector as c; print(c.__file__)"
    found = subprocess.run(
        [str(VLLM_PYTHON), "-c", probe], env={**os.environ, **env}, capture_output=True, text=True, check=True
    ).stdout.strip()
    if not Path(found).is_relative_to(tree):
        raise RuntimeError(f"kvroom_vllm is not imported from {tree}: {found}")
    return env


# Rounds of a side-by-side run: a verdict's tolerance comes from the spread of its rounds' ratios.
AGAINST_ROUNDS = 5


def run_against(workdir: Path, quick: bool, code_envs: dict[str, dict[str, str] | None]) -> dict[str, Any]:
    """kvroom's pair on each version's code ("old", "new"; None: this checkout) in turn, every
    round, the order reversed every other round; each row a point's new ÷ old, round by round
    (bench/against.py judges it). Plain vLLM and MooncakeConnector do not change between versions
    and are left out."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: bash setup.sh vllm makes it")
    plan = Plan(quick)
    plan.rounds = 2 if quick else AGAINST_ROUNDS
    model = tiny_llama(workdir / "models")
    prompts = draw_prompts(model, plan)
    versions = list(code_envs)
    rounds: list[dict[str, dict[str, Any]]] = []
    for round_ in range(plan.rounds):
        got: dict[str, dict[str, Any]] = {}
        for version in versions if round_ % 2 == 0 else versions[::-1]:
            label = f"{LABELS['kvroom']}, {version}"
            print(f"  round {round_ + 1}/{plan.rounds}: {label}", flush=True)
            starter = partial(start_kvroom, model, code_env=code_envs[version])
            log_dir = workdir / f"vllm-{version}-{round_}"
            got[version], _ = measured(label, starter, log_dir, model, plan, prompts, round_)
        rounds.append(got)
    rows = []

    def add(section: str, point: str, samples: dict[str, list[float]]) -> None:
        rows.append(
            {
                "section": section,
                "point": point,
                **compare(samples["old"], samples["new"], True),
                "samples": samples,
            }
        )

    for size, concurrency, _ in plan.points():
        key = f"{size}/{concurrency}"
        for section, field in (("TTFT p50 ms", "ttft_s"), ("latency p50 ms", "latency_s")):
            point = f"{size} tokens, {concurrency} at once"
            add(
                section, point, {v: [median_ms(r[v]["points"][key][field]) for r in rounds] for v in versions}
            )
    for concurrency, _ in plan.cpu_levels:
        add(
            "CPU s a request",
            f"{CPU_PROMPT_TOKENS} tokens, {concurrency} at once",
            {v: [r[v]["cpu"][str(concurrency)]["cpu_s"] for r in rounds] for v in versions},
        )
    return {
        "rounds": plan.rounds,
        "max_tokens": MAX_TOKENS,
        "model": {"name": model.name, **_shape(model)},
        "outputs_agree": all(
            r[v]["outputs"] == rounds[0][versions[0]]["outputs"] for r in rounds for v in versions
        ),
        "rows": rows,
    }
