#!/usr/bin/env bash
# kvroom on one GPU host, end to end, in under five minutes:
#
#   bash bench/gpu_check.sh             # on a host with CUDA GPUs
#   bash bench/gpu_check.sh --dry-run   # the same flow on a CPU host (tcp, small sizes)
#
# For each transport the host has, it starts a bootstrap, a prefill node and a decode
# node as real processes (a join token and CURVE keys, as launcher/local_stack.py's
# LocalStack gives them; --verify-kv on both nodes), with CUDA KV pools (--device cuda,
# prefill on --gpus 0, decode on --gpus 1) and the synthetic KV of an 8B-class model
# (32 layers, 8 KV heads of 128, bfloat16: 128 KiB a token). Then:
#
#   0. a first round of 8 rooms, untimed: it connects the engines and warms the pages;
#   1. 64 rooms of 1,024 prompt tokens through POST /rooms, 8 in flight: every room must
#      end SUCCESS (KV digests matched, aux validated); the aggregate GB/s is printed;
#   2. 16 more rooms one at a time, each beside the raw Mooncake engine writing the same
#      bytes in the same writes between two processes holding the same kind of memory
#      (CUDA tensors on the same GPUs), A B B A; the medians are printed as GB/s.
#
# Transports: nvlink (needs 2 GPUs) and, when an RDMA device shows under
# /sys/class/infiniband, rdma (GPU 0 to GPU 1, or GPU 0 to itself on a one-GPU host).
# What the host lacks is printed as SKIP. One line per run starts with SUMMARY.
#
# Exit status: 0 when every room of every run ended SUCCESS, 1 when some did not or a
# run failed, 77 when the host could run nothing (no CUDA GPU), 2 for a bad option.
# Logs of each service stay in the printed directory when a run fails (or with --keep-logs).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash bench/gpu_check.sh [--dry-run] [--rooms N] [--timed-rooms N] [--tokens N]
                               [--in-flight N] [--rdma-devices mlx5_0,...] [--keep-logs]
  --dry-run        CPU host: --device cpu, tcp transport, 8 rooms of 64 tokens
  --rooms N        rooms checked for SUCCESS, --in-flight at a time (default 64; dry run 8)
  --timed-rooms N  rooms timed one at a time against the raw engine (default 16; dry run 4)
  --tokens N       prompt tokens a room (default 1024; dry run 64)
  --in-flight N    rooms in flight in the first phase (default 8; dry run 4)
  --rdma-devices   RDMA devices for the rdma run (default: every HCA the engine finds)
  --keep-logs      keep the services' logs even when every check passed
EOF
}

cd "$(dirname "$0")/.."
if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi

DRY_RUN=0 ROOMS="" TIMED="" TOKENS="" IN_FLIGHT="" RDMA_DEVICES="" KEEP_LOGS=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --rooms) ROOMS="$2"; shift ;;
    --timed-rooms) TIMED="$2"; shift ;;
    --tokens) TOKENS="$2"; shift ;;
    --in-flight) IN_FLIGHT="$2"; shift ;;
    --rdma-devices) RDMA_DEVICES="$2"; shift ;;
    --keep-logs) KEEP_LOGS=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
if [[ $DRY_RUN == 1 ]]; then
  ROOMS=${ROOMS:-8} TIMED=${TIMED:-4} TOKENS=${TOKENS:-64} IN_FLIGHT=${IN_FLIGHT:-4}
else
  ROOMS=${ROOMS:-64} TIMED=${TIMED:-16} TOKENS=${TOKENS:-1024} IN_FLIGHT=${IN_FLIGHT:-8}
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvroom-gpu-check.XXXXXX")
FAILED=0
cleanup() {
  if [[ $FAILED == 0 && $KEEP_LOGS == 0 ]]; then rm -rf "$WORK"; else echo "logs: $WORK"; fi
}
trap cleanup EXIT

# The check itself, in Python: LocalStack starts the services, the raw engine runs in two
# spawned processes. A file rather than `python -`, so that the spawned children can
# import it.
cat >"$WORK/gpu_check.py" <<'PYTHON'
"""One run of bench/gpu_check.sh: a stack on one transport, its rooms, the raw engine beside it."""

import argparse
import concurrent.futures
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

# The synthetic KV layout of an 8B-class model, as `python -m bench` uses it.
LAYOUT = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
TOKEN_BYTES = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head size x (K, V) x 2 bytes
PAGE_SIZE = 16
MIB = 1 << 20


def buffer(nbytes: int, device: str, fill: int):
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    return torch.full((nbytes,), fill, dtype=torch.uint8, device=device)


def quiet(log: Path) -> None:
    """The engine logs to stderr from C++: send a raw process's output to its own log file."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)


def raw_receiver(nbytes: int, device: str, transport: str, rdma: str, log: Path, conn: Connection) -> None:
    from shared.transfer import MooncakeEngine

    quiet(log)
    buf = buffer(nbytes, device, 0)
    engine = MooncakeEngine("127.0.0.1", transport, rdma)
    engine.register(buf.data_ptr(), nbytes)
    conn.send((engine.session_id, buf.data_ptr()))
    conn.recv()  # hold the memory until told to stop


def raw_sender(
    nbytes: int, device: str, transport: str, rdma: str, log: Path, peer, conn: Connection
) -> None:
    from shared.transfer import MooncakeEngine

    quiet(log)
    session, dst = peer
    buf = buffer(nbytes, device, 1)
    engine = MooncakeEngine("127.0.0.1", transport, rdma)
    engine.register(buf.data_ptr(), nbytes)
    src = buf.data_ptr()
    while (job := conn.recv()) is not None:
        total, entries = job
        size = total // entries
        writes = [(src + i * size, dst + i * size, size) for i in range(entries)]
        started = time.perf_counter()
        # Blocking on rdma and nvlink, submitted and polled on tcp: as the nodes wait.
        engine.write(session, writes)
        conn.send(time.perf_counter() - started)


class RawPair:
    """Two processes, each with its own engine and memory on its own device."""

    def __init__(self, nbytes: int, src: str, dst: str, transport: str, rdma: str, log_dir: Path):
        ctx = mp.get_context("spawn")  # a fresh CUDA context in each
        self.recv_conn, child = ctx.Pipe()
        self.receiver = ctx.Process(
            target=raw_receiver,
            args=(nbytes, dst, transport, rdma, log_dir / "raw-receiver.log", child),
            daemon=True,
        )
        self.receiver.start()
        peer = self.recv_conn.recv()
        self.send_conn, child = ctx.Pipe()
        self.sender = ctx.Process(
            target=raw_sender,
            args=(nbytes, src, transport, rdma, log_dir / "raw-sender.log", peer, child),
            daemon=True,
        )
        self.sender.start()

    def write(self, total: int, entries: int) -> float:
        self.send_conn.send((total, entries))
        return float(self.send_conn.recv())

    def close(self) -> None:
        for conn in (self.send_conn, self.recv_conn):
            with contextlib.suppress(OSError):  # the process may have died already
                conn.send(None)
        for proc in (self.sender, self.receiver):
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def node_args(args: argparse.Namespace, gpu: int) -> list[str]:
    pages_a_room = -(-(args.tokens + 1) // PAGE_SIZE)  # the prompt and the one token it generates
    flags = ["--model", "synthetic", "--page-size", str(PAGE_SIZE)]
    for key, value in LAYOUT.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    flags += ["--num-pages", str(args.in_flight * pages_a_room + 64)]
    flags += ["--transport", args.transport, "--device", args.device, "--log-level", "WARNING"]
    if args.device == "cuda":
        flags += ["--gpus", str(gpu)]
    if args.transport == "rdma" and args.rdma_devices:
        flags += ["--rdma-devices", args.rdma_devices]
    return flags


def run_room(url: str, index: int, tokens: int) -> dict:
    import httpx

    with httpx.Client(base_url=url, timeout=90.0) as client:
        ids = [65 + index % 26] * tokens  # the synthetic model does not read them
        created = client.post("/rooms", params={"wait": 60}, json={"input_ids": ids, "max_new_tokens": 1})
        created.raise_for_status()
        body = created.json()
        while not body["finished"]:
            body = client.get(f"/rooms/{body['room']}", params={"wait": 60}).json()
        for _ in range(200):  # the prefill's report (what it wrote) may trail the decode's
            if body["state"] != "SUCCESS" or "bytes_written" in body["timings"]:
                break
            time.sleep(0.01)
            body = client.get(f"/rooms/{body['room']}").json()
        return body


def not_success(room: dict) -> str | None:
    return None if room["state"] == "SUCCESS" else f"{room['room']} {room['state']} {room.get('reason')}"


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", required=True, choices=["tcp", "rdma", "nvlink"])
    parser.add_argument("--device", required=True, choices=["cpu", "cuda"])
    parser.add_argument("--prefill-gpu", type=int, default=0)
    parser.add_argument("--decode-gpu", type=int, default=1)
    parser.add_argument("--rooms", type=int, required=True)
    parser.add_argument("--timed-rooms", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--in-flight", type=int, required=True)
    parser.add_argument("--rdma-devices", default="")
    parser.add_argument("--log-dir", type=Path, required=True)
    args = parser.parse_args()

    from launcher.local_stack import LocalStack

    name = f"{args.transport}/{args.device}"
    where = f"cuda:{args.prefill_gpu} -> cuda:{args.decode_gpu}" if args.device == "cuda" else "cpu -> cpu"
    print(f"[{name}] starting bootstrap, prefill and decode ({where}); logs in {args.log_dir}", flush=True)
    stack = LocalStack(
        args.log_dir,
        bootstrap_args=["--log-level", "WARNING", "--max-prompt-tokens", str(max(4096, args.tokens))],
        verify_kv=True,  # every page digested on both sides before SUCCESS
    )
    raw = None
    failed: list[str] = []
    try:
        started = time.monotonic()
        stack.start(node_args(args, args.prefill_gpu), node_args(args, args.decode_gpu))
        print(f"[{name}] services registered in {time.monotonic() - started:.1f}s", flush=True)

        def batch(first: int, count: int) -> list[dict]:
            with concurrent.futures.ThreadPoolExecutor(args.in_flight) as pool:
                work = [first + i for i in range(count)]
                rooms = list(pool.map(lambda i: run_room(stack.bootstrap.url, i, args.tokens), work))
            failed.extend(filter(None, map(not_success, rooms)))
            return rooms

        # A first round of rooms, outside the timing: it sets up the connections between the
        # nodes' engines, loads the digest kernels and touches the pages the rooms use.
        batch(0, args.in_flight)
        if failed:
            return 1

        # 1. Every room must end SUCCESS, with rooms in flight together.
        started = time.perf_counter()
        rooms = batch(args.in_flight, args.rooms)
        wall = time.perf_counter() - started
        # What a room moves: the prefill's own count where its report arrived, else whole pages.
        pages_bytes = -(-args.tokens // PAGE_SIZE) * PAGE_SIZE * TOKEN_BYTES
        moved_total = sum(int(r["timings"].get("bytes_written", pages_bytes)) for r in rooms)
        print(
            f"[{name}] {args.rooms - len(failed)}/{args.rooms} rooms SUCCESS, {args.in_flight} in flight: "
            f"{moved_total / MIB:.0f} MiB in {wall:.2f}s, {gbps(moved_total, wall):.2f} GB/s aggregate",
            flush=True,
        )
        if failed:
            return 1

        # 2. Rooms one at a time beside the raw engine writing the same bytes in as many writes.
        reported = [r["timings"] for r in rooms if "engine_writes" in r["timings"]]
        moved = int(reported[0]["bytes_written"]) if reported else pages_bytes
        # Without the prefill's report: runs of pages cut into writes of at most 4 MiB, as it does.
        writes = int(reported[0]["engine_writes"]) if reported else -(-moved // (4 * MIB))
        device = {"cpu": ("cpu", "cpu"), "cuda": (f"cuda:{args.prefill_gpu}", f"cuda:{args.decode_gpu}")}
        src, dst = device[args.device]
        raw = RawPair(moved, src, dst, args.transport, args.rdma_devices, args.log_dir)
        raw.write(moved, writes)  # the first write sets up the connection between the engines
        ours: list[float] = []
        engine: list[float] = []
        theirs: list[float] = []
        for i in range(args.timed_rooms):
            if i % 2:
                theirs.append(raw.write(moved, writes))
            room = run_room(stack.bootstrap.url, args.in_flight + args.rooms + i, args.tokens)
            if problem := not_success(room):
                failed.append(problem)
                continue
            ours.append(room["timings"]["request_to_success_s"])
            if "transfer_s" in room["timings"]:
                engine.append(room["timings"]["transfer_s"])
            if not i % 2:
                theirs.append(raw.write(moved, writes))
        total = args.in_flight + args.rooms + args.timed_rooms  # the first round too
        ok = total - len(failed)
        if not ours:
            return 1
        kv, rw = statistics.median(ours), statistics.median(theirs)
        eng = statistics.median(engine) if engine else float("nan")
        print(
            f"[{name}] a room moves {moved / MIB:.1f} MiB ({args.tokens} tokens, whole pages) "
            f"in {writes} writes; medians of {len(ours)} rooms one at a time and {len(theirs)} raw writes: "
            f"kvroom {kv * 1000:.2f} ms (decode's request to SUCCESS; the prefill's engine call "
            f"{eng * 1000:.2f} ms), raw {rw * 1000:.2f} ms",
            flush=True,
        )
        print(
            f"[{name}] kvroom's time includes --verify-kv's digest of every page on both nodes "
            "and the done+aux hop; the raw engine only writes",
            flush=True,
        )
        print(
            f"SUMMARY transport={args.transport} device={args.device} rooms={ok}/{total} SUCCESS "
            f"verify_kv=on kv_per_room={moved / MIB:.1f}MiB kvroom={gbps(moved, kv):.2f} GB/s "
            f"raw={gbps(moved, rw):.2f} GB/s kvroom/raw={rw / kv:.3f} "
            f"engine_only={gbps(moved, eng):.2f} GB/s aggregate={gbps(moved_total, wall):.2f} GB/s "
            f"({args.in_flight} in flight)",
            flush=True,
        )
        return 0 if not failed else 1
    finally:
        if failed:
            print(f"[{name}] rooms not SUCCESS: {failed[:8]}", flush=True)
        if raw is not None:
            raw.close()
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
PYTHON

# One line per run: transport, device, prefill GPU, decode GPU.
RUNS=()
if [[ $DRY_RUN == 1 ]]; then
  echo "dry run: --device cpu, tcp, $ROOMS rooms of $TOKENS tokens (the GPU runs use nvlink and rdma)"
  RUNS+=("tcp cpu 0 0")
else
  GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
  echo "host: $GPUS CUDA GPU(s) visible to torch"
  if [[ $GPUS == 0 ]] && command -v nvidia-smi >/dev/null; then
    echo "note: nvidia-smi is here but torch sees no GPU: is $PY's torch a CPU build? (pip install '.[cuda]' and a CUDA torch)"
  fi
  if [[ $GPUS -ge 2 ]]; then
    RUNS+=("nvlink cuda 0 1")
  else
    echo "SKIP nvlink: needs 2 GPUs, this host shows $GPUS"
  fi
  if compgen -G "/sys/class/infiniband/*" >/dev/null; then
    if [[ $GPUS -ge 2 ]]; then
      RUNS+=("rdma cuda 0 1")
    elif [[ $GPUS -ge 1 ]]; then
      RUNS+=("rdma cuda 0 0")
    else
      echo "SKIP rdma: no CUDA GPU"
    fi
  else
    echo "SKIP rdma: no RDMA device under /sys/class/infiniband"
  fi
  if [[ ${#RUNS[@]} -eq 0 ]]; then
    echo "nothing to run on this host"
    exit 77
  fi
fi

for run in "${RUNS[@]}"; do
  read -r transport device prefill_gpu decode_gpu <<<"$run"
  if ! PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 "$PY" "$WORK/gpu_check.py" \
    --transport "$transport" --device "$device" \
    --prefill-gpu "$prefill_gpu" --decode-gpu "$decode_gpu" \
    --rooms "$ROOMS" --timed-rooms "$TIMED" --tokens "$TOKENS" --in-flight "$IN_FLIGHT" \
    --rdma-devices "$RDMA_DEVICES" --log-dir "$WORK/$transport"; then
    echo "FAILED $transport/$device: see $WORK/$transport/*.log"
    FAILED=1
  fi
done
exit $FAILED
