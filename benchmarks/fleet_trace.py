"""/trace in front of two models with different tokenizers: who is named, which model, at what cost.

An embedded gateway (SQLite, both models in-process) serves SmolLM2 and the test model from a
models file. ``--users`` users are registered; each of ``--texts`` texts per model is generated
under a random user's watermark (temperature 1, ``--tokens`` tokens), and ``--nulls-per-model`` texts
per model are generated under a watermark key this gateway does not hold. Every text is traced over HTTP twice: with
``model`` naming the model that wrote it (the cost of a one-model trace) and without (both models
read it, each tokenizer once). Reported: right and wrong users and models per model (Wilson 95 %
intervals), nulls named, and the two-model trace's latency against the one-model trace's, measured
on the same texts in the same run.

    python -m benchmarks.fleet_trace --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from service.backends.base import ChatTurn, GenerationRequest, WatermarkStamp
from service.config import Settings
from service.db import session_scope, upgrade_database
from service.services.users import UserService
from service.test_model import TEST_MODEL_NAME
from service.vocabulary import Role
from xmark_core import Message, WatermarkKey

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
REPO = Path(__file__).resolve().parent.parent
# the nulls: the same models' text under a key this gateway does not hold
OTHER_SECRET = b"a watermark secret of some other provider, not this gateway's"

TOPICS = [
    "a lighthouse keeper",
    "a desert caravan",
    "a robot gardener",
    "a mountain village",
    "a river ferry",
    "an old library",
    "a night market",
    "a glacier expedition",
]


def wilson(successes: int, n: int, z: float = 1.96) -> list[float]:
    if n == 0:
        return [0.0, 1.0]
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


def _models_file(folder: Path, repo: Path) -> Path:
    path = folder / "models.toml"
    path.write_text(
        f"""
[[models]]
name = "{DEFAULT_MODEL_NAME}"
path = "{repo / "var" / "models" / DEFAULT_MODEL_NAME}"

[[models]]
name = "{TEST_MODEL_NAME}"
path = "{repo / "var" / "models" / TEST_MODEL_NAME}"
"""
    )
    return path


async def _generate(backend: Any, stamp: WatermarkStamp, topic: str, tokens: int) -> str:
    # no seed: seeded requests are generated one at a time, unseeded ones share batches
    request = GenerationRequest(
        (ChatTurn("user", f"Write a long, detailed story about {topic}."),), max_tokens=tokens, temperature=1.0
    )
    result = await backend.generate(request, stamp)
    return str(result.choices[0].text)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from service.app import create_app

    repo = REPO
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        settings = Settings(
            database_url=f"sqlite+aiosqlite:///{folder / 'xmark.db'}",
            var_dir=folder / "var",
            models_file=_models_file(folder, repo),
            trace_warm_row_tokens=0,
        )
        await asyncio.to_thread(upgrade_database, settings.database_url)
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            resources = app.state.resources
            for served in resources.fleet:
                assert await served.backend.wait_ready(300), f"{served.name} did not load"
            async with session_scope(resources.sessionmaker) as session:
                service = UserService(session, resources.keyring.params, resources.api_key_hasher)
                users = [await service.create_user(f"user-{i}", Role.USER) for i in range(args.users)]
                auditor = await service.create_user("auditor", Role.AUDITOR)
            handle = resources.keyring.active()
            params = handle.key.params
            other = WatermarkKey.from_secret(OTHER_SECRET, params)
            texts: list[dict[str, Any]] = []
            started = time.perf_counter()
            for served in resources.fleet:
                jobs = []
                for i in range(args.texts + args.nulls_per_model):
                    watermarked = i < args.texts
                    author = rng.choice(users)
                    key = handle.key if watermarked else other
                    stamp = WatermarkStamp(key, Message.from_bits(author.message_id, params), handle.name)
                    jobs.append((author.id if watermarked else None, stamp, rng.choice(TOPICS)))
                outputs = await asyncio.gather(
                    *(_generate(served.backend, stamp, topic, args.tokens) for _, stamp, topic in jobs)
                )
                for (author_id, _, _), text in zip(jobs, outputs, strict=True):
                    texts.append({"model": served.name, "author": author_id, "text": text})
            generation_s = time.perf_counter() - started
            print(f"generated {len(texts)} texts in {generation_s:.0f} s", file=sys.stderr, flush=True)
            headers = {"Authorization": f"Bearer {auditor.api_key}"}
            transport = httpx.ASGITransport(app=app)
            results: dict[str, dict[str, Any]] = {}
            async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client:

                async def traced(body: dict[str, Any]) -> tuple[dict[str, Any], float]:
                    began = time.perf_counter()
                    response = await client.post("/trace", json=body, headers=headers)
                    elapsed = time.perf_counter() - began
                    response.raise_for_status()
                    return response.json(), elapsed

                # warm both paths (null distributions, first forward passes) before timing
                for item in texts[:2]:
                    await traced({"text": item["text"]})
                for item in texts:
                    cell = results.setdefault(
                        item["model"],
                        {"texts": 0, "right": 0, "wrong_user": 0, "wrong_model": 0, "nulls": 0, "nulls_named": 0},
                    )
                    one, one_s = await traced({"text": item["text"], "model": item["model"]})
                    both, both_s = await traced({"text": item["text"]})
                    cell.setdefault("one_model_s", []).append(one_s)
                    cell.setdefault("two_models_s", []).append(both_s)
                    named = both["attribution"]["user_id"] if both["attribution"] else None
                    if item["author"] is None:
                        cell["nulls"] += 1
                        cell["nulls_named"] += named is not None
                        continue
                    cell["texts"] += 1
                    alone = one["attribution"]["user_id"] if one["attribution"] else None
                    cell["right_one_model"] = cell.get("right_one_model", 0) + (alone == item["author"])
                    if named == item["author"] and both["model"] == item["model"]:
                        cell["right"] += 1
                    elif named is not None and named != item["author"]:
                        cell["wrong_user"] += 1
                    if named is not None and both["model"] != item["model"]:
                        cell["wrong_model"] += 1
    summary: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, no GPU",
        "users": args.users,
        "tokens": args.tokens,
        "generation_s": round(generation_s, 1),
        "models": {},
    }
    one_all: list[float] = []
    both_all: list[float] = []
    nulls = nulls_named = 0
    for model, cell in results.items():
        one_s, both_s = cell.pop("one_model_s"), cell.pop("two_models_s")
        one_all += one_s
        both_all += both_s
        nulls += cell["nulls"]
        nulls_named += cell["nulls_named"]
        cell["named_right"] = round(cell["right"] / max(1, cell["texts"]), 4)
        cell["named_right_ci95"] = wilson(cell["right"], cell["texts"])
        cell["one_model_ms_p50"] = round(statistics.median(one_s) * 1000, 1)
        cell["two_models_ms_p50"] = round(statistics.median(both_s) * 1000, 1)
        cell["cost_ratio_mean"] = round(sum(both_s) / sum(one_s), 3)
        summary["models"][model] = cell
    summary["nulls"] = nulls
    summary["nulls_named"] = nulls_named
    summary["nulls_named_ci95"] = wilson(nulls_named, nulls)
    summary["cost_ratio_mean"] = round(sum(both_all) / sum(one_all), 3)
    summary["cost_ratio_p50"] = round(statistics.median(both_all) / statistics.median(one_all), 3)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet_trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--texts", type=int, default=100, help="watermarked texts per model")
    parser.add_argument("--nulls-per-model", type=int, default=50, help="texts per model without a watermark")
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    summary = asyncio.run(run(args))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for model, cell in summary["models"].items():
            print(model, cell)
        print({k: v for k, v in summary.items() if k != "models"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
