"""LiteLLM's proxy as a peer gateway for the benchmarks: started, waited for and stopped from the product's venv.

LiteLLM lives in a virtualenv of its own (``make venv-litellm``, pinned with hashes in
benchmarks/litellm/requirements.txt); this module only runs its ``litellm`` command and talks to it
over HTTP, so it imports nothing of LiteLLM and loads in the product's interpreter (stdlib + httpx).

One model is routed to an OpenAI-compatible upstream (``openai/<model>`` at ``upstream_base_url``).
``master_key`` mode has no database: clients send the master key. ``db`` mode is LiteLLM's production
set-up (virtual keys and spend logs in PostgreSQL through Prisma); it needs Prisma's native engines,
which only Prisma's own download host serves, so ``start_litellm`` checks for them first and raises
a ``RuntimeError`` naming what is missing (benchmarks/litellm/README.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

REPO = Path(__file__).resolve().parent.parent
LITELLM_VENV = REPO / ".venv-litellm"
LITELLM_PYTHON = LITELLM_VENV / "bin" / "python"
LITELLM_COMMAND = LITELLM_VENV / "bin" / "litellm"
MASTER_KEY = "sk-bench-master"
READY_TIMEOUT_S = 120.0
# The Prisma release the pinned LiteLLM's client (prisma-client-py 0.15.0) runs against: its engines
# are native binaries that Prisma serves from its own host only (no PyPI or npm package carries them).
PRISMA_CLI_VERSION = "5.17.0"
PRISMA_ENGINE_COMMIT = "393aa359c9ad4a4bb28630fb5613f9c281cde053"

# No telemetry, no start-up fetches of remote data (cost map, blog posts, header lists), errors only
# in the log (uvicorn's access log included).
QUIET_ENV = {
    "LITELLM_TELEMETRY_DISABLED": "true",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOG": "ERROR",
    "DO_NOT_TRACK": "1",
    "NO_PROXY": "127.0.0.1,localhost",
}


@dataclass
class LitellmProxy:
    """A running LiteLLM proxy: where to send requests, with which key, and where it logs."""

    process: subprocess.Popen[bytes]
    base_url: str
    api_key: str
    log_path: Path

    def stop(self, timeout: float = 15.0) -> None:
        """Terminate the proxy's process group (its workers too) and wait; kill it if it lingers."""
        if self.process.poll() is not None:
            return
        _signal_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(self.process, signal.SIGKILL)
            self.process.wait(timeout=timeout)


def _signal_group(process: subprocess.Popen[bytes], signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def _venv_python(code: str) -> str:
    if not LITELLM_PYTHON.exists():
        raise RuntimeError(f"{LITELLM_PYTHON} does not exist: run `make venv-litellm`")
    result = subprocess.run([str(LITELLM_PYTHON), "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return result.stdout.strip()


def litellm_version() -> str:
    """The LiteLLM release installed in .venv-litellm (from its package metadata)."""
    return _venv_python("import importlib.metadata as m; print(m.version('litellm'))")


def db_mode_missing() -> list[str]:
    """What LiteLLM's database mode lacks here; empty when everything it needs is in place."""
    missing: list[str] = []
    if _venv_python("import importlib.util as u; print(u.find_spec('prisma') is not None)") != "True":
        missing.append(
            "the Python package prisma (prisma-client-py 0.15.0, LiteLLM's database client) in .venv-litellm: "
            "litellm[proxy] does not pull it in"
        )
    for variable, engine in (
        ("PRISMA_QUERY_ENGINE_BINARY", "query-engine"),
        ("PRISMA_SCHEMA_ENGINE_BINARY", "schema-engine"),
    ):
        path = os.environ.get(variable)
        if not path or not Path(path).is_file():
            missing.append(
                f"Prisma's native {engine} for Prisma {PRISMA_CLI_VERSION} (engine commit {PRISMA_ENGINE_COMMIT}, "
                f"debian-openssl-3.0.x) named by {variable}: Prisma downloads it from its own host "
                "(the npm packages prisma and @prisma/engines fetch it there in their install scripts), "
                "and no PyPI, npm or Debian package carries it"
            )
    return missing


def _config(
    *, upstream_base_url: str, model: str, mode: Literal["master_key", "db"], database_url: str | None
) -> dict[str, object]:
    general_settings: dict[str, object] = {"master_key": MASTER_KEY}
    if mode == "db":
        # one spend-log row per request, flushed by the batch writer every second (plus its jitter)
        general_settings |= {"database_url": database_url, "disable_spend_logs": False, "proxy_batch_write_at": 1}
    return {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {"model": f"openai/{model}", "api_base": upstream_base_url, "api_key": "none"},
            }
        ],
        "general_settings": general_settings,
        "litellm_settings": {"set_verbose": False},
    }


def _log_tail(log_path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_ready(proxy: LitellmProxy, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if proxy.process.poll() is not None:
                raise RuntimeError(
                    f"LiteLLM exited with code {proxy.process.returncode} before it was ready; "
                    f"the end of {proxy.log_path}:\n{_log_tail(proxy.log_path)}"
                )
            try:
                if client.get(f"{proxy.base_url}/health/readiness").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    proxy.stop()
    raise RuntimeError(
        f"LiteLLM was not ready after {timeout:.0f} s; the end of {proxy.log_path}:\n{_log_tail(proxy.log_path)}"
    )


def _generate_key(proxy: LitellmProxy, model: str) -> str:
    response = httpx.post(
        f"{proxy.base_url}/key/generate",
        headers={"Authorization": f"Bearer {MASTER_KEY}"},
        json={"models": [model]},
        timeout=60.0,
    )
    response.raise_for_status()
    return str(response.json()["key"])


def start_litellm(
    *,
    upstream_base_url: str,
    model: str,
    port: int,
    workdir: Path,
    mode: Literal["master_key", "db"],
    database_url: str | None = None,
    workers: int = 1,
) -> LitellmProxy:
    """Start LiteLLM's proxy on 127.0.0.1:``port`` routing ``model`` to ``upstream_base_url``; return once it is ready.

    ``workdir`` receives config.yaml and litellm.log. In ``db`` mode LiteLLM keeps its state in
    ``database_url`` (PostgreSQL) and the returned key is a virtual key made through /key/generate.
    """
    if mode == "db":
        if not database_url:
            raise ValueError("db mode needs a database_url")
        missing = db_mode_missing()
        if missing:
            raise RuntimeError("LiteLLM's database mode cannot run here; missing:\n- " + "\n- ".join(missing))
    if not LITELLM_COMMAND.exists():
        raise RuntimeError(f"{LITELLM_COMMAND} does not exist: run `make venv-litellm`")
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "config.yaml"
    # JSON is YAML: no YAML library needed on this side
    config = _config(upstream_base_url=upstream_base_url, model=model, mode=mode, database_url=database_url)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    log_path = workdir / "litellm.log"

    env = {key: value for key, value in os.environ.items() if key not in {"DATABASE_URL", "DIRECT_URL"}}
    env |= QUIET_ENV
    env["PATH"] = f"{LITELLM_VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if mode == "db" and database_url:
        env["DATABASE_URL"] = database_url
    command = [
        str(LITELLM_COMMAND),
        "--config",
        str(config_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        str(workers),
    ]
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            command,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proxy = LitellmProxy(process=process, base_url=f"http://127.0.0.1:{port}", api_key=MASTER_KEY, log_path=log_path)
    try:
        _wait_ready(proxy, READY_TIMEOUT_S)
        if mode == "db":
            proxy.api_key = _generate_key(proxy, model)
    except BaseException:
        proxy.stop()
        raise
    return proxy
