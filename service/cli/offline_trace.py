"""``xmark trace``: the /trace report of a text computed from the configuration alone (no server,
no record)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from service.config import Settings, load_secrets
from service.db import MAINTENANCE_TIMEOUT_S, create_engine, create_sessionmaker
from service.errors import PayloadTooLargeError, ServiceUnavailableError
from service.keyring import Keyring, params_from_settings
from service.services.registry_cache import RegistryCache
from service.services.trace_analysis import LengthGroup, analyze_text, group_by_length


async def offline_trace_async(settings: Settings, text: str) -> dict[str, Any]:
    """The /trace report of ``text`` computed from the configuration alone (no server, no record)."""
    from transformers import AutoTokenizer  # heavy: only when a trace is asked for

    if len(text) > settings.max_trace_chars:
        raise PayloadTooLargeError(f"text is longer than {settings.max_trace_chars} characters", param="text")
    os.environ["HF_HUB_OFFLINE"] = "1"
    tokenizer = AutoTokenizer.from_pretrained(settings.resolved_model_path(), local_files_only=True)
    params = params_from_settings(settings)
    keyring = Keyring(params, load_secrets(settings).watermark)
    engine = create_engine(settings, timeout_s=MAINTENANCE_TIMEOUT_S)
    try:
        sessionmaker = create_sessionmaker(engine)
        async with sessionmaker() as session:
            await keyring.refresh(session)
            versions = keyring.usable()
            if not versions:
                raise ServiceUnavailableError("No usable watermark key version is configured")
            registry = RegistryCache(sessionmaker)
            groups = [
                LengthGroup(group, await registry.snapshot(group[0].key.params, session))
                for group in group_by_length(versions)
            ]
    finally:
        await engine.dispose()
    outcome = await asyncio.to_thread(analyze_text, text, tokenizer, groups, alpha=settings.trace_alpha)
    return outcome.report.model_dump()


def offline_trace(settings: Settings, text: str) -> dict[str, Any]:
    """Synchronous entry point of :func:`offline_trace_async` (for the command line)."""
    return asyncio.run(offline_trace_async(settings, text))
