#!/usr/bin/env bash
# The main job: set up, then train on 2 local CPU processes (extra arguments go to ddp.train).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m ddp.train "$@"
