"""bench/gpu_check.sh, the operator's check on a GPU host, run here in its CPU dry run.

The dry run is the same flow (a secure LocalStack, --verify-kv, rooms through POST
/rooms, the raw engine beside them) with --device cpu, the tcp transport and small
sizes, so a broken script shows up before anyone takes it to a GPU host.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
SUMMARY = re.compile(
    r"^SUMMARY transport=(?P<transport>\w+) device=(?P<device>\w+) rooms=(?P<ok>\d+)/(?P<total>\d+) SUCCESS "
    r".*kvroom=(?P<kvroom>[\d.]+) GB/s raw=(?P<raw>[\d.]+) GB/s kvroom/raw=[\d.]+ .*aggregate=[\d.]+ GB/s",
    re.M,
)


def test_the_script_parses():
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def test_the_embedded_python_compiles():
    text = SCRIPT.read_text()
    match = re.search(r"<<'PYTHON'\n(.*?)\nPYTHON\n", text, re.S)
    assert match, "the Python heredoc"
    compile(match.group(1), "gpu_check.py", "exec")


def test_a_bad_option_exits_2():
    out = subprocess.run(["bash", str(SCRIPT), "--nope"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "usage:" in out.stderr


@pytest.mark.skipif(
    bool(list(Path("/sys/class/infiniband").glob("*"))) or shutil.which("nvidia-smi") is not None,
    reason="this host may have GPUs or RDMA devices: the real check would run",
)
def test_without_gpus_it_skips_and_says_so():
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 77, out.stdout + out.stderr
    assert "SKIP nvlink" in out.stdout and "SKIP rdma" in out.stdout


@pytest.mark.timeout(240)
def test_the_dry_run_passes_every_room_and_prints_gbps():
    # From another directory: the script finds the repository and its virtualenv itself.
    out = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=200, cwd="/"
    )
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr[-3000:]}"
    match = SUMMARY.search(out.stdout)
    assert match, out.stdout
    assert (match["transport"], match["device"]) == ("tcp", "cpu")
    assert match["ok"] == match["total"] and int(match["total"]) >= 8
    assert float(match["kvroom"]) > 0 and float(match["raw"]) > 0
    assert "8/8 rooms SUCCESS" in out.stdout
    assert "logs:" not in out.stdout, "the logs of a passing run are removed"
