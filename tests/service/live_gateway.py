"""A gateway on a real port, configured as `xmark serve` configures it (``service.server``), with
the fake backend: in a thread of the test process, or as a process of its own (to measure it).

For the tests where the connection is the point: keep-alive, slow and hostile clients, faults.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from service.config import Settings
from tests.conftest import REPO_ROOT

# 5x margin and more (11x): a gateway served /healthz 0.9 to 3.9 s after ``live_app`` began here,
# and 8.1 to 10.4 s after ``environment_process`` did (a process of its own, on a loaded machine)
START_TIMEOUT_S = 120.0

# the child process of `gateway_process`: the app of the settings in its environment, on the fake
# backend, served with the options of `xmark serve`
_CHILD = """
import uvicorn
import service.resources
from service.app import configure_process_logging, create_app
from service.config import Settings
from service.server import server_options
from tests.fakes import FakeBackend

service.resources.build_backend = lambda settings, metrics: FakeBackend(settings.model_name)
settings = Settings()
configure_process_logging(settings)
uvicorn.run(create_app(settings), **server_options(settings, log_level="warning"))
"""


def _wait_ready(base_url: str, alive: Any) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if not alive():
            raise RuntimeError("the gateway exited during start-up")
        with contextlib.suppress(httpx.TransportError):  # (a probe that times out is sent again)
            if httpx.get(f"{base_url}/healthz", timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start in time")
        time.sleep(0.1)


@contextlib.contextmanager
def live_gateway(settings: Settings) -> Iterator[str]:
    """Serve ``settings`` (its host and port) in a thread; yields the base URL."""
    with live_app(settings) as (base_url, _):
        yield base_url


@contextlib.contextmanager
def live_app(settings: Settings) -> Iterator[tuple[str, Any]]:
    """Serve ``settings`` (its host and port) in a thread; yields the base URL and the app, started."""
    import service.resources
    from service.app import create_app
    from service.server import server_options
    from tests.fakes import FakeBackend

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service.resources, "build_backend", lambda s, metrics: FakeBackend(s.model_name))
        app = create_app(settings)
        server = uvicorn.Server(uvicorn.Config(app, **server_options(settings, log_level="warning", lifespan="on")))
        thread = threading.Thread(target=server.run, name="live-gateway", daemon=True)
        thread.start()
        base_url = f"http://{settings.host}:{settings.port}"
        try:
            _wait_ready(base_url, thread.is_alive)
            yield base_url, app
        finally:
            server.should_exit = True
            thread.join(timeout=30)  # 5x margin and more: it stopped in 0.2 s here


def settings_environment(settings: Settings) -> dict[str, str]:
    """The XMARK_* variables that reproduce ``settings`` in another process."""
    env: dict[str, str] = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        elif isinstance(value, list):
            value = ",".join(value)
        env[f"XMARK_{name.upper()}"] = str(value)
    return env


@contextlib.contextmanager
def gateway_process(settings: Settings, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Serve ``settings`` from a process of its own (stderr to ``log``); yields the process."""
    with environment_process(settings_environment(settings), f"http://{settings.host}:{settings.port}", log) as process:
        yield process


@contextlib.contextmanager
def environment_process(xmark_env: dict[str, str], base_url: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Serve the gateway (fake backend) configured by the XMARK_* variables ``xmark_env`` (only
    those: the caller's own XMARK_* are dropped) from a process of its own, answering at
    ``base_url``; stderr to ``log``. Yields the process once ``/healthz`` answers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XMARK_")}
    env.update(xmark_env)
    env["PYTHONPATH"] = str(REPO_ROOT)
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-c", _CHILD], cwd=REPO_ROOT, env=env, stderr=sink)
    try:
        _wait_ready(base_url, lambda: process.poll() is None)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)  # 5x margin and more: it stopped in 0.3 s here
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
