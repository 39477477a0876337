#!/usr/bin/env bash
# Set up (kvroom's virtualenv and vLLM's), then lint, type-check and run every test.
set -euo pipefail
cd "$(dirname "$0")"
bash setup.sh cpu,dev
bash setup.sh vllm
.venv/bin/ruff check .
.venv/bin/mypy
.venv-vllm/bin/mypy -p kvroom_vllm --follow-imports=silent
# The vLLM connector's own unit tests run where vLLM is installed; everything else (the real vLLM
# servers included, started as processes of .venv-vllm) from kvroom's virtualenv.
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/unit/vllm
exec .venv/bin/pytest "$@"
