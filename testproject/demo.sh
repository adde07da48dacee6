#!/usr/bin/env bash
# The live demo of celery-fenced: a stalled worker fenced out, with real Celery workers on
# SQLite and the filesystem broker (nothing else to install or start).
#
#   bash testproject/demo.sh          # run the example (exit code 0 when every step happened)
#   bash testproject/demo.sh admin    # then browse its database in Django's admin (a held
#                                     # lease to force-release, the takeover's timeline, events)
#
# Creates .venv in the repository root on first use and installs the package into it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)

python=""
for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 \
        && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        python=$candidate
        break
    fi
done
if [ -z "$python" ]; then
    echo "demo.sh: needs python3.11 (or a python3 >= 3.10) on PATH" >&2
    exit 2
fi

if [ ! -x .venv/bin/python ]; then
    echo "demo.sh: creating .venv with $("$python" --version)"
    "$python" -m venv .venv
fi
# (re)install when the package is missing or pyproject.toml changed since the last install
stamp=.venv/.celery-fenced-demo-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
    || ! .venv/bin/python -c 'import celery_fenced, django_celery_results, prometheus_client' \
        2>/dev/null; then
    echo "demo.sh: installing celery-fenced into .venv (pip install -e '.[metrics]')"
    .venv/bin/python -m pip install -q -e '.[metrics]'
    touch "$stamp"
fi

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m testproject.demo_run "$@"
