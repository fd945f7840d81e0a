"""Real servers started by the tests themselves: a PostgreSQL cluster and an MLflow
tracking server, both on loopback, stopped afterwards.

PostgreSQL comes from the system's binaries (Debian's ``postgresql`` package: ``initdb``,
``pg_ctl``); where they are missing, or the cluster cannot start, the tests that need it skip
with the reason. PostgreSQL refuses to run as root: as root the cluster is run by the user
``nobody`` (through ``runuser``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["MlflowServer", "PostgresCluster", "free_port", "mlflow_server", "postgres_cluster",
           "postgres_url", "wait_for_port"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, *, timeout_s: float, process: subprocess.Popen | None = None
                  ) -> bool:
    """Whether something listens on ``127.0.0.1:port`` within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            return False
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)
    return False


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _as_postgres_user(argv: list[str]) -> list[str]:
    """``argv`` run as an unprivileged user where this process is root."""
    if os.geteuid() != 0:
        return argv
    runuser = shutil.which("runuser")
    if runuser is None:
        pytest.skip("PostgreSQL refuses to run as root and runuser is not installed")
    return [runuser, "-u", "nobody", "--", *argv]


class PostgresCluster:
    """A PostgreSQL cluster in a temporary directory, on a free loopback port."""

    def __init__(self) -> None:
        pytest.importorskip("psycopg2", reason="the PostgreSQL driver psycopg2 is not "
                                               "installed (pip install 'paratune[postgres]')")
        self.initdb, self.pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if self.initdb is None or self.pg_ctl is None:
            pytest.skip("PostgreSQL's initdb/pg_ctl are not installed "
                        "(apt-get install postgresql)")
        self.root = Path(tempfile.mkdtemp(prefix="paratune-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.root, user="nobody")
        self.data, self.port = self.root / "data", free_port()

    @property
    def url(self) -> str:
        """``postgresql://paratune@127.0.0.1:PORT/paratune`` (trust authentication)."""
        return f"postgresql://paratune@127.0.0.1:{self.port}/paratune"

    def create(self) -> PostgresCluster:
        done = subprocess.run(_as_postgres_user([self.initdb, "-D", str(self.data), "-U",
                                                 "paratune", "--auth=trust", "-E", "UTF8"]),
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            self.remove()
            pytest.skip(f"initdb failed: {done.stderr.strip()[-300:]}")
        self.start()
        createdb = _pg_bin("createdb")
        for database in ("paratune", "tracking"):  # Optuna's and MLflow's (each its schema)
            subprocess.run([createdb, "-h", "127.0.0.1", "-p", str(self.port), "-U",
                            "paratune", database], check=True, capture_output=True, timeout=30)
        return self

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off")
        done = subprocess.run(_as_postgres_user([self.pg_ctl, "-D", str(self.data), "-o",
                                                 options, "-l", str(self.root / "log"), "-w",
                                                 "-t", "30", "start"]),
                              capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            log = (self.root / "log").read_text() if (self.root / "log").exists() else ""
            self.remove()
            pytest.skip(f"PostgreSQL did not start: {(log or done.stderr).strip()[-300:]}")

    def stop(self) -> None:
        """Stop the server at once (``pg_ctl stop -m immediate``: as a crash looks)."""
        subprocess.run(_as_postgres_user([self.pg_ctl, "-D", str(self.data), "-m",
                                          "immediate", "stop"]),
                       capture_output=True, timeout=60, check=False)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def _cluster() -> Iterator[PostgresCluster]:
    cluster = PostgresCluster()
    try:
        yield cluster.create()
    finally:
        cluster.stop()
        cluster.remove()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """``postgresql://paratune@127.0.0.1:PORT/paratune`` of a fresh cluster (trust auth on
    loopback; a second database ``tracking`` beside it for MLflow), stopped at the end of
    the session."""
    with _cluster() as cluster:
        yield cluster.url


@pytest.fixture
def postgres_cluster() -> Iterator[PostgresCluster]:
    """A cluster of the test's own, which it may stop (see :meth:`PostgresCluster.stop`)."""
    with _cluster() as cluster:
        yield cluster


class MlflowServer:
    """An ``mlflow server`` on ``127.0.0.1`` with a SQLite backend in ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, timeout_s: float = 240.0) -> MlflowServer:
        """Start (or restart, on the same port and store) and wait until it answers."""
        self.root.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("MLFLOW_TRACKING_URI", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
             str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--default-artifact-root", (self.root / "artifacts").as_uri()],
            stdout=subprocess.DEVNULL, stderr=open(self.root / "server.log", "ab"),  # noqa: SIM115
            env=env, start_new_session=True)
        if not wait_for_port(self.port, timeout_s=timeout_s, process=self.process):
            self.stop()
            pytest.skip("the MLflow server did not start: "
                        + (self.root / "server.log").read_text()[-300:])
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with (contextlib.suppress(OSError),
                  urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer):
                if answer.status == 200:
                    return
            time.sleep(0.2)
        pytest.skip("the MLflow server never answered /health")

    def stop(self) -> None:
        """Kill the server's whole process group (it forks workers)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and wait_for_port(self.port, timeout_s=0.1):
            time.sleep(0.1)


@pytest.fixture
def mlflow_server(tmp_path) -> Iterator[MlflowServer]:
    """A started :class:`MlflowServer`, stopped after the test."""
    server = MlflowServer(tmp_path / "mlflow-server")
    try:
        yield server.start()
    finally:
        server.stop()
