#!/usr/bin/env bash
# Create .venv (if missing) and install ringddp with its test extra. torch is pinned to the CPU
# wheel 2.13.0 in pyproject.toml, so no multi-GB CUDA build is pulled in.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
.venv/bin/python -c "import torch, collectives, ddp, data; print('ringddp ready: torch', torch.__version__)"
