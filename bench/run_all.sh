#!/usr/bin/env bash
# Run Kiwi's CPU-only benchmarks in turn; each prints the machine it ran on.
# Usage: bench/run_all.sh   (from anywhere; uses the repository's .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
for bench in core_events control_rtt daemon_idle; do
    echo "== bench/${bench}.py"
    "$PY" "bench/${bench}.py"
    echo
done
