#!/usr/bin/env bash
# Set up, then lint, type-check and run every test (unit, integration, fault).
set -euo pipefail
cd "$(dirname "$0")"
bash setup.sh cpu,dev
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/pytest "$@"
