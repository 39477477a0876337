"""bench/gpu_check.sh and bench/gpu_bundle.sh, the operator's check on a GPU host, here on CPU.

The dry run is the same flow (a probe of each transport, a secure LocalStack, --verify-kv,
rooms through POST /rooms, the raw engine beside them, the tiny Llama against generate())
with --device cpu and small sizes; --plan shows the runs a host of N GPUs gets; the
bundle's device command runs here against stand-ins for pip, dpkg and the check. So a
broken script shows up before anyone takes it to a GPU host.
"""

import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
BUNDLE = ROOT / "bench" / "gpu_bundle.sh"
SUMMARY = re.compile(
    r"^SUMMARY transport=(?P<transport>\w+) device=(?P<device>\w+) prefill=(?P<prefill>\S+) "
    r"decode=(?P<decode>\S+) rooms=(?P<ok>\d+)/(?P<total>\d+) SUCCESS verify_kv=on "
    r"aggregate=[\d.]+ GB/s .* model=(?P<model>\S+) equal_generate=(?P<equal>\d+)/(?P<prompts>\d+) ",
    re.M,
)
SIZE = re.compile(
    r"^SIZE transport=tcp device=cpu room=(?P<mib>\d+)MiB moved=(?P<moved>[\d.]+)MiB writes=\d+ "
    r"kvroom=(?P<kvroom>[\d.]+) GB/s raw=(?P<raw>[\d.]+) GB/s kvroom/raw=[\d.]+ stages_ms (?P<stages>.*)$",
    re.M,
)
# What the engine logs (glog) as it starts: the lines the check reads its transport from.
ENGINE_LOG = {
    "tcp": "I1204 04:42:35.758410  6280 transfer_engine_impl.cpp:219] MC_FORCE_TCP is set, "
    "using TCP transport only",
    "nvlink": "I1204 04:42:39.479738  6295 transfer_engine_impl.cpp:367] Using Intra-Node NVLink transport "
    "(MC_INTRANODE_NVLINK set)",
    "noise": "E1204 04:42:35.758098  6280 transfer_metadata.cpp:1098] Local segment descriptor not found",
    "refused": "E1204 04:42:40.000000  6295 intranode_nvlink_transport.cpp:665] IntraNodeNvlinkTransport: "
    "cudaIpcGetMemHandle failed",
}


def run(*args: str, cwd: str | Path = "/", timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, **kw)


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """The check's Python, as the script writes it out, imported as a module."""
    match = re.search(r"<<'PYTHON'\n(.*?)\nPYTHON\n", SCRIPT.read_text(), re.S)
    assert match, "the Python heredoc"
    path = tmp_path_factory.mktemp("gpu_check") / "gpu_check.py"
    path.write_text(match.group(1))
    spec = importlib.util.spec_from_file_location("gpu_check_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scripts_parse():
    for script in (SCRIPT, BUNDLE):
        out = run("-n", str(script))
        assert out.returncode == 0, out.stderr


def test_a_bad_option_exits_2():
    for script in (SCRIPT, BUNDLE):
        out = run(str(script), "--nope")
        assert out.returncode == 2 and "usage:" in out.stderr


# -- the plan: which runs a host gets -------------------------------------------------------


def test_one_gpu_puts_both_nodes_on_cuda0_with_tcp_and_nvlink():
    out = run(str(SCRIPT), "--plan", "--gpus", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "mode: one GPU: both nodes on cuda:0, separate processes, separate allocations" in out.stdout
    plans = re.findall(r"^PLAN (\w+) (\S+) -> (\S+): (.*)$", out.stdout, re.M)
    assert [p[:3] for p in plans] == [("tcp", "cuda:0", "cuda:0"), ("nvlink", "cuda:0", "cuda:0")]
    for *_, what in plans:
        assert "probe" in what and "1,16,256 MiB" in what and "tiny-llama against generate()" in what
    assert "cuda:1" not in out.stdout


def test_two_gpus_put_the_decode_on_cuda1():
    out = run(str(SCRIPT), "--plan", "--gpus", "2", "--no-model", "--sizes", "4")
    assert out.returncode == 0, out.stdout + out.stderr
    plans = re.findall(r"^PLAN (\w+) (\S+) -> (\S+): (.*)$", out.stdout, re.M)
    assert [p[:3] for p in plans] == [("tcp", "cuda:0", "cuda:1"), ("nvlink", "cuda:0", "cuda:1")]
    assert all("rooms of 4 MiB" in p[3] and "tiny-llama" not in p[3] for p in plans)


def test_the_plan_takes_rdma_only_where_a_device_shows(check):
    _, runs, skips = check.plan(1, rdma=True, dry_run=False)
    assert [(r.transport, r.where("prefill"), r.where("decode")) for r in runs] == [
        ("tcp", "cuda:0", "cuda:0"),
        ("nvlink", "cuda:0", "cuda:0"),
        ("rdma", "cuda:0", "cuda:0"),
    ]
    assert skips == []
    _, runs, skips = check.plan(1, rdma=False, dry_run=False)
    assert "rdma" not in [r.transport for r in runs] and skips == [
        "SKIP rdma: no RDMA device under /sys/class/infiniband"
    ]
    _, runs, _ = check.plan(0, rdma=False, dry_run=True)
    assert [(r.transport, r.device) for r in runs] == [("tcp", "cpu"), ("nvlink", "cpu")]


def test_no_gpu_plans_nothing_and_exits_77():
    out = run(str(SCRIPT), "--plan", "--gpus", "0")
    assert out.returncode == 77, out.stdout + out.stderr
    assert "PLAN" not in out.stdout
    for transport in ("tcp", "nvlink", "rdma"):
        assert f"SKIP {transport}: no CUDA GPU visible to torch" in out.stdout


@pytest.mark.skipif(
    bool(list(Path("/sys/class/infiniband").glob("*"))) or shutil.which("nvidia-smi") is not None,
    reason="this host may have GPUs or RDMA devices: the real check would run",
)
def test_without_gpus_it_skips_and_says_so():
    out = run(str(SCRIPT), timeout=120)
    assert out.returncode == 77, out.stdout + out.stderr
    assert "SKIP nvlink" in out.stdout and "SKIP rdma" in out.stdout


# -- what the engine says: a transport it gave, or refused ------------------------------------


def test_the_transport_is_read_from_the_engines_information_lines(check):
    log = "\n".join(ENGINE_LOG[k] for k in ("noise", "nvlink"))
    assert check.installed_transports(log) == {
        "nvlink": "Using Intra-Node NVLink transport (MC_INTRANODE_NVLINK set)"
    }
    assert check.refusal("nvlink", [log, log], None) is None
    # An error line that names the transport does not say it was installed, nor does the handshake's.
    assert check.installed_transports(ENGINE_LOG["refused"]) == {}
    rpc = "I1204 04:42:39.479738  6295 transfer_engine_impl.cpp:183] Using TCP transport for RPC"
    assert check.installed_transports(rpc) == {}


def test_a_transport_the_engine_replaced_is_refused_in_its_words(check):
    tcp = "\n".join(ENGINE_LOG[k] for k in ("noise", "tcp"))
    assert check.refusal("nvlink", [tcp, tcp], None) == (
        "the engine installed tcp instead: 'MC_FORCE_TCP is set, using TCP transport only'"
    )
    assert check.refusal("tcp", [tcp, tcp], None) is None


def test_a_failure_carries_the_engines_last_error_that_says_something(check):
    log = "\n".join(ENGINE_LOG[k] for k in ("nvlink", "refused", "noise"))
    reason = check.refusal("nvlink", [log, ""], "receiver: register_memory(0x7f00, 4194304) returned -1")
    assert reason == (
        "receiver: register_memory(0x7f00, 4194304) returned -1; the engine logged: "
        "intranode_nvlink_transport.cpp:665] IntraNodeNvlinkTransport: cudaIpcGetMemHandle failed"
    )
    assert check.refusal("nvlink", [ENGINE_LOG["noise"]], "no answer") == "no answer"


# -- the dry run: the whole flow on CPU ----------------------------------------------------------


@pytest.mark.timeout(300)
def test_the_dry_run_passes_every_room_and_prints_gbps_stages_and_the_skip():
    # From another directory: the script finds the repository and its virtualenv itself.
    out = run(str(SCRIPT), "--dry-run", timeout=280)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr[-3000:]}"
    match = SUMMARY.search(out.stdout)
    assert match, out.stdout
    assert (match["transport"], match["device"], match["prefill"], match["decode"]) == (
        "tcp",
        "cpu",
        "cpu",
        "cpu",
    )
    assert match["ok"] == match["total"] and int(match["total"]) >= 4 + 8 + 2 * 5 + 8
    assert match["model"] == "tiny-llama/float32" and match["equal"] == match["prompts"] == "8"
    sizes = {m["mib"]: m for m in SIZE.finditer(out.stdout)}
    assert sorted(sizes) == ["1", "4"], out.stdout
    for mib, m in sizes.items():
        assert float(m["moved"]) == float(mib)  # one token a page: a room moves what it holds
        assert float(m["kvroom"]) > 0 and float(m["raw"]) > 0
        stages = dict(kv.split("=") for kv in m["stages"].split())
        assert set(stages) == {"request_hop", "hand_off", "engine_write", "done_hop", "gate_to_success"}
    assert "[tcp/cpu] probe: 4 MiB written and found at the receiver" in out.stdout
    # The non-CUDA engine has no NVLink: it falls back to TCP, and the check says so instead of passing.
    assert re.search(r"^SKIP nvlink: the engine installed tcp instead: '.+'$", out.stdout, re.M), out.stdout
    assert "SUMMARY transport=nvlink" not in out.stdout
    assert "RESULT passed=tcp skipped=nvlink failed=-" in out.stdout
    assert "logs:" not in out.stdout, "the logs of a passing run are removed"


# -- the bundle: the command a GPU host runs ---------------------------------------------------


def printed() -> tuple[list[str], int, str]:
    out = run(str(BUNDLE), "--print")
    assert out.returncode == 0, out.stderr
    carry = re.search(r"^carry: (\[.*\])$", out.stdout, re.M)
    timeout = re.search(r"^timeout_s: (\d+)$", out.stdout, re.M)
    command = re.search(r"^command \((\d+) characters\):\n(.*)$", out.stdout, re.M)
    assert carry and timeout and command, out.stdout
    assert int(command[1]) == len(command[2])
    return json.loads(carry[1]), int(timeout[1]), command[2]


def test_the_bundle_prints_the_carry_list_and_a_command_that_fits():
    carry, timeout, command = printed()
    assert carry == [".whl", ".deb"]
    assert len(command) <= 2000 and timeout <= 600
    check_limit = int(re.search(r"timeout -k \d+ (\d+) bash bench/gpu_check.sh", command)[1])
    assert check_limit <= 360 < timeout  # the check under six minutes, the call's limit above it
    for part in (
        "python3 -m pip install",
        "--no-index",
        "--find-links .whl -r .whl/requirements.txt",
        "dpkg -x",
        "LD_LIBRARY_PATH=",
    ):
        assert part in command
    ignored = subprocess.run(
        ["git", "check-ignore", ".whl/x.whl", ".deb/x.deb"], cwd=ROOT, capture_output=True, text=True
    )
    assert ignored.stdout.split() == [".whl/x.whl", ".deb/x.deb"], "the bundle is never committed"


def stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_the_bundle_command_installs_unpacks_and_runs_the_check(tmp_path):
    """The printed command, run in a tree of its own with pip, dpkg and the check stood in for."""
    _, _, command = printed()
    tree, bin_dir, out_dir = tmp_path / "tree", tmp_path / "bin", tmp_path / "out"
    for folder in (tree / ".whl", tree / ".deb", tree / "bench", bin_dir, out_dir):
        folder.mkdir(parents=True)
    (tree / ".whl" / "requirements.txt").write_text("fastapi==0.165.0\n")
    for name in ("libibverbs1_44.0-2_amd64.deb", "libnuma1_2.0.16-1_amd64.deb"):
        (tree / ".deb" / name).write_text("")
    calls = tmp_path / "calls"
    stub(bin_dir, "python3", f'echo "python3 $*" >>{calls}\n')
    stub(bin_dir, "dpkg", f'echo "dpkg $*" >>{calls}\n')
    (tree / "bench" / "gpu_check.sh").write_text(
        'echo "check $* LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; exit 77\n'
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out_dir)}
    env.pop("LD_LIBRARY_PATH", None)
    done = subprocess.run(
        ["bash", "-c", command], cwd=tree, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 77, done.stdout + done.stderr  # the check's own status comes back
    lines = calls.read_text().splitlines()
    assert (
        lines[0].startswith("python3 -m pip install ")
        and "--find-links .whl -r .whl/requirements.txt" in lines[0]
    )
    assert sorted(lines[1:]) == [
        "dpkg -x .deb/libibverbs1_44.0-2_amd64.deb /tmp/kvroom-deb",
        "dpkg -x .deb/libnuma1_2.0.16-1_amd64.deb /tmp/kvroom-deb",
    ]
    log = (out_dir / "gpu_check.log").read_text()
    assert log.startswith("check --keep-logs LD_LIBRARY_PATH=/tmp/kvroom-deb/usr/lib/x86_64-linux-gnu:")
    assert (out_dir / "gpu_check_logs.tgz").stat().st_size > 0
