"""Worker-side fixtures: XMark secrets in the environment, read through the cached worker keyring."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from xmark_core.vllm_common import ENV_SCHEME, ENV_SECRETS, WorkerKeyring, worker_keyring

WORKER_SECRETS = {
    "v1": "worker-test-secret-v1-0d7c41e9a2b85f36",
    "v2": "worker-test-secret-v2-9b15e08c3f6a27d4",
}


@pytest.fixture
def worker_secrets() -> dict[str, str]:
    return dict(WORKER_SECRETS)


@pytest.fixture
def keyring(monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerKeyring]:
    """This process's worker keyring, configured with two key versions (v1, v2)."""
    monkeypatch.setenv(ENV_SECRETS, ",".join(f"{k}:{v}" for k, v in WORKER_SECRETS.items()))
    worker_keyring.cache_clear()
    try:
        yield worker_keyring()
    finally:
        worker_keyring.cache_clear()


@pytest.fixture
def auto_keyring(monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerKeyring]:
    """This process's worker keyring of the configured scheme ``auto``: each of v1 and v2 with a
    gumbel primary and a biasing (xmark) companion, on the default parameters."""
    monkeypatch.setenv(ENV_SECRETS, ",".join(f"{k}:{v}" for k, v in WORKER_SECRETS.items()))
    monkeypatch.setenv(ENV_SCHEME, "auto")
    worker_keyring.cache_clear()
    try:
        yield worker_keyring()
    finally:
        worker_keyring.cache_clear()
