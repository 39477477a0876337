"""The benchmark in quick mode, so it never rots. No timing is asserted."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_benchmark_produces_its_report(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["quick"] is True
    for key in (
        "transfer",
        "page_sweep",
        "scatter",
        "control_plane",
        "sustained",
        "aux_latency_ms",
        "memory",
    ):
        assert results[key], key
    for row in results["transfer"] + results["page_sweep"] + results["scatter"]:
        assert row["kvroom_gbps"] > 0 and row["raw_gbps"] > 0 and row["engine_writes"] >= 1
        assert row["moved_mib"] >= row["kv_mib"]  # whole pages, and the raw engine moved as much
    scattered = [r for r in results["scatter"] if r["scattered"]]
    contiguous = [r for r in results["scatter"] if not r["scattered"]]
    assert scattered[0]["engine_writes"] > contiguous[0]["engine_writes"]  # what coalescing saves
    assert set(results["memory"]) == {"bootstrap", "prefill", "decode"}
    assert [b["served_before"] for b in results["sustained"]] == [24, 40]  # after 8 + 16 rooms
    assert "Transfer efficiency" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "gbps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
