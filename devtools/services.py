"""Throwaway PostgreSQL, Redis and MariaDB servers for the test suite and the benchmarks.

``python -m devtools.services chromium`` installs Debian's chromium for the browser tests
(when missing and root) and prints its path.

``python -m devtools.services start DIR`` starts PostgreSQL, Redis and MariaDB on free
loopback ports with their data in ``DIR`` and prints ``export`` lines for the shell;
``stop DIR`` stops them. ``python -m devtools.services headers`` installs the MariaDB
client headers that ``pip install mysqlclient`` compiles against (when missing and root).
PostgreSQL refuses to run as root, so as root it runs as the ``postgres`` user: its
commands run from ``/`` (that user may not enter the caller's working directory), and the
data folder's parents are made traversable for it (search only, ``o+x``: a ``mkdtemp``
folder is ``0700``). Missing binaries are installed with apt when running as root.

Why not pytest-postgresql / pytest-redis: their servers are pytest fixtures, started as the
current user (``initdb`` refuses root, and CI runs as root; their ``user`` option is the
database role, not the OS user), while the chaos runner and the benchmarks run outside
pytest, the worker processes the tests start need the server's address before any fixture,
and the chaos runner restarts PostgreSQL mid-run with the server's own options.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _apt_install(package: str) -> None:
    if os.geteuid() != 0:
        sys.exit(f"{package} is not installed and this is not root: install it first")
    print(f"# installing {package} with apt-get", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", package]):
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        if run.returncode != 0:  # apt's output only when it failed
            sys.exit(f"{' '.join(command)} failed ({run.returncode}):\n{run.stdout}{run.stderr}")
    print(f"# installed {package}", file=sys.stderr)


def pg_bindir() -> Path:
    for _ in range(2):
        found = sorted(
            glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4])
        )
        if found:
            return Path(found[-1]).parent
        _apt_install("postgresql")
    sys.exit("PostgreSQL binaries not found after installing postgresql")


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        _apt_install("redis-server")
        path = shutil.which("redis-server")
    if path is None:
        sys.exit("redis-server not found after installing it")
    return path


CHROMIUM = "/usr/bin/chromium"


def chromium_binary() -> str:
    """Debian's chromium for the browser tests (Playwright never downloads a browser)."""
    if not os.path.exists(CHROMIUM):
        _apt_install("chromium")
    if not os.path.exists(CHROMIUM):
        sys.exit(f"{CHROMIUM} not found after installing chromium")
    return CHROMIUM


def _as_postgres(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


def run_as_postgres(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """Run a PostgreSQL command as the server's owner, from ``/``.

    As root the command runs as ``postgres``, which may not be able to enter the caller's
    working directory (``could not change directory to "…": Permission denied``).
    """
    return subprocess.run(_as_postgres(cmd), cwd="/", **kwargs)


def reachable_by_postgres(folder: Path) -> None:
    """As root, let the ``postgres`` user reach ``folder``: give each ancestor that lacks
    it the search permission for others (``o+x``; nothing becomes listable or writable)."""
    if os.geteuid() != 0:
        return
    for part in [folder, *folder.parents]:
        mode = stat.S_IMODE(part.stat().st_mode)
        if not mode & stat.S_IXOTH:
            part.chmod(mode | stat.S_IXOTH)


def _wait_port(port: int, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{what} did not listen on port {port} within {timeout:.0f}s")


def start_postgres(base: Path, extra_options: str = "") -> dict[str, str]:
    """Start PostgreSQL with its data in ``base``; ``extra_options`` are added to its ``-o``.

    The benchmarks pass ``-c shared_preload_libraries=pg_stat_statements`` there.
    """
    bindir = pg_bindir()
    data = base / "pgdata"
    port = free_port()
    if os.geteuid() == 0:
        shutil.chown(base, "postgres")
        reachable_by_postgres(base)
    run_as_postgres(
        [
            str(bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    options = (
        f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off "
        "-c synchronous_commit=off -c full_page_writes=off -c max_connections=300"
    )
    if extra_options:
        options = f"{options} {extra_options}"
    run_as_postgres(
        [
            str(bindir / "pg_ctl"),
            "-D",
            str(data),
            "-o",
            options,
            "-l",
            str(base / "postgres.log"),
            "-w",
            "start",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    _wait_port(port, "PostgreSQL")
    return {
        "FENCED_PG_HOST": "127.0.0.1",
        "FENCED_PG_PORT": str(port),
        "FENCED_PG_USER": "postgres",
        "FENCED_PG_DATA": str(data),
        "FENCED_PG_BINDIR": str(bindir),
        "FENCED_PG_OPTIONS": options,
    }


MARIADB_USER = "fenced"
MARIADB_PASSWORD = "fenced"


MARIADB_PROGRAMS = ("mariadbd", "mariadb-install-db", "mariadb")


def mariadb_binaries() -> tuple[str, str, str]:
    """Debian's MariaDB server: ``mariadbd``, ``mariadb-install-db`` and the client
    (installed with apt when missing and root). The headers ``mysqlclient`` builds against
    are :func:`mariadb_client_headers`' (the test command installs them before pip)."""
    found = [shutil.which(n, path="/usr/sbin:/usr/bin") for n in MARIADB_PROGRAMS]
    if None in found:
        _apt_install("mariadb-server")
        found = [shutil.which(n, path="/usr/sbin:/usr/bin") for n in MARIADB_PROGRAMS]
    if None in found:
        sys.exit("mariadbd not found after installing mariadb-server")
    server, install_db, client = (str(path) for path in found)
    return server, install_db, client


def mariadb_client_headers() -> None:
    """The MariaDB client library's headers, which ``pip install mysqlclient`` compiles
    against (``mariadb_config``, from Debian's ``libmariadb-dev``)."""
    if shutil.which("mariadb_config") is None:
        _apt_install("libmariadb-dev")
    if shutil.which("pkg-config") is None:  # how mysqlclient's build finds the library
        _apt_install("pkg-config")


def start_mariadb(base: Path) -> dict[str, str]:
    """MariaDB on a free loopback port with its data in ``base/mariadb``, a user with
    every privilege (the tests create their database, ``utf8mb4`` with its default
    collation ``utf8mb4_general_ci``: the package must compare keys byte for byte
    itself)."""
    server, install_db, client = mariadb_binaries()
    home = base / "mariadb"  # the server's files: its data, socket, pid file and log
    data = home / "data"
    data.mkdir(parents=True)
    socket_path = home / "mariadb.sock"
    user = "mysql" if os.geteuid() == 0 else os.environ.get("USER", "")
    if os.geteuid() == 0:
        for folder in (home, data):
            shutil.chown(folder, "mysql")
        reachable_by_postgres(base)  # the search permission (for the mysql user too)
    subprocess.run(
        [
            install_db,
            f"--datadir={data}",
            f"--user={user}",
            "--auth-root-authentication-method=socket",
            "--skip-test-db",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    port = free_port()
    subprocess.Popen(
        [
            server,
            "--no-defaults",
            f"--datadir={data}",
            f"--user={user}",
            f"--port={port}",
            "--bind-address=127.0.0.1",
            f"--socket={socket_path}",
            f"--pid-file={home / 'mariadb.pid'}",
            f"--log-error={home / 'mariadb.log'}",
            "--max-connections=300",
            "--innodb-flush-log-at-trx-commit=0",
            "--innodb-doublewrite=0",
            "--skip-log-bin",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _wait_port(port, "MariaDB", timeout=60)
    grant = (
        f"CREATE USER '{MARIADB_USER}'@'127.0.0.1' IDENTIFIED BY '{MARIADB_PASSWORD}'; "
        f"GRANT ALL PRIVILEGES ON *.* TO '{MARIADB_USER}'@'127.0.0.1' WITH GRANT OPTION;"
    )
    subprocess.run([client, f"--socket={socket_path}", "-uroot", "-e", grant], check=True, cwd="/")
    return {
        "FENCED_MARIADB_HOST": "127.0.0.1",
        "FENCED_MARIADB_PORT": str(port),
        "FENCED_MARIADB_USER": MARIADB_USER,
        "FENCED_MARIADB_PASSWORD": MARIADB_PASSWORD,
    }


def start_redis(base: Path, port: int | None = None) -> dict[str, str]:
    """Redis on ``port`` (default: a free one), no persistence: a restart starts empty."""
    port = free_port() if port is None else port
    subprocess.run(
        [
            redis_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "yes",
            "--dir",
            str(base),
            "--pidfile",
            str(base / "redis.pid"),
            "--logfile",
            str(base / "redis.log"),
        ],
        check=True,
    )
    _wait_port(port, "Redis")
    return {"FENCED_REDIS_URL": f"redis://127.0.0.1:{port}/0"}


def restart_redis_empty(url: str, base: Path, down_for: float = 0.0) -> None:
    """Stop the Redis at ``url`` without saving, wait ``down_for`` seconds, start it again
    on the same port (``base``: its folder): every message it held is gone."""
    import redis

    client = redis.Redis.from_url(url)
    with contextlib.suppress(redis.exceptions.ConnectionError):
        client.shutdown(nosave=True)
    client.close()
    port = int(url.split(":")[2].split("/")[0])
    deadline = time.monotonic() + 30
    while _port_open(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"Redis on port {port} did not stop")
        time.sleep(0.05)
    time.sleep(down_for)
    start_redis(base, port)


def _port_open(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def stop(base: Path) -> None:
    data = base / "pgdata"
    if data.exists():
        run_as_postgres(
            [str(pg_bindir() / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
    for pidfile in (base / "redis.pid", base / "mariadb" / "mariadb.pid"):
        if pidfile.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pidfile.read_text().strip()), 15)
    mariadb_pid = base / "mariadb" / "mariadb.pid"
    deadline = time.monotonic() + 30
    while mariadb_pid.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # it removes its pid file once stopped
    shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str]) -> None:
    if argv == ["chromium"]:
        print(chromium_binary())
        return
    if argv == ["headers"]:
        mariadb_client_headers()
        return
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        sys.exit("usage: python -m devtools.services start|stop DIR, chromium or headers")
    base = Path(argv[1]).resolve()
    if argv[0] == "stop":
        stop(base)
        return
    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o755)
    env = {**start_postgres(base), **start_redis(base), **start_mariadb(base)}
    for name, value in env.items():
        print(f"export {name}='{value}'")


if __name__ == "__main__":
    main(sys.argv[1:])
