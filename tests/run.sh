#!/usr/bin/env bash
# The whole test suite, on a fresh machine: creates .venv, installs the package with the
# extras it tests and the test, lint and docs dependency groups, and fails fast: ruff,
# mypy, the server-free layer (`pytest tests/unit`, SQLite only) and the docs build run
# first, so that a mistake there stops the run within a couple of minutes. Only then does
# it start throwaway PostgreSQL, MariaDB, Redis and RabbitMQ servers (installing them with
# apt when missing and root; they export FENCED_PG_*, FENCED_MARIADB_*, FENCED_REDIS_URL,
# FENCED_RABBITMQ_URL), run the integration and acceptance layers and the version matrix's
# core (nox: every Python x Django), and stop the servers. Extra arguments go to the
# second pytest (the servers' layers), e.g. `bash tests/run.sh -k store`; the server-free
# layer still runs whole first, and the matrix then does not run.
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

echo "== ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
echo "== mypy --strict"
"$VENV/bin/mypy"
echo "== pytest tests/unit (server-free: SQLite only)"
# no FENCED_* server variable: the layer must not need one
env $(env | sed -n 's/^\(FENCED_[A-Z_]*\)=.*/-u \1/p') \
    "$VENV/bin/python" -m pytest tests/unit
echo "== docs (Sphinx, warnings as errors)"
DOCS_DIR=$(mktemp -d /tmp/celery-fenced-docs.XXXXXX)
"$VENV/bin/python" -m sphinx -W -q -b html docs "$DOCS_DIR"
rm -rf "$DOCS_DIR"

# the admin's browser tests drive Debian's chromium (installed with apt when missing)
"$VENV/bin/python" -m devtools.services chromium >/dev/null

RUN_DIR=$(mktemp -d /tmp/celery-fenced-services.XXXXXX)
trap '"$VENV/bin/python" -m devtools.services stop "$RUN_DIR"' EXIT
eval "$("$VENV/bin/python" -m devtools.services start "$RUN_DIR")"
export FENCED_RUN_DIR="$RUN_DIR"

echo "== pytest (SQLite, PostgreSQL on 127.0.0.1:$FENCED_PG_PORT, MariaDB on" \
    "127.0.0.1:$FENCED_MARIADB_PORT, Redis $FENCED_REDIS_URL, RabbitMQ $FENCED_RABBITMQ_URL)"
# tests/unit ran above; the slowest tests are listed at the end: where the 30 minutes go
status=0
"$VENV/bin/python" -m pytest --durations=25 --deselect tests/unit/ "$@" || status=$?
if [ "$#" -gt 0 ]; then
    # (5: nothing selected, when the extra arguments select only tests of tests/unit)
    [ "$status" -eq 0 ] || [ "$status" -eq 5 ] || exit "$status"
else
    [ "$status" -eq 0 ] || exit "$status"
    echo "== the version matrix's core: every Python x Django (noxfile.py)"
    "$VENV/bin/nox" --no-color
fi
