"""The benchmark in quick mode, so it never rots. No timing is asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
    for row in results["transfer"]:
        assert row["kvroom_ms"] > 0 and row["raw_polled_ms"] > 0 and row["engine_writes"] >= 1
        assert row["messages_ms"] > 0
        assert row["moved_kib"] == row["kv_kib"]  # one token a page: a room moves what it holds
        stages = row["stages_ms"]
        assert set(stages) == {"request_hop", "hand_off", "engine_write", "done_hop", "gate_to_success"}
        assert all(v >= 0 for v in stages.values()), stages  # the nodes stamped every stage, in order
    assert {r["variant"] for r in results["options"]} == {
        "CURVE, KV not verified (the default)",
        "plain ZMQ",
        "CURVE and --verify-kv",
    }
    assert sorted({r["kv_kib"] for r in results["options"]}) == [256, 1024]  # every variant, every size
    assert len(results["options"]) == 6
    assert [(r["prefill_tp"], r["decode_tp"]) for r in results["tensor_parallel"]] == [(1, 1), (2, 2)]
    assert {r["zmq"] for r in results["curve_control_plane"]} == {"CURVE", "plain ZMQ"}
    assert set(results["sustained"][0]["rss_mib"]) == {"bootstrap", "prefill", "decode"}
    assert [b["served_before"] for b in results["sustained"]] == [40, 56]  # 8 + 16 + 16, then a block
    assert all(r["ttft_p50_ms"] > 0 for r in results["model"])
    report = (tmp_path / "results.md").read_text()
    assert "Quick run" in report and "÷" not in report  # no ratio from a few runs
    assert (tmp_path / "gbps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A full run's report judges the targets from the same numbers.
    from bench.report import write_report

    full = tmp_path / "full"
    full.mkdir()
    write_report({**results, "quick": False}, full)
    table = (full / "results.md").read_text().split("**Targets**")[1].split("**Transfer**")[0]
    verdicts = [line.rsplit("|", 2)[1].strip() for line in table.splitlines() if line.startswith("| ")][1:]
    # No RSS row (history not full), no 16 MiB verify row (not a quick size).
    assert len(verdicts) == 7 and set(verdicts) <= {"met", "not met"}
    aux = next(line for line in table.splitlines() if "aux p99" in line)
    assert ("not met" in aux) == (results["control_plane"][-1]["aux_p99_ms"] > 5)
    verify = next(line for line in table.splitlines() if "--verify-kv adds" in line)
    row = next(
        r for r in results["options"] if r["variant"] == "CURVE and --verify-kv" and r["kv_kib"] == 256
    )
    assert ("not met" in verify) == (row["vs_default_ms"] > 0.2)


def test_against_a_commit_judges_both_versions_row_by_row(tmp_path):
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    scratch = tmp_path / "scratch"  # where the old version is checked out
    scratch.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "bench", "--against", "HEAD", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    results = json.loads((tmp_path / "against.json").read_text())
    assert results["old"]["ref"] == "HEAD"
    assert results["old"]["commit"] == results["new"]["commit"] == head
    assert not results["old"]["local_changes"]  # a clean checkout of the commit
    rows = results["rows"]
    assert [(r["section"], r["point"]) for r in rows] == [
        ("CURVE, KV not verified (the default)", "256 KiB room, request→SUCCESS ms"),
        ("CURVE, KV not verified (the default)", "1 MiB room, request→SUCCESS ms"),
        ("control plane, 8 in flight", "rooms/s"),
        ("control plane, 8 in flight", "p50 ms"),
    ]
    for row in rows:
        assert row["old"] > 0 and row["new"] > 0 and row["ratio"] > 0 and row["tolerance"] >= 0, row
        assert row["verdict"] in {"not worse", "worse"}
    runs = [results["runs"]] * 2 + [results["blocks"]] * 2  # rooms, then blocks of rooms
    assert [len(r["samples"]["old"]) for r in rows] == [len(r["samples"]["new"]) for r in rows] == runs
    assert results["verdict"] == ("worse" if any(r["verdict"] == "worse" for r in rows) else "not worse")
    report = (tmp_path / "against.md").read_text()
    assert f"`{head[:12]}`" in report and f"**Verdict: {results['verdict']}**" in report
    table = [line for line in report.splitlines() if line.startswith("| ")][1:]
    assert len(table) == len(rows)
    assert all(line.split(" | ")[-1].rstrip(" |") in {"not worse", "worse"} for line in table)
    assert not (tmp_path / "results.json").exists()  # the benchmark's own report is left as it was
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    # The old version's checkout is gone.
    assert str(scratch) not in worktrees and not list(scratch.glob("kvroom-against-*"))


VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="bash setup.sh vllm makes .venv-vllm")
@pytest.mark.timeout(900)
def test_the_vllm_section_runs_its_three_configurations_and_reports(tmp_path):
    """Costs about five minutes: ten vLLM CPU servers, one configuration at a time, each started
    twice (its worker in its engine core for TTFT, vLLM's default executor for CPU)."""
    (tmp_path / "results.json").write_text(json.dumps({"machine": {"cpus": 2}, "kept": True}))
    out = subprocess.run(
        [sys.executable, "-m", "bench", "--vllm-only", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["kept"] is True  # the sections already there stay as they were
    vllm = results["vllm"]
    assert vllm["quick"] is True and vllm["rounds"] == 1
    # Both PD pairs moved the KV intact: they answer as one plain instance does.
    assert vllm["outputs_agree"] == {"mooncake": True, "kvroom": True}
    assert [(r["prompt_tokens"], r["concurrency"]) for r in vllm["rows"]] == [
        (16, 1),
        (128, 1),
        (400, 1),
        (16, 8),
        (128, 8),
        (400, 8),
    ]
    for row in vllm["rows"]:
        for config in ("plain", "mooncake", "kvroom"):
            assert 0 < row[config]["ttft_p50_ms"] <= row[config]["latency_p50_ms"], (config, row)
        assert row["plain"]["loaded_tokens_per_request"] == 0
        # The decodes computed no prompt themselves: every token of it came through the connector.
        for config in ("mooncake", "kvroom"):
            assert row[config]["loaded_tokens_per_request"] == row["prompt_tokens"], (config, row)
    # kvroom's prefill counted its writes (Mooncake's logs them every 10 s, maybe not in so short
    # a run): at least one a layer.
    assert vllm["transfers"]["kvroom"]["descriptors_per_transfer"] >= 2, vllm["transfers"]
    # CPU a request of every process tree of each configuration, one at a time and 8 at once.
    assert [r["concurrency"] for r in vllm["cpu_rows"]] == [1, 8]
    trees = {
        "plain": ["server"],
        "mooncake": ["prefill", "decode", "proxy"],
        "kvroom": ["prefill", "decode", "bootstrap"],
    }
    for row in vllm["cpu_rows"]:
        for config, names in trees.items():
            got = row[config]
            assert list(got["parts"]) == names, (config, got)
            # Each tree spent CPU on the requests: a root whose descendants were missed shows 0.
            assert all(seconds > 0 for seconds in got["parts"].values()), (config, got)
            assert got["cpu_s_range"][0] <= got["cpu_s"] == pytest.approx(sum(got["parts"].values()))
    report = (tmp_path / "results.md").read_text()
    assert "**vLLM: kvroom against vLLM's MooncakeConnector**" in report
    assert "kvroom's prefill:" in report
    assert "Quick run" in report and "÷" not in report
    # A full run's report judges the two targets from the same numbers.
    from bench.report import write_report

    full = tmp_path / "full"
    full.mkdir()
    write_report({"machine": results["machine"], "vllm": {**vllm, "quick": False}}, full)
    lines = (full / "results.md").read_text().splitlines()
    targets = [line for line in lines if line.startswith("| kvroom's TTFT ≤")]
    assert len(targets) == 2
    every = all(r["ttft_kvroom_vs_mooncake"] <= 0.9 for r in vllm["rows"])
    assert targets[0].endswith("| met |") == every
    point = next(r for r in vllm["rows"] if (r["prompt_tokens"], r["concurrency"]) == (400, 1))
    assert targets[1].endswith("| met |") == (point["ttft_kvroom_vs_plain"] <= 1.5)
    cpu_targets = [
        line for line in lines if line.startswith(("| kvroom pair + bootstrap ≤", "| the bootstrap's own"))
    ]
    assert len(cpu_targets) == 4
    for r, (pair, own) in zip(
        vllm["cpu_rows"], zip(cpu_targets[::2], cpu_targets[1::2], strict=True), strict=True
    ):
        assert pair.endswith("| met |") == (r["cpu_kvroom_vs_mooncake"] <= 1.0)
        assert own.endswith("| met |") == (r["cpu_bootstrap_vs_proxy"] <= 1.0)


# The commit before the connector's fence: its vLLM servers run without the transfer-params guard.
BEFORE_THE_FENCE = "e98e6f7"


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="bash setup.sh vllm makes .venv-vllm")
@pytest.mark.timeout(900)
def test_the_vllm_pair_against_a_commit_judges_both_versions_row_by_row(tmp_path):
    """Costs about seven minutes: two rounds of kvroom's pair on each version, each started twice."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    args = ["--vllm-only", "--quick", "--against", BEFORE_THE_FENCE, "--out", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    results = json.loads((tmp_path / "against-vllm.json").read_text())
    assert results["old"]["commit"].startswith(BEFORE_THE_FENCE) and not results["old"]["local_changes"]
    assert results["rounds"] == 2
    # Both versions' pairs moved the KV intact: the same greedy tokens, every round.
    assert results["outputs_agree"] is True
    rows = results["rows"]
    points = [f"{size} tokens, {c} at once" for c in (1, 8) for size in (16, 128, 400)]
    expected = [(section, p) for p in points for section in ("TTFT p50 ms", "latency p50 ms")]
    expected += [("CPU s a request", f"128 tokens, {c} at once") for c in (1, 8)]
    assert [(r["section"], r["point"]) for r in rows] == expected
    for row in rows:
        assert [len(row["samples"][v]) for v in ("old", "new")] == [2, 2], row
        assert all(s > 0 for v in ("old", "new") for s in row["samples"][v]), row
        assert row["verdict"] in {"not worse", "worse"} and row["better"] == "lower"
    assert results["verdict"] == ("worse" if any(r["verdict"] == "worse" for r in rows) else "not worse")
    report = (tmp_path / "against-vllm.md").read_text()
    assert f"**Verdict: {results['verdict']}**" in report and "token-equal in every round: yes" in report
    assert len([line for line in report.splitlines() if line.startswith("| ")]) == 1 + len(rows)
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert str(scratch) not in worktrees and not list(scratch.glob("kvroom-against-*"))
