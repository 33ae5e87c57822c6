"""``xmark trace``: the /trace report of a text computed from the configuration alone (no server,
no record)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from service.config import Settings, load_secrets
from service.db import MAINTENANCE_TIMEOUT_S, create_engine, create_sessionmaker
from service.errors import PayloadTooLargeError, ServiceUnavailableError
from service.fleet import model_settings, tokenizer_fingerprint
from service.keyring import Keyring, spec_from_settings
from service.provenance.retrieval import Retrieved
from service.provenance.search import ProvenanceSearch
from service.repositories.provenance import ProvenanceRepository
from service.resources import sketcher_for
from service.services.registry_cache import RegistryCache
from service.trace.analysis import LengthGroup, group_by_length, tokenize
from service.trace.fanout import FanoutOutcome, TextReading, on_thread
from service.trace.plan import ReadingPlan
from service.trace.policy import TracePolicy
from service.trace.service import run_trace
from service.vocabulary import TraceDecoder


async def offline_trace_async(settings: Settings, text: str) -> dict[str, Any]:
    """The /trace report of ``text`` computed from the configuration alone (no server, no record):
    the counting decoder over the registry and the users the generation log's leads point to, with
    the log's corroboration, as /trace reads them."""
    from transformers import AutoTokenizer  # heavy: only when a trace is asked for

    if len(text) > settings.max_trace_chars:
        raise PayloadTooLargeError(f"text is longer than {settings.max_trace_chars} characters", param="text")
    os.environ["HF_HUB_OFFLINE"] = "1"
    # every served model's tokenizer (a models file may list several); models sharing one read alike
    by_tokenizer: dict[str, tuple[list[str], Any]] = {}
    for own, _ in model_settings(settings):
        tokenizer = AutoTokenizer.from_pretrained(own.resolved_model_path(), local_files_only=True)
        by_tokenizer.setdefault(tokenizer_fingerprint(tokenizer), ([], tokenizer))[0].append(own.model_name)
    params = spec_from_settings(settings)
    secrets = load_secrets(settings)
    keyring = Keyring(params, secrets.watermark)
    engine = create_engine(settings, timeout_s=MAINTENANCE_TIMEOUT_S)
    tokenized = [
        (names, tokenizer, await asyncio.to_thread(tokenize, tokenizer, text))
        for names, tokenizer in by_tokenizer.values()
    ]
    try:
        sessionmaker = create_sessionmaker(engine)
        async with sessionmaker() as session:
            await keyring.refresh(session)
            versions = keyring.readings()  # one per encoder of every usable key version
            if not versions:
                raise ServiceUnavailableError("No usable watermark key version is configured")
            registry = RegistryCache(sessionmaker)
            groups = [
                LengthGroup(group, await registry.snapshot(group[0].key.params, session))
                for group in group_by_length(versions)
            ]

            policy = TracePolicy.from_settings(settings)

            async def analyze(retrieved: Retrieved) -> FanoutOutcome:
                counting = (TraceDecoder.COUNTING,)
                plans = tuple(ReadingPlan(tuple(names), counting) for names, _, _ in tokenized)
                texts = [TextReading(ids, tokenizer) for _, tokenizer, ids in tokenized]
                return await run_trace(
                    groups, retrieved, texts, _no_scores, policy, plans=plans, run_counting=on_thread
                )

            provenance = ProvenanceSearch(
                ProvenanceRepository(session), sketcher_for(settings, secrets.api_key_pepper), policy
            )
            outcome = await provenance.witness(text, analyze, inline=False)
    finally:
        await engine.dispose()
    return outcome.report.model_dump()


async def _no_scores() -> None:
    return None


def offline_trace(settings: Settings, text: str) -> dict[str, Any]:
    """Synchronous entry point of :func:`offline_trace_async` (for the command line)."""
    return asyncio.run(offline_trace_async(settings, text))
