#!/usr/bin/env bash
# The whole test suite, on a fresh machine: creates .venv, installs the package with the
# extras it tests and the test, lint and docs dependency groups, starts throwaway
# PostgreSQL, MariaDB, Redis and RabbitMQ servers (installing them with apt when missing and
# root; they export FENCED_PG_*, FENCED_MARIADB_*, FENCED_REDIS_URL, FENCED_RABBITMQ_URL), runs
# ruff, mypy, pytest and the version matrix's core (nox: every Python x Django), and
# stops the servers. Extra arguments go to pytest, e.g. `bash tests/run.sh -k store`
# (the matrix then does not run).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${FENCED_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# mysqlclient (the mysql extra) compiles against the MariaDB client library's headers
"$PYTHON" -m devtools.services headers
# dependency groups (PEP 735) need pip 25.1 or newer
"$VENV/bin/python" -m pip install -q --disable-pip-version-check 'pip>=25.1'
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    -e '.[postgres,redis,mysql,metrics]' --group test --group lint --group docs --group matrix

# the admin's browser tests drive Debian's chromium (installed with apt when missing)
"$VENV/bin/python" -m devtools.services chromium >/dev/null

RUN_DIR=$(mktemp -d /tmp/celery-fenced-services.XXXXXX)
trap '"$VENV/bin/python" -m devtools.services stop "$RUN_DIR"' EXIT
eval "$("$VENV/bin/python" -m devtools.services start "$RUN_DIR")"
export FENCED_RUN_DIR="$RUN_DIR"

echo "== ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
echo "== mypy --strict"
"$VENV/bin/mypy"
echo "== docs (Sphinx, warnings as errors)"
"$VENV/bin/python" -m sphinx -W -q -b html docs "$RUN_DIR/docs-html"
echo "== pytest (SQLite, PostgreSQL on 127.0.0.1:$FENCED_PG_PORT, MariaDB on" \
    "127.0.0.1:$FENCED_MARIADB_PORT, Redis $FENCED_REDIS_URL, RabbitMQ $FENCED_RABBITMQ_URL)"
# the slowest tests are listed at the end: where the 30 minutes go
"$VENV/bin/python" -m pytest --durations=25 "$@"
if [ "$#" -eq 0 ]; then
    echo "== the version matrix's core: every Python x Django (noxfile.py)"
    "$VENV/bin/nox" --no-color
fi
