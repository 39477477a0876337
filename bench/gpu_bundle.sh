#!/usr/bin/env bash
# What bench/gpu_check.sh needs on a GPU host that has Python 3.12, torch (CUDA 13) and
# transformers but no package registry, built here to travel with the working tree
# (docs/gpu.md says how it is used):
#
#   .whl/  wheels for Python 3.12 of the CUDA 13 transfer engine and of what kvroom imports
#          that such a host lacks, at the versions this checkout's .venv runs, and
#          .whl/requirements.txt naming what to install from them;
#   .deb/  the system libraries the engine loads (libibverbs1, libnuma1, libcurl4, ...),
#          less those every Debian or Ubuntu base image has.
#
# It checks that every carried wheel's requirements are carried or on that host, that the
# working tree and both folders stay under 64 MiB, and prints the carry list and the
# command to run there.
#
#   bash bench/gpu_bundle.sh           # build both folders (pip and apt-get here), check, print
#   bash bench/gpu_bundle.sh --print   # only print the carry list and the command
#
# Build it on a Debian or Ubuntu host whose C library is no newer than the GPU host's
# (the .deb files come from this host's release). Exit status: 0 when it fits, 1 when
# something is missing or it does not fit, 2 for a bad option.
set -euo pipefail

usage() {
  echo "usage: bash bench/gpu_bundle.sh [--print]" >&2
}

cd "$(dirname "$0")/.."
PRINT_ONLY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --print) PRINT_ONLY=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_bundle: unknown option $1" >&2; usage; exit 2 ;;
  esac
  shift
done

ENGINE="mooncake-transfer-engine-cuda13==0.3.14"
# What kvroom imports at run time (with their own requirements) that the GPU host's image
# lacks; typing-extensions is there, but pydantic may want a newer one.
PACKAGES=(fastapi starlette uvicorn httptools pyzmq msgspec xxhash pydantic pydantic-core pydantic-settings
  python-dotenv annotated-types typing-inspection opentelemetry-api typing-extensions)
# The image's own packages that carried wheels require: pip takes them from there.
IMAGE_HAS="aiohttp requests msgpack anyio idna click h11 annotated-doc typing-extensions"
# Every Debian or Ubuntu base image has these (apt and python3 need them): never carried.
BASE_DEBS="libc6 libgcc-s1 libstdc++6 zlib1g libzstd1 libssl3 libffi8 libgnutls30 libnettle8
  libhogweed6 libgmp10 libp11-kit0 libtasn1-6 libidn2-0 libunistring2 libcom-err2"
LIMIT_MIB=64
RUN_DIR=/tmp/kvroom-run  # the check's logs, brought back as one archive
LIB_DIR=/tmp/kvroom-deb
# The check alone, so that installing and the check stay under six minutes.
CHECK_TIMEOUT_S=300
RUN_TIMEOUT_S=420

COMMAND="set -o pipefail; export TMPDIR=$RUN_DIR; mkdir -p $RUN_DIR $LIB_DIR"
COMMAND+="; python3 -m pip install -q --root-user-action=ignore --no-index --no-cache-dir"
COMMAND+=" --find-links .whl -r .whl/requirements.txt || exit 3"
COMMAND+="; for d in .deb/*.deb; do dpkg -x \$d $LIB_DIR || exit 3; done"
COMMAND+="; export LD_LIBRARY_PATH=$LIB_DIR/usr/lib/x86_64-linux-gnu:$LIB_DIR/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
COMMAND+="; timeout -k 10 $CHECK_TIMEOUT_S bash bench/gpu_check.sh --keep-logs 2>&1 | tee \$OUT/gpu_check.log"
COMMAND+="; rc=\$?; tar czf \$OUT/gpu_check_logs.tgz -C /tmp kvroom-run; exit \$rc"

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
bytes_of() { if [[ -d $1 ]]; then du -sb "$1" | cut -f1; else echo 0; fi; }

print_command() {
  echo "carry: [\".whl\", \".deb\"]"
  echo "timeout_s: $RUN_TIMEOUT_S"
  echo "command (${#COMMAND} characters):"
  echo "$COMMAND"
}

if [[ $PRINT_ONLY == 1 ]]; then
  print_command
  exit 0
fi

if [[ ! -x .venv/bin/python ]]; then
  echo "gpu_bundle: no .venv here: run 'bash setup.sh cpu,dev' first (the versions come from it)" >&2
  exit 1
fi
PY=.venv/bin/python

# 1. Wheels: the engine at its release for CUDA 13, the rest at the versions the tests run.
rm -rf .whl .deb
mkdir -p .whl .deb
pins=$("$PY" - "${PACKAGES[@]}" <<'PYTHON'
import importlib.metadata
import sys

print(" ".join(f"{name}=={importlib.metadata.version(name)}" for name in sys.argv[1:]))
PYTHON
)
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
# shellcheck disable=SC2086  # the pins are words
if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "$ENGINE" $pins >.whl/download.log 2>&1; then
  grep -v "is ignored: it is neither" .whl/download.log >&2
  exit 1
fi
rm .whl/download.log
for pin in "$ENGINE" $pins; do
  name=${pin%%==*}
  if ! compgen -G ".whl/$(tr - _ <<<"$name")-${pin##*==}-*.whl" >/dev/null; then
    echo "gpu_bundle: no wheel of $pin for Python 3.12" >&2
    exit 1
  fi
done
# What the GPU host installs: kvroom's own needs; pip takes their requirements from .whl/ or the image.
{
  echo "$ENGINE"
  tr ' ' '\n' <<<"$pins" | grep -E '^(fastapi|uvicorn|httptools|pyzmq|msgspec|xxhash|pydantic|pydantic-settings)=='
} >.whl/requirements.txt

# Every requirement of a carried wheel is carried (at a version it accepts) or in the image.
"$PY" - "$IMAGE_HAS" .whl/*.whl <<'PYTHON'
import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

image = {canonicalize_name(n) for n in sys.argv[1].split()}
wheels = {}
for path in sys.argv[2:]:
    name, version, _, _ = parse_wheel_filename(path.rsplit("/", 1)[-1])
    wheels[name] = (path, version)
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
missing = []
for name, (path, _) in sorted(wheels.items()):
    with zipfile.ZipFile(path) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        headers = Parser().parsestr(whl.read(meta).decode())
    for line in headers.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        dep = canonicalize_name(req.name)
        if dep in wheels and req.specifier.contains(wheels[dep][1], prereleases=True):
            continue
        if dep not in wheels and dep in image:
            continue
        missing.append(f"{name} needs {req}")
if missing:
    sys.exit("gpu_bundle: neither carried nor in the GPU host's image: " + "; ".join(missing))
PYTHON

# 2. System libraries: what the engine's library loads, less the base image's.
engine_dir=$(mktemp -d)
trap 'rm -rf "$engine_dir"' EXIT
"$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
  .whl/mooncake_transfer_engine_cuda13-*.whl "$engine_dir"
debs=()
unresolved=()
while read -r soname arrow path _; do
  [[ $arrow == "=>" ]] || continue
  case $soname in libcuda.so.* | libcudart.so.*) continue ;; esac  # the GPU host's driver and torch
  [[ $path == "$engine_dir"/* ]] && continue  # inside the wheel
  if [[ $path == not ]]; then unresolved+=("$soname"); continue; fi
  pkg=$(dpkg -S "$(readlink -f "$path")" 2>/dev/null || dpkg -S "$path" 2>/dev/null || true)
  pkg=${pkg%%:*}
  if [[ -z $pkg ]]; then unresolved+=("$soname"); continue; fi
  [[ " $(echo $BASE_DEBS) " == *" $pkg "* ]] || debs+=("$pkg")
done < <(ldd "$engine_dir/mooncake/engine.so")
if [[ ${#unresolved[@]} -gt 0 ]]; then
  echo "gpu_bundle: the engine loads ${unresolved[*]}, which no package here provides (apt-get install it here)" >&2
  exit 1
fi
mapfile -t debs < <(printf '%s\n' "${debs[@]}" | sort -u)
(cd .deb && apt-get download -qq "${debs[@]}" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
if [[ $(find .deb -type f -name '*.deb' | wc -l) -ne ${#debs[@]} ]]; then
  echo "gpu_bundle: apt-get downloaded $(find .deb -type f -name '*.deb' | wc -l) of ${#debs[@]}: ${debs[*]}" >&2
  exit 1
fi

# 3. Everything that travels: the tree (tracked and untracked files git does not ignore) and both folders.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null |
  awk '{ s += $1 } END { print s + 0 }')
whl=$(bytes_of .whl) deb=$(bytes_of .deb)
total=$((tree + whl + deb))
echo "wheels: $(ls .whl/*.whl | wc -l) in .whl ($(mib "$whl") MiB); requirements: $(paste -sd' ' .whl/requirements.txt)"
echo "debs: ${#debs[@]} in .deb ($(mib "$deb") MiB): ${debs[*]}"
echo "tree: $(mib "$tree") MiB; in all $(mib "$total") MiB of $LIMIT_MIB"
if ((total >= LIMIT_MIB * 1048576)); then
  echo "gpu_bundle: $(mib "$total") MiB does not fit in $LIMIT_MIB MiB" >&2
  exit 1
fi
print_command
