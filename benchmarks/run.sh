#!/usr/bin/env bash
# The benchmarks, on a fresh machine: creates .venv (like tests/run.sh), installs the package
# with the extras postgres and redis and the bench dependency group, then
# `python -m benchmarks`, which starts throwaway PostgreSQL and Redis servers (installing
# them with apt when missing and root), runs every benchmark, prints one table, writes it
# into docs/benchmarks.md (+ docs/benchmarks.svg) and stops the servers. 5-7 minutes on
# 2 cores; `bash benchmarks/run.sh --quick` takes about 2.
# Arguments go to `python -m benchmarks` (--quick, --smoke, --only ROW, --no-write, --json).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${FENCED_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# dependency groups (PEP 735) need pip 25.1 or newer
"$VENV/bin/python" -m pip install -q --disable-pip-version-check 'pip>=25.1'
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    -e '.[postgres,redis]' --group bench
exec "$VENV/bin/python" -m benchmarks "$@"
