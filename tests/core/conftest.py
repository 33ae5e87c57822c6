"""Shared fixtures of the xmark_core tests: parameters, keys and the synthetic language model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from xmark_core import WatermarkKey, WatermarkParams

from .synthetic import SECRET


@pytest.fixture(scope="session")
def params() -> WatermarkParams:
    return WatermarkParams()


@pytest.fixture(scope="session")
def key(params: WatermarkParams) -> WatermarkKey:
    return WatermarkKey.from_secret(SECRET, params)


@pytest.fixture(scope="session")
def make_key() -> Callable[..., WatermarkKey]:
    def _make(secret: str = SECRET, **fields: Any) -> WatermarkKey:
        return WatermarkKey.from_secret(secret, WatermarkParams(**fields))

    return _make


@pytest.fixture(scope="package", autouse=True)
def single_torch_thread() -> Iterator[None]:
    """The ops under test are small or memory-bound: one intra-op thread is as fast on an idle
    2-core runner and many times faster on a busy one. Restored for the other test packages."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
