"""Real processes for the vLLM end-to-end test: a ``vllm serve`` worker and an ``xmark serve`` gateway.

Both run on loopback ports chosen at start-up. The worker is the CPU engine (V1 runner) with
the XMark processor loaded through ``--logits-processors``; the gateway runs with
``XMARK_BACKEND=vllm`` against the PostgreSQL test database built by the migrations. Both use
the test suite's watermark secrets. Every process is started in its own session and killed by
its process-group id when the fixture ends, whatever happened. Nothing here imports vLLM, so
this file loads (and the tests skip) in an interpreter without it.

A gateway draws its users' message IDs from a seeded generator (``SEEDED_SERVE``: the product's
allocation rule, ``allocate_message``, given a ``random.Random`` instead of system randomness), so
the registry every /trace scores against is the same for the same tests: the verdict on a fixed
unwatermarked text (test_vllm_e2e) is then fixed too, not a draw over random IDs.

Statistical outcomes: the answers the tests trace to their authors are sampled unseeded (under the
distortion-free scheme a seed also picks the answer's salt; elsewhere seeding them is left to a
run that checks each seeded text), so each naming is a draw. The forensic
evaluation names 98-100 % of single 150-300 token answers among 10,000 IDs, a bar near 1e-7 per
text (docs/results/FORENSIC.md, FORENSIC-GUMBEL8S16.md); the tests trace at least that much text
among a few dozen IDs, so a miss is far rarer, but its rate is not established below 1e-6.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from benchmarks.launch import MODEL_NAME, free_port, vllm_serve_command
from service.config import Settings
from service.random_model import TEST_MODEL_NAME
from service.security import generate_api_key

REPO_ROOT = Path(__file__).absolute().parents[2]
# 5x margin and more: a CPU vLLM worker takes about 40-100 s to start here, 142 s on two cores
# busy with other test runs
WORKER_START_TIMEOUT_S = 900.0
# 5x margin and more: an `xmark serve` gateway (XMARK_BACKEND=vllm) was ready 34 s after its start
# here, on two cores busy with an evaluation run (was 180 s: barely 5x)
GATEWAY_START_TIMEOUT_S = 300.0


MESSAGE_ID_SEED = 20240607
# ``python -c SEEDED_SERVE SEED serve ...``: ``xmark serve`` (service.cli) with seeded message IDs
SEEDED_SERVE = """
import random, sys
import service.services.users
from xmark_core import allocate_message
rng = random.Random(int(sys.argv[1]))
service.services.users.allocate_message = lambda existing, params: allocate_message(existing, params, rng=rng)
from service.cli import main
raise SystemExit(main(sys.argv[2:]))
"""

# The scheme the e2e tests describe unless they say otherwise: the biasing one. The gumbel fixtures
# set no watermark parameter at all: they run the product's defaults.
BIASING_ENV = {"XMARK_WATERMARK_SCHEME": "xmark"}


def _base_environment(*, defaults: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XMARK_")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    if not defaults:
        env.update(BIASING_ENV)
    return env


class ManagedProcess:
    """A child process in its own session, so that it and everything it spawns stop together."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path, health_url: str) -> None:
        self.name = name
        self.command = command
        self.env = env
        self.log = log
        self.health_url = health_url
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, f"{self.name} is already running"
        with self.log.open("ab") as handle:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                cwd=REPO_ROOT,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                # not a bound: a probe that times out is retried until the deadline
                if httpx.get(self.health_url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} was not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, as far as the gateway can tell)."""
        self._signal_group(signal.SIGKILL)

    def stop(self) -> None:
        self._signal_group(signal.SIGTERM)
        if self.process is not None and self.process.poll() is None:
            self._signal_group(signal.SIGKILL)

    def _signal_group(self, signum: int) -> None:
        process = self.process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        try:
            # 5x margin and more: a signalled gateway or worker exits within a few seconds here
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            if signum != signal.SIGKILL:
                return
            raise
        # engine processes outlive the server for a moment after SIGKILL: wait for the group (not
        # a bound: past the deadline the fixture goes on)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass(frozen=True)
class E2EConfig:
    database_url: str
    watermark_secrets: str
    api_key_pepper: str
    model_path: Path
    admin_key: str


@pytest.fixture(scope="session")
def e2e_config(settings: Settings, migrated_database: str) -> E2EConfig:
    model_path = settings.resolved_model_path()
    if not (model_path / "config.json").is_file():
        pytest.skip(f"no model checkpoint at {model_path} (run `make model`)")
    assert settings.watermark_secrets is not None and settings.api_key_pepper is not None
    return E2EConfig(
        database_url=migrated_database,
        watermark_secrets=settings.watermark_secrets.get_secret_value(),
        api_key_pepper=settings.api_key_pepper.get_secret_value(),
        model_path=model_path,
        admin_key=generate_api_key().plaintext,
    )


def _worker(
    e2e_config: E2EConfig, model_path: Path, served_name: str, log_dir: Path, *, defaults: bool = False
) -> Iterator[ManagedProcess]:
    port = free_port()
    env = _base_environment(defaults=defaults)
    env.update(
        {
            "XMARK_WATERMARK_SECRETS": e2e_config.watermark_secrets,
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }
    )
    command = vllm_serve_command(model_path, port, max_num_seqs=8, served_model_name=served_name)
    worker = ManagedProcess(
        f"vllm worker ({served_name})", command, env, log_dir / "worker.log", f"http://127.0.0.1:{port}/health"
    )
    worker.start()
    try:
        worker.wait_healthy(WORKER_START_TIMEOUT_S)
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="session")
def vllm_worker(e2e_config: E2EConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    yield from _worker(e2e_config, e2e_config.model_path, MODEL_NAME, tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="session")
def test_model_worker(e2e_config: E2EConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """A second worker, serving the test model (a tokenizer of its own; `make model` builds it)."""
    path = REPO_ROOT / "var" / "models" / TEST_MODEL_NAME
    if not (path / "config.json").is_file():
        pytest.skip(f"no test model at {path} (run `make model`)")
    yield from _worker(e2e_config, path, TEST_MODEL_NAME, tmp_path_factory.mktemp("vllm-test-model"))


def _gateway(env_update: dict[str, str], var_dir: Path, *, defaults: bool = False) -> Iterator[ManagedProcess]:
    port = free_port()
    env = _base_environment(defaults=defaults)
    env.update(env_update)
    env["XMARK_VAR_DIR"] = str(var_dir)
    command = [sys.executable, "-c", SEEDED_SERVE, str(MESSAGE_ID_SEED), "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port)]
    process = ManagedProcess("gateway", command, env, var_dir / "gateway.log", f"http://127.0.0.1:{port}/readyz")
    process.start()
    try:
        process.wait_healthy(GATEWAY_START_TIMEOUT_S)
        yield process
    finally:
        process.stop()


def _gateway_settings(e2e_config: E2EConfig) -> dict[str, str]:
    return {
        "XMARK_DATABASE_URL": e2e_config.database_url,
        "XMARK_BACKEND": "vllm",
        "XMARK_VLLM_HEALTH_INTERVAL_S": "1",
        # the gateway's bound on each wait for a worker's bytes; 5x margin and more: a CPU worker's
        # first token under the tests' batches of up to four requests comes within seconds
        "XMARK_VLLM_TIMEOUT_S": "120",
        "XMARK_WATERMARK_SECRETS": e2e_config.watermark_secrets,
        "XMARK_API_KEY_PEPPER": e2e_config.api_key_pepper,
        "XMARK_BOOTSTRAP_ADMIN_KEY": e2e_config.admin_key,
        "XMARK_RETAIN_COMPLETIONS": "true",
        # the pass-through tests read log-probabilities (off by default)
        "XMARK_ALLOW_LOGPROBS": "true",
    }


@pytest.fixture(scope="session")
def fleet_gateway(
    e2e_config: E2EConfig,
    vllm_worker: ManagedProcess,
    test_model_worker: ManagedProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ManagedProcess]:
    """A gateway serving both workers' models from a models file (one vLLM worker per model)."""
    var_dir = tmp_path_factory.mktemp("fleet-gateway-var")
    models = var_dir / "models.toml"
    models.write_text(
        f"""
[[models]]
name = "{MODEL_NAME}"
backend = "vllm"
urls = ["{vllm_worker.health_url.removesuffix("/health")}"]
path = "{e2e_config.model_path}"

[[models]]
name = "{TEST_MODEL_NAME}"
backend = "vllm"
urls = ["{test_model_worker.health_url.removesuffix("/health")}"]
path = "{REPO_ROOT / "var" / "models" / TEST_MODEL_NAME}"
"""
    )
    for process in _gateway({**_gateway_settings(e2e_config), "XMARK_MODELS_FILE": str(models)}, var_dir):
        # ready once any model is; the tests want both
        deadline = time.monotonic() + GATEWAY_START_TIMEOUT_S
        # 5x margin and more: a /readyz took 0.14 s at most here
        while set(httpx.get(process.health_url, timeout=5.0).json()["models"].values()) != {"ready"}:
            assert time.monotonic() < deadline, f"a model never became ready:\n{process.log_tail()}"
            time.sleep(0.5)
        yield process


@pytest.fixture(scope="session")
def gateway(
    e2e_config: E2EConfig, vllm_worker: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    settings = {
        **_gateway_settings(e2e_config),
        "XMARK_VLLM_URLS": vllm_worker.health_url.removesuffix("/health"),
        "XMARK_MODEL_PATH": str(e2e_config.model_path),
        "XMARK_MODEL_NAME": MODEL_NAME,
    }
    yield from _gateway(settings, tmp_path_factory.mktemp("gateway-var"))


# the default watermark parameters (configured scheme auto: each key version's distortion-free primary
# in 8-bit blocks with 16 salts, and its biasing companion), for a worker and its gateway alike
@pytest.fixture(scope="session")
def gumbel_worker(e2e_config: E2EConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """A worker on the default watermark parameters: its processor samples with each version's
    distortion-free primary key, and biases with its companion where a request selects it."""
    log_dir = tmp_path_factory.mktemp("vllm-gumbel")
    yield from _worker(e2e_config, e2e_config.model_path, MODEL_NAME, log_dir, defaults=True)


@pytest.fixture(scope="session")
def gumbel_gateway(
    e2e_config: E2EConfig, gumbel_worker: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    """A gateway on the default watermark parameters (distortion-free key versions), in front of the
    gumbel worker; a database of its own (SQLite: the shared one holds the biasing versions of the
    same names)."""
    from service.db import upgrade_database

    var_dir = tmp_path_factory.mktemp("gumbel-gateway-var")
    database_url = f"sqlite+aiosqlite:///{var_dir / 'gateway.db'}"
    upgrade_database(database_url)
    settings = {
        **_gateway_settings(e2e_config),
        "XMARK_DATABASE_URL": database_url,
        "XMARK_VLLM_URLS": gumbel_worker.health_url.removesuffix("/health"),
        "XMARK_MODEL_PATH": str(e2e_config.model_path),
        "XMARK_MODEL_NAME": MODEL_NAME,
    }
    yield from _gateway(settings, var_dir, defaults=True)


# the local sentence-embedding checkpoint `make model` builds (xmark fetch-embedding-model)
EMBEDDING_CHECKPOINT = REPO_ROOT / "var" / "models" / "all-minilm-l6-v2"
EMBEDDING_MODEL = "minilm-vllm"


@pytest.fixture(scope="session")
def embedding_worker(e2e_config: E2EConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """A CPU vLLM worker running the embedding checkpoint as a pooling model (no watermark
    processor: an embedding is not generated text)."""
    if not (EMBEDDING_CHECKPOINT / "config.json").is_file():
        pytest.skip(f"no embedding checkpoint at {EMBEDDING_CHECKPOINT} (run `make model`)")
    port = free_port()
    env = _base_environment()
    env["VLLM_CPU_KVCACHE_SPACE"] = env.get("VLLM_CPU_KVCACHE_SPACE", "1")
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(EMBEDDING_CHECKPOINT),
        "--served-model-name",
        EMBEDDING_MODEL,
        "--runner",
        "pooling",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "256",
        "--enforce-eager",
    ]
    log = tmp_path_factory.mktemp("vllm-embedding") / "worker.log"
    worker = ManagedProcess("vllm embedding worker", command, env, log, f"http://127.0.0.1:{port}/health")
    worker.start()
    try:
        worker.wait_healthy(WORKER_START_TIMEOUT_S)
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="session")
def embedding_gateway(
    e2e_config: E2EConfig, embedding_worker: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    """A gateway whose models file lists a chat model (the test model, in-process), the embedding
    worker's model (kind embedding, backend vllm) and the same checkpoint in-process."""
    path = REPO_ROOT / "var" / "models" / TEST_MODEL_NAME
    if not (path / "config.json").is_file():
        pytest.skip(f"no test model at {path} (run `make model`)")
    var_dir = tmp_path_factory.mktemp("embedding-gateway-var")
    models = var_dir / "models.toml"
    # the embedding worker's timeout_s: 5x margin and more, an embedding of a few words takes
    # milliseconds on a CPU worker (and a gone worker answers at once: test_vllm_embeddings)
    models.write_text(
        f"""
[[models]]
name = "{TEST_MODEL_NAME}"
path = "{path}"

[[models]]
name = "{EMBEDDING_MODEL}"
kind = "embedding"
backend = "vllm"
urls = ["{embedding_worker.health_url.removesuffix("/health")}"]
path = "{EMBEDDING_CHECKPOINT}"
timeout_s = 30

[[models]]
name = "minilm-local"
kind = "embedding"
path = "{EMBEDDING_CHECKPOINT}"
"""
    )
    for process in _gateway({**_gateway_settings(e2e_config), "XMARK_MODELS_FILE": str(models)}, var_dir):
        deadline = time.monotonic() + GATEWAY_START_TIMEOUT_S
        # 5x margin and more: a /readyz took 0.14 s at most here
        while set(httpx.get(process.health_url, timeout=5.0).json()["models"].values()) != {"ready"}:
            assert time.monotonic() < deadline, f"a model never became ready:\n{process.log_tail()}"
            time.sleep(0.5)
        yield process
