#!/usr/bin/env bash
# Set up, then run the demo: bootstrap, prefill and decode on 127.0.0.1 over TCP,
# a workload of rooms through POST /rooms, every output checked against a colocated run.
set -euo pipefail
cd "$(dirname "$0")"
bash setup.sh cpu
exec .venv/bin/python -m launcher.demo "$@"
