"""A PostgreSQL server of one's own, for the fault tests and ``make soak``: initdb into a folder,
started on a free loopback port, stopped, restarted, hung (SIGSTOP) and resumed at will.

Never the shared server: faults injected here touch nothing else. It uses the machine's
PostgreSQL binaries (``pg_ctl`` on PATH, or under /usr/lib/postgresql/*/bin). PostgreSQL refuses
to run as root; as root the cluster is created and run as the ``postgres`` system user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.launch import free_port

START_TIMEOUT_S = 60


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
        return str(candidate)
    raise FileNotFoundError(f"PostgreSQL's {name} is not installed on this machine")


def available() -> bool:
    """Whether this machine can run a private PostgreSQL server."""
    try:
        _binary("initdb")
        _binary("pg_ctl")
    except FileNotFoundError:
        return False
    return os.geteuid() != 0 or _system_user() is not None


def _system_user() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        return None


class PrivatePostgres:
    """One throw-away cluster. ``url`` reaches its database ``xmark`` as the superuser ``xmark``
    over TCP without a password (trust on loopback)."""

    def __init__(self, root: Path | None = None) -> None:
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="xmark-pg-")) if root is None else root
        self.data = self.root / "data"
        self.port = free_port()
        self._user = _system_user() if os.geteuid() == 0 else None
        self.url = f"postgresql+asyncpg://xmark@127.0.0.1:{self.port}/xmark"

    # -- processes ---------------------------------------------------------------------------

    def _run(self, *argv: str, timeout: float = START_TIMEOUT_S) -> None:
        command = list(argv)
        if self._user is not None:
            command = ["runuser", "-u", self._user.pw_name, "--", *command]
        subprocess.run(command, check=True, timeout=timeout, capture_output=True, cwd=self.root)

    def init(self) -> PrivatePostgres:
        if self._user is not None:
            os.chown(self.root, self._user.pw_uid, self._user.pw_gid)
        self._run(_binary("initdb"), "-D", str(self.data), "-U", "xmark", "--auth=trust", "-E", "UTF8", "--no-sync")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = ''\n"
                "fsync = off\nmax_connections = 100\n"
            )
        self.start()
        self._run(_binary("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "xmark", "xmark")
        return self

    def start(self) -> None:
        self._run(
            _binary("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"), "-w",
            "-t", str(START_TIMEOUT_S), "start",
        )  # fmt: skip

    def stop(self, mode: str = "immediate") -> None:
        """Stop the server (``immediate``: as a crash or a lost host would, connections reset)."""
        self._run(_binary("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def pids(self) -> list[int]:
        """The postmaster and every process it started."""
        pid_file = self.data / "postmaster.pid"
        if not pid_file.exists():
            return []
        postmaster = int(pid_file.read_text().split("\n", 1)[0])
        found = [postmaster]
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                if parent == postmaster:
                    found.append(int(entry.name))
        return found

    def hang(self) -> None:
        """Freeze every process of the server (SIGSTOP): connections stay open, nothing answers."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def close(self) -> None:
        """Stop the server (resumed first if hung) and delete its folder."""
        with contextlib.suppress(Exception):
            self.resume()
        with contextlib.suppress(Exception):
            self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            probe = subprocess.run(
                [_binary("pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "xmark", "-t", "1"],
                capture_output=True,
            )
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the private PostgreSQL server did not come up")
            time.sleep(0.1)


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A started private server with an empty database ``xmark``; removed on exit."""
    server = PrivatePostgres()
    try:
        server.init()
        yield server
    finally:
        server.close()
