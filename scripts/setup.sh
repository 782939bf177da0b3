#!/usr/bin/env bash
# Create .venv (if missing), install ringddp with its test extra, build its native kernel. The
# constraints file pins the CPU build of torch 2.13.0, so no multi-GB CUDA build is pulled in
# (pip fails loudly instead).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c scripts/constraints-cpu.txt -e '.[test]'
# the shm one-shot all-reduce's native kernel (gcc or $CC; without one the Python path runs, logged)
.venv/bin/python -c "from collectives.transport.shm import native; native.main()"
.venv/bin/python -c "import torch, collectives, ddp, data; assert torch.__version__.endswith('+cpu'), torch.__version__; print('ringddp ready: torch', torch.__version__)"
