"""Throwaway PostgreSQL, Redis, MariaDB and RabbitMQ servers for the test suite and the
benchmarks.

``python -m devtools.services chromium`` installs Debian's chromium for the browser tests
(when missing and root) and prints its path.

``python -m devtools.services start DIR`` starts PostgreSQL, Redis, MariaDB and RabbitMQ
on free loopback ports with their data in ``DIR`` and prints ``export`` lines for the shell;
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
import json
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


RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
#: RabbitMQ's own default, written out: how long a consumer may hold a delivery
#: unacknowledged before the broker closes its channel and requeues it (ms). Tests shorten
#: it for their own workers with :func:`set_consumer_timeout`.
RABBITMQ_CONSUMER_TIMEOUT_MS = 1_800_000


def rabbitmq_scripts() -> tuple[str, str]:
    """Debian's ``rabbitmq-server`` and ``rabbitmqctl`` scripts (installed with apt when
    missing and root).

    Not ``/usr/sbin``'s wrappers: those switch to the ``rabbitmq`` user and its home, where
    the system node's Erlang cookie is, and a throwaway node has its own.
    """
    server, ctl = RABBITMQ_BIN / "rabbitmq-server", RABBITMQ_BIN / "rabbitmqctl"
    if not server.exists():
        system_node_was_up = _port_open(5672)
        _apt_install("rabbitmq-server")
        if not system_node_was_up:
            _stop_system_rabbitmq()
    if not server.exists():
        sys.exit(f"{server} not found after installing rabbitmq-server")
    return str(server), str(ctl)


def _stop_system_rabbitmq() -> None:
    """Debian's postinst starts the system node unless ``policy-rc.d`` forbids it (as it
    does in containers): stop it and keep it from starting at boot, so that no node is left
    on the fixed ports (5672, 25672, epmd's 4369)."""
    if not _port_open(5672):
        return
    print("# stopping the system rabbitmq-server the package started", file=sys.stderr)
    for command in (
        ["service", "rabbitmq-server", "stop"],
        ["update-rc.d", "rabbitmq-server", "disable"],
        ["epmd", "-kill"],  # the system node's, on 4369
    ):
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def _rabbitmq_env(home: Path) -> dict[str, str]:
    """The environment of the node in ``home`` and of ``rabbitmqctl`` talking to it."""
    node = json.loads((home / "node.json").read_text())
    return {
        **os.environ,
        "HOME": str(home),  # the node's own Erlang cookie, made at its first start
        "RABBITMQ_CONF_ENV_FILE": str(home / "rabbitmq-env.conf"),  # not /etc's
        "RABBITMQ_NODENAME": node["name"],
        "ERL_EPMD_PORT": str(node["epmd_port"]),
        "ERL_EPMD_ADDRESS": "127.0.0.1",
        # the CLI's own distribution port (by default from a fixed range, 35672-35682)
        "RABBITMQ_CTL_DIST_PORT_MIN": str(node["ctl_port"]),
        "RABBITMQ_CTL_DIST_PORT_MAX": str(node["ctl_port"]),
    }


def spawn_rabbitmq(base: Path) -> dict[str, str]:
    """Start a RabbitMQ node in ``base/rabbitmq`` as on a fresh machine, without waiting.

    Its own database, logs, config and Erlang cookie there; a unique node name
    (``rabbit-PORT@localhost``), free ports for AMQP, Erlang distribution and its own epmd,
    all on loopback; no plugins. ``consumer_timeout`` is RabbitMQ's default (30 min), and
    the broker evaluates it every second instead of every minute
    (``channel_tick_interval``) so a test's shorter one is enforced promptly.
    :func:`wait_rabbitmq` waits until it accepts AMQP connections.
    """
    server, _ = rabbitmq_scripts()
    home = base / "rabbitmq"
    home.mkdir(parents=True)
    port, dist_port, epmd_port, ctl_port = (free_port() for _ in range(4))
    node = {
        "name": f"rabbit-{port}@localhost",
        "port": port,
        "epmd_port": epmd_port,
        "ctl_port": ctl_port,
    }
    (home / "node.json").write_text(json.dumps(node))
    (home / "rabbitmq-env.conf").write_text("")
    (home / "enabled_plugins").write_text("[].\n")
    (home / "rabbitmq.conf").write_text(
        f"listeners.tcp.default = 127.0.0.1:{port}\n"
        f"consumer_timeout = {RABBITMQ_CONSUMER_TIMEOUT_MS}\n"
    )
    (home / "advanced.config").write_text("[{rabbit, [{channel_tick_interval, 1000}]}].\n")
    env = {
        **_rabbitmq_env(home),
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_NODE_PORT": str(port),
        "RABBITMQ_DIST_PORT": str(dist_port),
        "RABBITMQ_MNESIA_BASE": str(home / "mnesia"),
        "RABBITMQ_LOG_BASE": str(home / "log"),
        "RABBITMQ_PLUGINS_EXPAND_DIR": str(home / "plugins-expand"),
        "RABBITMQ_CONFIG_FILE": str(home / "rabbitmq.conf"),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(home / "advanced.config"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(home / "enabled_plugins"),
        "RABBITMQ_PID_FILE": str(home / "rabbitmq.pid"),
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
    }
    with open(home / "server.out", "wb") as out:
        process = subprocess.Popen(
            [server],
            env=env,
            cwd=home,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (home / "beam.pid").write_text(str(process.pid))  # the script execs erl: the node
    return {
        "FENCED_RABBITMQ_URL": f"amqp://guest:guest@127.0.0.1:{port}//",
        "FENCED_RABBITMQ_DIR": str(home),
    }


def wait_rabbitmq(env: dict[str, str], timeout: float = 60.0) -> None:
    """Wait until the node of :func:`spawn_rabbitmq` completes an AMQP handshake."""
    import amqp

    home = Path(env["FENCED_RABBITMQ_DIR"])
    port = json.loads((home / "node.json").read_text())["port"]
    pid = int((home / "beam.pid").read_text())
    deadline = time.monotonic() + timeout
    while True:
        connection = amqp.Connection(f"127.0.0.1:{port}", connect_timeout=1)
        try:
            connection.connect()
            connection.close()
            return
        except (OSError, amqp.exceptions.AMQPError):
            pass
        if not _alive(pid) or time.monotonic() > deadline:
            log = (home / "server.out").read_text(errors="replace")[-3000:]
            sys.exit(f"RabbitMQ did not accept AMQP connections on port {port}:\n{log}")
        time.sleep(0.1)


def start_rabbitmq(base: Path) -> dict[str, str]:
    """A throwaway RabbitMQ node (:func:`spawn_rabbitmq`), ready for AMQP connections."""
    env = spawn_rabbitmq(base)
    wait_rabbitmq(env)
    return env


def rabbitmqctl(home: str | Path, *args: str) -> str:
    """Run ``rabbitmqctl`` against the node in ``home`` (``FENCED_RABBITMQ_DIR``)."""
    home = Path(home)
    _, ctl = rabbitmq_scripts()
    node = json.loads((home / "node.json").read_text())["name"]
    run = subprocess.run(
        [ctl, "-n", node, *args], env=_rabbitmq_env(home), capture_output=True, text=True
    )
    if run.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed:\n{run.stdout}{run.stderr}")
    return run.stdout


def set_consumer_timeout(home: str | Path, milliseconds: int) -> None:
    """Set the node's ``consumer_timeout``: channels opened from now on use it."""
    rabbitmqctl(home, "eval", f"application:set_env(rabbit, consumer_timeout, {milliseconds}).")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_rabbitmq(home: Path) -> None:
    """Stop the node in ``home`` (SIGTERM: a clean shutdown; SIGKILL after 30 s), then
    its epmd."""
    if not (home / "beam.pid").exists():
        return
    pid = int((home / "beam.pid").read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 15)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)
    subprocess.run(
        ["epmd", "-kill"],
        env=_rabbitmq_env(home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )


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
    stop_rabbitmq(base / "rabbitmq")
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
    try:
        rabbitmq = spawn_rabbitmq(base)  # it boots (~7 s) while the others start
        env = {**start_postgres(base), **start_redis(base), **start_mariadb(base), **rabbitmq}
        wait_rabbitmq(rabbitmq)
    except BaseException:  # one failed (sys.exit included): stop those already running
        stop(base)
        raise
    for name, value in env.items():
        print(f"export {name}='{value}'")


if __name__ == "__main__":
    main(sys.argv[1:])
