"""The benchmark's markdown table and plot."""

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(results: dict[str, Any], out: Path) -> None:
    m = results["machine"]
    parts = [
        f"Machine: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, {m['transport']}; "
        f"median of {results['runs']} runs, kvroom and the raw engine interleaved.\n"
    ]
    parts.append(
        "**Transfer efficiency** (decode's transfer request to SUCCESS, against the raw engine "
        "writing the same bytes in the same writes, with its blocking batch call (raw) and "
        "submitted and polled the way the nodes wait over TCP (raw polled); rooms move whole "
        "pages, so a room smaller than a page moves the page; GB/s counts the bytes moved; "
        "kvroom adds: beyond raw polled)\n"
    )
    parts.append(
        _table(
            [
                "KV per room",
                "page",
                "moved",
                "writes",
                "kvroom GB/s",
                "raw GB/s",
                "kvroom / raw",
                "raw polled GB/s",
                "kvroom / raw polled",
                "kvroom adds",
            ],
            [
                [
                    f"{r['kv_mib']} MiB",
                    f"{r['page_kib']} KiB",
                    f"{r['moved_mib']:g} MiB",
                    r["engine_writes"],
                    f"{r['kvroom_gbps']:.2f}",
                    f"{r['raw_gbps']:.2f}",
                    f"{r['ratio']:.3f}",
                    f"{r['raw_polled_gbps']:.2f}",
                    f"{r['ratio_polled']:.3f}",
                    f"{r['added_ms']:.2f} ms",
                ]
                for r in results["transfer"] + results["page_sweep"]
            ],
        )
    )
    parts.append("\n**Scattered versus contiguous destination pages**\n")
    parts.append(
        _table(
            [
                "KV per room",
                "page",
                "decode pages",
                "engine writes",
                "kvroom GB/s",
                "raw GB/s (same writes)",
                "raw polled GB/s",
            ],
            [
                [
                    f"{r['kv_mib']} MiB",
                    f"{r['page_kib']} KiB",
                    "scattered" if r["scattered"] else "contiguous",
                    r["engine_writes"],
                    f"{r['kvroom_gbps']:.2f}",
                    f"{r['raw_gbps']:.2f}",
                    f"{r['raw_polled_gbps']:.2f}",
                ]
                for r in results["scatter"]
            ],
        )
    )
    parts.append("\n**Aux latency** (prefill's KV-write completion to SUCCESS on decode)\n")
    parts.append(
        _table(
            ["rooms in flight", "rooms", "p50 ms", "p99 ms"],
            [
                [a["in_flight"], a["samples"], f"{a['p50']:.3f}", f"{a['p99']:.3f}"]
                for a in results["aux_latency_ms"]
            ],
        )
    )
    parts.append("")
    parts.append("**Control plane** (POST /rooms to finished, 64 KiB of KV a room)\n")
    parts.append(
        _table(
            ["in flight", "rooms", "rooms/s", "p50 ms", "p99 ms"],
            [
                [
                    r["in_flight"],
                    r["rooms"],
                    f"{r['rooms_per_s']:.0f}",
                    f"{r['p50_ms']:.1f}",
                    f"{r['p99_ms']:.1f}",
                ]
                for r in results["control_plane"]
            ],
        )
    )
    blocks = results["sustained"]
    parts.append(
        f"\n**Cost per room as rooms pile up** ({max(r['in_flight'] for r in results['control_plane'])} "
        f"in flight, blocks of {blocks[0]['rooms']} rooms one after another; the bootstrap remembers "
        "the last 10,000 finished rooms and the nodes the last 4,096)\n"
    )
    services = list(blocks[0]["rss_mib"])
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
    parts.append("\n**Resident memory** (MiB)\n")
    parts.append(
        _table(
            ["service", "idle", f"peak at {max(r['in_flight'] for r in results['control_plane'])} in flight"],
            [[n, f"{v['idle_mib']:.0f}", f"{v['peak_mib']:.0f}"] for n, v in results["memory"].items()],
        )
    )
    (out / "results.md").write_text("\n".join(parts) + "\n")

    rows = results["transfer"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    sizes = [r["kv_mib"] for r in rows]
    ax.plot(sizes, [r["kvroom_gbps"] for r in rows], "o-", label="kvroom (request to SUCCESS)")
    ax.plot(sizes, [r["raw_gbps"] for r in rows], "s--", label="raw engine (batch_transfer_sync_write)")
    ax.plot(sizes, [r["raw_polled_gbps"] for r in rows], "^-.", label="raw engine, submitted and polled")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{s} MiB" for s in sizes])
    ax.set_xlabel("KV per room")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"KV transfer over {m['transport']}, {m['cpus']} CPUs")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "gbps.png")
    plt.close(fig)
