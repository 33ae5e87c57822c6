"""The client matrix's live gateway and the rows' answers (tests/clients/harness.py has the rest).

* ``gateway`` (package) — one ``xmark serve`` process on a free loopback port: the real model on the
  local backend, a SQLite database of its own built by the migrations, and otherwise the product's
  defaults (the key pepper it generates in its own var folder, the default key version), but for the
  tests' fixed watermark secret, message IDs and salts drawn from seeded generators
  (tests/clients/seeded_serve.py: the answers start alike on every run), a batch large enough for
  every call of the matrix and bounds for a busy machine. An admin key is given to it at start-up;
  an auditor is made through the admin API.
* ``matrix`` (package) — at its first use, every selected row (a module with a ``CLIENT``) gets a user
  of its own and starts; once every row has built its client, all make their calls at once, so the
  gateway answers them in one batched generate call rather than one generation per call.
* ``row`` (module) — the row of the requesting module: its caller and answers, once they are in.

Both package fixtures end with the package's last test: the gateway and its model do not stay up
for the rest of the suite.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from benchmarks.launch import free_port
from service.db import upgrade_database
from service.security import generate_api_key
from tests.clients.harness import (
    CALL_TIMEOUT_S,
    REPO_ROOT,
    START_TIMEOUT_S,
    Answer,
    Auditor,
    Caller,
    ClientRow,
    RowAnswers,
    create_user,
)
from tests.conftest import SHARED_DATABASE_TIMEOUT_S, TEST_WATERMARK_SECRETS, checkpoint_path

# the model loads in the gateway process after it starts listening: on 2 busy cores, minutes; 5x
# margin and more: the gateway was ready 70 s after its start here, on two busy cores
GATEWAY_READY_TIMEOUT_S = 600.0
MAX_BATCH_ROWS = 16


@dataclass(frozen=True)
class LiveGateway:
    base_url: str
    admin_key: str
    auditor: Auditor
    log: Path

    def create_user(self, name: str) -> Caller:
        return create_user(self.base_url, self.admin_key, name)


def _log_tail(log: Path, chars: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _wait_ready(process: subprocess.Popen[bytes], base_url: str, log: Path) -> None:
    deadline = time.monotonic() + GATEWAY_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {process.returncode}:\n{_log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):  # not a bound: a probe that times out is retried
            if httpx.get(f"{base_url}/readyz", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"the gateway was not ready after {GATEWAY_READY_TIMEOUT_S:.0f} s:\n{_log_tail(log)}")


@pytest.fixture(scope="package")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    model_path = checkpoint_path()
    if not (model_path / "config.json").is_file():
        pytest.skip(f"no model checkpoint at {model_path} (run `make model`)")
    var_dir = tmp_path_factory.mktemp("clients-gateway")
    database_url = f"sqlite+aiosqlite:///{var_dir / 'gateway.db'}"
    upgrade_database(database_url)
    admin_key = generate_api_key().plaintext
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("XMARK_")}
    env.update(
        {
            "XMARK_DATABASE_URL": database_url,
            "XMARK_VAR_DIR": str(var_dir),
            "XMARK_MODEL_PATH": str(model_path),
            "XMARK_BOOTSTRAP_ADMIN_KEY": admin_key,
            # a fixed secret: with the launcher's seeded IDs and salts, answers that start alike every run
            "XMARK_WATERMARK_SECRETS": ",".join(f"{k}:{v}" for k, v in TEST_WATERMARK_SECRETS.items()),
            # every row's calls in one batched generate call, whatever their number (the local
            # backend starts a batch when the one before it ends), and bounds that hold while the
            # rest of the suite loads the 2 cores: the request deadline covers the wait for a batch
            "XMARK_MAX_BATCH_SIZE": str(MAX_BATCH_ROWS),
            "XMARK_REQUEST_TIMEOUT_S": str(CALL_TIMEOUT_S),
            "XMARK_DATABASE_TIMEOUT_S": str(SHARED_DATABASE_TIMEOUT_S),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    # the CLI through a launcher that seeds the message IDs and salts (tests/clients/seeded_serve.py)
    command = [sys.executable, "-m", "tests.clients.seeded_serve", "serve", "--host", "127.0.0.1", "--port", str(port)]
    log = var_dir / "gateway.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, base_url, log)
        auditor = create_user(base_url, admin_key, "client-matrix-auditor", "auditor")
        yield LiveGateway(base_url, admin_key, Auditor(base_url, auditor.api_key, admin_key), log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)  # not a bound: past it the gateway is killed
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@dataclass(frozen=True)
class RowRun:
    row: ClientRow
    caller: Caller
    answers: Future[dict[str, Answer]]


class Matrix:
    """Every selected row's calls, started at once; each row's answers are read when its tests ask."""

    def __init__(self, *, gateway: LiveGateway, rows: dict[str, ClientRow]) -> None:
        self.gateway = gateway
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(rows)), thread_name_prefix="client-row")
        self._ready = threading.Barrier(max(1, len(rows)))
        self._runs: dict[str, RowRun] = {}
        for module, row in rows.items():
            caller = gateway.create_user(f"client-{module.rsplit('.', 1)[-1].removeprefix('test_client_')}")
            self._runs[module] = RowRun(row, caller, self._pool.submit(row.run, caller, self._start))

    def _start(self) -> None:
        """Return once every row is ready to call (or has failed to be), or after START_TIMEOUT_S."""
        with contextlib.suppress(threading.BrokenBarrierError):
            self._ready.wait(timeout=START_TIMEOUT_S)

    def run_of(self, module: str) -> RowRun:
        return self._runs[module]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="package")
def matrix(request: pytest.FixtureRequest, gateway: LiveGateway) -> Iterator[Matrix]:
    rows: dict[str, ClientRow] = {}
    for item in request.session.items:
        module = getattr(item, "module", None)
        row = getattr(module, "CLIENT", None)
        if module is not None and isinstance(row, ClientRow):
            rows.setdefault(module.__name__, row)
    started = Matrix(gateway=gateway, rows=rows)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def row(request: pytest.FixtureRequest, matrix: Matrix) -> RowAnswers:
    run = matrix.run_of(request.module.__name__)
    answers = run.answers.result(timeout=CALL_TIMEOUT_S)  # 5x margin and more (see CALL_TIMEOUT_S)
    assert sorted(answers) == sorted(run.row.call_names), f"the row answered {sorted(answers)}"
    return RowAnswers(run.row, run.caller, answers, matrix.gateway.auditor)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``call`` takes the names of the calls of the module's row (its ``CLIENT``)."""
    row = getattr(metafunc.module, "CLIENT", None)
    if "call" in metafunc.fixturenames and isinstance(row, ClientRow):
        metafunc.parametrize("call", row.call_names)
