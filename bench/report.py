"""The benchmark's markdown report and plot, from its results.json."""

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def size_label(kib: int) -> str:
    return f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB"


def _targets(results: dict[str, Any]) -> str:
    """The project's targets against this run, each judged from the numbers below it."""
    by_size = {r["kv_kib"]: r for r in results["transfer"]}
    top = max(results["control_plane"], key=lambda r: r["in_flight"])
    blocks, history = results["sustained"], results["room_history"]
    warm = next((b for b in blocks if b["served_before"] >= history), None)
    options = {(r["variant"], r["kv_kib"]): r for r in results["options"]}
    curve = options[("plain ZMQ", 256)]
    rows = []

    def judge(target: str, value: str, met: bool) -> None:
        rows.append([target, value, "met" if met else "not met"])

    small = [by_size[k] for k in (256, 1024) if k in by_size]
    floor = min(r["messages_ms"] for r in results["transfer"])
    judge(
        "256 KiB and 1 MiB rooms within raw polled + 0.2 ms",
        ", ".join(f"{r['added_ms']:+.2f} ms" for r in small)
        + f" (two bare ZMQ messages alone: {floor:.2f} ms)",
        all(r["added_ms"] <= 0.2 for r in small),
    )
    large = [r for r in results["transfer"] if r["kv_kib"] >= 16 * 1024]
    judge(
        "16 MiB and up at ≥ 1.0x raw polled bytes/s",
        ", ".join(f"{r['speed_vs_polled']:.2f}x at {size_label(r['kv_kib'])}" for r in large),
        all(r["speed_vs_polled"] >= 1.0 for r in large),
    )
    judge(
        f"{top['in_flight']} in flight: ≥ 1,000 rooms/s",
        f"{top['rooms_per_s']:.0f}",
        top["rooms_per_s"] >= 1000,
    )
    ratio = top["p50_ms"] / top["send_to_success_p50_ms"]
    judge(
        f"{top['in_flight']} in flight: end-to-end p50 ≤ 2x request→SUCCESS p50", f"{ratio:.1f}x", ratio <= 2
    )
    judge(
        f"{top['in_flight']} in flight: aux p99 ≤ 5 ms", f"{top['aux_p99_ms']:.2f} ms", top["aux_p99_ms"] <= 5
    )
    if warm is not None:
        grown = blocks[-1]["served_before"] + blocks[-1]["rooms"] - warm["served_before"] - warm["rooms"]
        growth = max(abs(blocks[-1]["rss_mib"][n] - warm["rss_mib"][n]) for n in warm["rss_mib"])
        judge(f"RSS growth over {grown} rooms once warm ≤ 10 MiB", f"at most {growth:.1f} MiB", growth <= 10)
    # CURVE's cost: the default (CURVE) against plain ZMQ, neighbour by neighbour.
    cost = -curve["vs_default_ms"]
    judge("CURVE adds ≤ 0.1 ms to a 256 KiB room", f"{cost:+.2f} ms", cost <= 0.1)
    verify = {k: r for (variant, k), r in options.items() if variant == "CURVE and --verify-kv"}
    if 256 in verify:
        added = verify[256]["vs_default_ms"]
        judge("--verify-kv adds ≤ 0.2 ms to a 256 KiB room", f"{added:+.2f} ms", added <= 0.2)
    big = [verify[k] for k in (16 * 1024, 64 * 1024) if k in verify]
    if big:
        judge(
            "--verify-kv adds ≤ 15% to 16 MiB and 64 MiB rooms",
            ", ".join(f"{r['vs_default_ratio'] - 1:+.0%} at {size_label(r['kv_kib'])}" for r in big),
            all(r["vs_default_ratio"] <= 1.15 for r in big),
        )
    return _table(["target", "this run", ""], rows)


def _value(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.2f}"


def _version(side: dict[str, Any]) -> str:
    subject = side["subject"] if len(side["subject"]) <= 80 else side["subject"][:77] + "..."
    changes = " with local changes" if side["local_changes"] else ""
    return f"`{side['commit'][:12]}`{changes} ({subject})"


def _verdict_and_table(rows: list[dict[str, Any]], verdict: str) -> list[str]:
    worse = [r for r in rows if r["verdict"] == "worse"]
    return [
        f"**Verdict: {verdict}** "
        + (
            f"({len(worse)} of {len(rows)} rows worse: "
            + "; ".join(f"{r['section']}, {r['point']}" for r in worse)
            + ")"
            if worse
            else f"(all {len(rows)} rows within their tolerance or better)"
        )
        + "\n",
        _table(
            ["stacks", "point", "better", "old", "new", "new ÷ old", "tolerance", "verdict"],
            [
                [
                    r["section"],
                    r["point"],
                    r["better"],
                    _value(r["old"]),
                    _value(r["new"]),
                    f"{r['ratio']:.3f}",
                    f"±{r['tolerance']:.3f}",
                    r["verdict"],
                ]
                for r in rows
            ],
        ),
    ]


def _against_head(results: dict[str, Any]) -> list[str]:
    m = results["machine"]
    load = " to ".join(f"{x:.1f}" for x in m["load_average"])
    return [
        f"Host: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, {m['transport']}; "
        f"{results['date']}; load average {load} over the run (other work on the host shows as spread)."
        + (" Quick run: too few runs for a verdict to mean much." if results["quick"] else "")
        + "\n",
        f"Old: {results['old']['ref']}, {_version(results['old'])}  ",
        f"New: {_version(results['new'])}\n",
    ]


_TOLERANCE = (
    "Tolerance: three times that median's standard error, from the ratios' interquartile range "
    "(sigma ≈ IQR / 1.35, a median's error ≈ 1.25 sigma / √runs). A row is worse when its ratio is "
    "past 1 by more than its tolerance, in the direction that is worse.\n"
)


def write_against_report(results: dict[str, Any], out: Path) -> None:
    """The side-by-side report of ``python -m bench --against REF`` (against.md)."""
    parts = [
        *_against_head(results),
        f"Both versions' stacks up side by side, each running its own tree's code; a point's samples "
        f"taken from each in turn, the order reversed every other run ({results['runs']} rooms a point, "
        f"{results['blocks']} blocks a load point). new ÷ old: the median of the runs' ratios, each run's "
        "two samples next to each other. " + _TOLERANCE,
        *_verdict_and_table(results["rows"], results["verdict"]),
    ]
    (out / "against.md").write_text("\n".join(parts) + "\n")


def write_against_vllm_report(results: dict[str, Any], out: Path) -> None:
    """The side-by-side report of ``python -m bench --vllm-only --against REF`` (against-vllm.md)."""
    model = results["model"]
    shape = ", ".join(f"{k} {v}" for k, v in model.items() if k != "name")
    parts = [
        *_against_head(results),
        f"kvroom's vLLM pair (a vLLM CPU prefill and decode with KvroomConnector behind the kvroom "
        f"bootstrap; {model['name']}: {shape}) on each version's code, one at a time, the order "
        f"reversed every other round ({results['rounds']} rounds); streamed completions of "
        f"{results['max_tokens']} tokens, each request its own prompt, the same prompts for both. "
        "TTFT and latency with each worker in its engine core; CPU a request (every process of the "
        "pair and the bootstrap) under vLLM's default executor. new ÷ old: the median of the rounds' "
        "ratios, each round's medians next to each other. " + _TOLERANCE,
        "Outputs of both versions token-equal in every round: "
        + ("yes.\n" if results["outputs_agree"] else "NO.\n"),
        *_verdict_and_table(results["rows"], results["verdict"]),
    ]
    (out / "against-vllm.md").write_text("\n".join(parts) + "\n")


def write_report(results: dict[str, Any], out: Path) -> None:
    """results.md (and gbps.png) from a run's results: kvroom's own sections where the run has
    them, the vLLM section where it has that (``python -m bench --vllm-only`` may add it alone)."""
    parts = _kvroom_parts(results) if "transfer" in results else []
    if results.get("vllm"):
        parts.append(_vllm_part(results["vllm"], results["machine"]))
    (out / "results.md").write_text("\n".join(parts) + "\n")
    if "transfer" in results:
        _plot(results, out / "gbps.png")


def _kvroom_parts(results: dict[str, Any]) -> list[str]:
    m, quick = results["machine"], results["quick"]
    compare = not quick  # a few quick runs give no ratio worth printing
    parts = [
        f"Host: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, {m['transport']}; "
        f"{results['date']}; {results['runs']} interleaved runs per point, medians."
        + (" Quick run: too few runs for ratios or differences, so none is printed." if quick else "")
        + "\n",
        *([] if quick else ["**Targets**\n", _targets(results) + "\n"]),
        "**Transfer** (a room from the decode's transfer request to SUCCESS, against the raw engine "
        "writing the same bytes in the same writes, blocking, and submitted and polled as the nodes "
        "wait over TCP; and against two bare ZMQ messages, one process to another and back over CURVE "
        "with no event loop, as few as a room's request and done+aux could cost; "
        '"added" and "speed" are taken neighbour by neighbour within a run)\n',
    ]
    headers = ["KV per room", "writes", "raw ms", "raw polled ms", "two bare messages ms", "kvroom ms"]
    if compare:
        headers += ["kvroom - raw polled", "kvroom bytes/s ÷ raw polled"]
    rows = []
    for r in results["transfer"]:
        row = [size_label(r["kv_kib"]), r["engine_writes"], f"{r['raw_ms']:.2f}", f"{r['raw_polled_ms']:.2f}"]
        row += [f"{r['messages_ms']:.2f}", f"{r['kvroom_ms']:.2f}"]
        if compare:
            row += [f"{r['added_ms']:+.2f} ms", f"{r['speed_vs_polled']:.2f}"]
        rows.append(row)
    parts.append(_table(headers, rows))
    parts.append(
        "\n**Where a room's time goes** (medians of each stage, by the nodes' clocks: the request "
        "from the decode until the prefill takes it; until its transfer thread starts the write; "
        "the engine write; done+aux from the write's completion until the decode takes it; from there, "
        "through the gate and the ranks' agreement, to SUCCESS)\n"
    )
    stage_names = ["request hop", "hand-off", "engine write", "done+aux hop", "gate → SUCCESS"]
    parts.append(
        _table(
            ["KV per room", *[f"{n} ms" for n in stage_names]],
            [
                [size_label(r["kv_kib"]), *[f"{v:.3f}" for v in r["stages_ms"].values()]]
                for r in results["transfer"]
            ],
        )
    )
    parts.append(
        "\n**What CURVE and verified KV cost** (three stacks side by side, rooms in turn, "
        "three times the runs; against the default neighbour by neighbour)\n"
    )
    headers = ["KV per room", "variant", "kvroom ms"] + (["against the default", "ratio"] if compare else [])
    parts.append(
        _table(
            headers,
            [
                [size_label(r["kv_kib"]), r["variant"], f"{r['kvroom_ms']:.2f}"]
                + ([f"{r['vs_default_ms']:+.2f} ms", f"{r['vs_default_ratio']:.2f}x"] if compare else [])
                for r in results["options"]
            ],
        )
    )
    parts.append(
        "\n**Tensor parallelism** (request to SUCCESS on every decode rank; the stacks up side by side, "
        "rooms in turn; writes: those of prefill rank 0)\n"
    )
    parts.append(
        _table(
            ["KV per room", "prefill TP", "decode TP", "ranks agree over", "writes", "kvroom ms"],
            [
                [
                    size_label(r["kv_kib"]),
                    r["prefill_tp"],
                    r["decode_tp"],
                    r["agreement"],
                    r["engine_writes"],
                    f"{r['kvroom_ms']:.2f}",
                ]
                for r in results["tensor_parallel"]
            ],
        )
    )
    parts.append(
        "\n**Control plane** (POST /rooms?wait= until finished, 64 KiB of KV a room; "
        "aux: the prefill's write completion to SUCCESS)\n"
    )
    headers = ["in flight", "rooms", "rooms/s", "p50 ms", "p99 ms", "request→SUCCESS p50 ms"]
    headers += ["p50 ÷ request→SUCCESS p50"] if compare else []
    headers += ["aux p50 ms", "aux p99 ms"]
    rows = []
    for r in results["control_plane"]:
        row = [r["in_flight"], r["rooms"], f"{r['rooms_per_s']:.0f}", f"{r['p50_ms']:.1f}"]
        row += [f"{r['p99_ms']:.1f}", f"{r['send_to_success_p50_ms']:.2f}"]
        row += [f"{r['p50_ms'] / r['send_to_success_p50_ms']:.1f}"] if compare else []
        row += [f"{r['aux_p50_ms']:.2f}", f"{r['aux_p99_ms']:.2f}"]
        rows.append(row)
    parts.append(_table(headers, rows))
    parts.append("\n**CURVE under load** (blocks with CURVE and with plain ZMQ in turn, medians of blocks)\n")
    parts.append(
        _table(
            ["ZMQ", "in flight", "rooms/s", "p50 ms", "aux p99 ms"],
            [
                [
                    r["zmq"],
                    r["in_flight"],
                    f"{r['rooms_per_s']:.0f}",
                    f"{r['p50_ms']:.1f}",
                    f"{r['aux_p99_ms']:.2f}",
                ]
                for r in results["curve_control_plane"]
            ],
        )
    )
    blocks = results["sustained"]
    services = list(blocks[0]["rss_mib"])
    parts.append(
        f"\n**Rooms piling up** (blocks of {blocks[0]['rooms']} rooms one after another at "
        f"{max(r['in_flight'] for r in results['control_plane'])} in flight; resident memory of each "
        "service after its block, ranks included)\n"
    )
    parts.append(
        _table(
            ["rooms served before", "rooms/s", "p50 ms", "p99 ms", *[f"{n} MiB" for n in services]],
            [
                [
                    b["served_before"],
                    f"{b['rooms_per_s']:.0f}",
                    f"{b['p50_ms']:.1f}",
                    f"{b['p99_ms']:.1f}",
                    *[f"{b['rss_mib'][n]:.0f}" for n in services],
                ]
                for b in blocks
            ],
        )
    )
    # Warm: once the bootstrap's room history is full, after which a room adds nothing it keeps.
    history = results["room_history"]
    warm = next((b for b in blocks if b["served_before"] >= history), blocks[0])
    grown = blocks[-1]["served_before"] + blocks[-1]["rooms"] - warm["served_before"] - warm["rooms"]
    growth = ", ".join(f"{n} {blocks[-1]['rss_mib'][n] - warm['rss_mib'][n]:+.1f} MiB" for n in services)
    since = (
        f"once the bootstrap's history of {history} rooms is full"
        if warm["served_before"] >= history
        else "after the first block (the room history is not full yet)"
    )
    parts.append(f"\nGrowth over the {grown} rooms served {since}: {growth}.\n")
    parts.append(
        "**A Hugging Face model** (a tiny random-initialised Llama on CPU through "
        "/v1/completions with `stream`; time to the first streamed token)\n"
    )
    parts.append(
        _table(
            ["model", "concurrent", "requests", "max tokens", "TTFT p50 ms", "TTFT p99 ms", "whole p50 ms"],
            [
                [
                    r["model"],
                    r["concurrency"],
                    r["requests"],
                    r["max_tokens"],
                    f"{r['ttft_p50_ms']:.1f}",
                    f"{r['ttft_p99_ms']:.1f}",
                    f"{r['total_p50_ms']:.1f}",
                ]
                for r in results["model"]
            ],
        )
    )
    return parts


_VLLM_CONFIGS = {"plain": "plain vLLM", "mooncake": "MooncakeConnector", "kvroom": "kvroom"}


def _vllm_targets(v: dict[str, Any]) -> str:
    """kvroom's TTFT against MooncakeConnector's at every point, and against one plain instance's
    at the point the target names; each judged from the ratios below it."""
    from bench.vllm import VS_MOONCAKE, VS_PLAIN, VS_PLAIN_POINT

    rows = v["rows"]
    concurrency, tokens = VS_PLAIN_POINT
    point = next(r for r in rows if (r["concurrency"], r["prompt_tokens"]) == VS_PLAIN_POINT)
    missed = [r for r in rows if r["ttft_kvroom_vs_mooncake"] > VS_MOONCAKE]
    worst = max(rows, key=lambda r: r["ttft_kvroom_vs_mooncake"])
    best = min(rows, key=lambda r: r["ttft_kvroom_vs_mooncake"])
    vs_mooncake = f"{best['ttft_kvroom_vs_mooncake']:.2f}x to {worst['ttft_kvroom_vs_mooncake']:.2f}x" + (
        "; over at "
        + ", ".join(f"{r['prompt_tokens']} tokens, {r['concurrency']} concurrent" for r in missed)
        if missed
        else ""
    )
    table = [
        [
            f"kvroom's TTFT ≤ {VS_MOONCAKE}x MooncakeConnector's at every point",
            vs_mooncake,
            "not met" if missed else "met",
        ],
        [
            f"kvroom's TTFT ≤ {VS_PLAIN}x one plain vLLM's, {tokens}-token prompts, {concurrency} concurrent",
            f"{point['ttft_kvroom_vs_plain']:.2f}x",
            "met" if point["ttft_kvroom_vs_plain"] <= VS_PLAIN else "not met",
        ],
    ]
    return _table(["target", "this run", ""], table)


def _vllm_part(v: dict[str, Any], m: dict[str, Any]) -> str:
    shape, quick = v["model"], v["quick"]
    kib = v["kv_bytes_per_token"] / 1024
    parts = [
        f"\n**vLLM: kvroom against vLLM's MooncakeConnector** (real vLLM CPU servers on {m['cpus']} CPUs, "
        f"{v['date']}, each with its worker in its engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0): "
        "one plain instance; a prefill and a decode with vLLM's MooncakeConnector over TCP "
        "behind a proxy as vLLM's example has it; a prefill and a decode with KvroomConnector behind the "
        f"kvroom bootstrap. The tiny random Llama ({shape.get('num_hidden_layers')} layers, "
        f"{shape.get('num_key_value_heads')} KV heads of {shape.get('head_dim')}, float32: "
        f"{kib:g} KiB of KV a token); streamed /v1/completions of token-id prompts of their own, "
        f"{v['max_tokens']} tokens out; "
        "TTFT: to the first streamed text. One configuration runs at a time: each round starts each in "
        f"turn, the order reversed every other round; {v['rounds']} round(s), {v['seconds']:.0f} s in all. "
        "A ratio is the median over rounds of the ratio of one round's medians."
        + (" Quick run: too few requests for ratios, so none is printed." if quick else "")
        + ")\n",
    ]
    if not quick:
        parts.append(_vllm_targets(v) + "\n")
    headers = ["prompt tokens", "concurrent", "requests a round"]
    headers += [f"{name} TTFT p50 ms" for name in _VLLM_CONFIGS.values()]
    headers += [] if quick else ["kvroom ÷ Mooncake", "kvroom ÷ plain"]
    headers += [f"{name} TTFT p90 ms" for name in _VLLM_CONFIGS.values()]
    rows = []
    for r in v["rows"]:
        row = [r["prompt_tokens"], r["concurrency"], r["requests"]]
        row += [f"{r[c]['ttft_p50_ms']:.1f}" for c in _VLLM_CONFIGS]
        if not quick:
            row += [f"{r['ttft_kvroom_vs_mooncake']:.2f}x", f"{r['ttft_kvroom_vs_plain']:.2f}x"]
        row += [f"{r[c]['ttft_p90_ms']:.1f}" for c in _VLLM_CONFIGS]
        rows.append(row)
    parts.append(_table(headers, rows))
    parts.append(
        "\n**vLLM: whole requests and the KV they moved** (request latency to the stream's end; KV loaded: "
        "the decode's own count of prompt tokens from the connector, "
        '`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`, a request)\n'
    )
    headers = ["prompt tokens", "concurrent"]
    headers += [f"{name} latency p50 ms" for name in _VLLM_CONFIGS.values()]
    headers += ["Mooncake KV loaded", "kvroom KV loaded"]
    rows = []
    for r in v["rows"]:
        row = [r["prompt_tokens"], r["concurrency"]]
        row += [f"{r[c]['latency_p50_ms']:.1f}" for c in _VLLM_CONFIGS]
        row += [
            f"{r[c]['loaded_tokens_per_request']:.0f} tokens, {r[c]['loaded_kib_per_request']:.0f} KiB"
            for c in ("mooncake", "kvroom")
        ]
        rows.append(row)
    parts.append(_table(headers, rows))
    agree = ", ".join(f"{_VLLM_CONFIGS[c]} {'yes' if ok else 'NO'}" for c, ok in v["outputs_agree"].items())
    starts = ", ".join(f"{_VLLM_CONFIGS[c]} {s:.0f} s" for c, s in v["start_s"].items())
    notes = [
        f"\nGreedy outputs equal to the plain instance's (one prompt a size): {agree}. "
        f"Starting a configuration (median): {starts}."
    ]
    for config, t in v.get("transfers", {}).items():
        if t:
            notes.append(
                f" {_VLLM_CONFIGS[config]}'s prefill: {t['transfers']} transfers of"
                f" {t['kib_per_transfer']:.0f} KiB and {t['descriptors_per_transfer']:.1f} writes"
                " (engine descriptors) each on average."
            )
    parts.append("".join(notes) + "\n")
    if v.get("cpu_rows"):
        parts.append(_vllm_cpu_part(v))
    return "\n".join(parts)


def _vllm_cpu_part(v: dict[str, Any]) -> str:
    """CPU seconds a request, each configuration under vLLM's default executor, and the targets."""
    from bench.vllm import CPU_VS_MOONCAKE

    rows, quick = v["cpu_rows"], v["quick"]
    parts = [
        "\n**vLLM: CPU seconds a request** (each configuration started again under vLLM's default "
        "executor, as users run it: its worker a process of its own; user + system CPU of every process "
        "of the configuration, API servers, engine cores, workers, and the proxy or the bootstrap, with "
        f"only it running; {v['cpu_prompt_tokens']}-token prompts, {v['max_tokens']} tokens out; median "
        f"over {v['rounds']} round(s), the range in brackets; a ratio is the median of one round's ratios)\n"
    ]
    if not quick:
        table = []
        for r in rows:
            at = f"{r['concurrency']} concurrent"
            ratio, boot = r["cpu_kvroom_vs_mooncake"], r["cpu_bootstrap_vs_proxy"]
            table.append(
                [
                    f"kvroom pair + bootstrap ≤ {CPU_VS_MOONCAKE}x MooncakeConnector pair + proxy, {at}",
                    f"{ratio:.2f}x",
                    "met" if ratio <= CPU_VS_MOONCAKE else "not met",
                ]
            )
            table.append(
                [
                    f"the bootstrap's own ≤ the proxy's, {at}",
                    f"{boot:.2f}x",
                    "met" if boot <= 1 else "not met",
                ]
            )
        parts.append(_table(["target", "this run", ""], table) + "\n")
    headers = ["concurrent", "requests a round"]
    headers += [f"{name} CPU ms a request" for name in _VLLM_CONFIGS.values()]
    headers += [] if quick else ["kvroom ÷ Mooncake"]
    headers += ["Mooncake: prefill, decode, proxy", "kvroom: prefill, decode, bootstrap"]
    table = []
    for r in rows:
        row = [r["concurrency"], r["requests"]]
        for config in _VLLM_CONFIGS:
            low, high = r[config]["cpu_s_range"]
            row.append(f"{r[config]['cpu_s'] * 1000:.0f} [{low * 1000:.0f}-{high * 1000:.0f}]")
        if not quick:
            row.append(f"{r['cpu_kvroom_vs_mooncake']:.2f}x")
        for config in ("mooncake", "kvroom"):
            row.append(", ".join(f"{seconds * 1000:.1f}" for seconds in r[config]["parts"].values()))
        table.append(row)
    parts.append(_table(headers, table))
    return "\n".join(parts)


def _plot(results: dict[str, Any], path: Path) -> None:
    rows, m = results["transfer"], results["machine"]
    sizes = [r["kv_kib"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for key, style, label in (
        ("kvroom_ms", "o-", "kvroom (request to SUCCESS)"),
        ("raw_ms", "s--", "raw engine, blocking"),
        ("raw_polled_ms", "^-.", "raw engine, submitted and polled"),
    ):
        ax.plot(sizes, [r["moved_kib"] * 1024 / (r[key] / 1000) / 1e9 for r in rows], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [size_label(s) for s in sizes])
    ax.set_xlabel("KV per room")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"KV transfer over {m['transport']}, {m['cpus']} CPUs")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
