"""/trace in front of two models with different tokenizers: who is named, which model, at what cost.

A gateway (SQLite) serves SmolLM2 and the test model from a models file: ``--backend local``
loads both in-process, ``--backend vllm`` starts one CPU vLLM worker per model (run it with the
vLLM virtualenv's interpreter). ``--users`` users are registered; each of ``--texts`` texts per
model is generated under a random user's watermark (temperature 1, ``--tokens`` tokens). Two kinds
of null: ``--nulls-per-model`` texts per model sampled from the same model with no watermark at all
(transformers' own sampling for the local backend, the worker without the watermark's arguments for
vLLM), and ``--foreign-per-model`` texts under a watermark key this gateway does not hold. Every
text is traced over HTTP twice, in alternating order: with ``model`` naming the model that wrote
it (the cost of a one-model trace) and without (both models read it, each tokenizer once).
Reported: right and wrong users and models per model (Wilson 95 % intervals), nulls named, and the
two-model trace's latency against the one-model trace's, measured on the same texts in the same
run.

    python -m benchmarks.fleet_trace --json
    .venv-vllm/bin/python -m benchmarks.fleet_trace --backend vllm --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.launch import free_port, vllm_serve_command
from benchmarks.vllm_overhead import stop_server, wait_healthy
from service.backends.base import ChatTurn, GenerationRequest, WatermarkStamp
from service.config import Settings
from service.db import session_scope, upgrade_database
from service.random_model import TEST_MODEL_NAME
from service.repositories.unit import Repositories
from service.services.users import UserService
from service.vocabulary import Role
from xmark_core import Message, WatermarkKey

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
REPO = Path(__file__).resolve().parent.parent
# one kind of null: the same models' text under a key this gateway does not hold
OTHER_SECRET = "a watermark secret of some other provider and not this gateway's own"
KEY_VERSION = "bench"
FOREIGN_KEY_VERSION = "foreign"
WORKER_START_TIMEOUT_S = 600.0

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


def _prompt(topic: str) -> str:
    return f"Write a long, detailed story about {topic}."


def _checkpoint(name: str) -> Path:
    return REPO / "var" / "models" / name


def _models_file(folder: Path, workers: dict[str, str] | None) -> Path:
    """Both models: in-process checkpoints, or (``workers``: name -> URL) one vLLM worker each."""
    entries = []
    for name in (DEFAULT_MODEL_NAME, TEST_MODEL_NAME):
        entry = f'[[models]]\nname = "{name}"\npath = "{_checkpoint(name)}"\n'
        if workers is not None:
            entry += f'backend = "vllm"\nurls = ["{workers[name]}"]\ntimeout_s = 600\n'
        entries.append(entry)
    path = folder / "models.toml"
    path.write_text("\n".join(entries))
    return path


class Worker:
    """One CPU ``vllm serve`` of a model, holding the gateway's secret and the foreign one."""

    def __init__(self, name: str, secret: str, log: Path, max_num_seqs: int) -> None:
        self.name = name
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "XMARK_WATERMARK_SECRETS": f"{KEY_VERSION}:{secret},{FOREIGN_KEY_VERSION}:{OTHER_SECRET}",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        }
        env.pop("XMARK_SECRETS_FILE", None)
        command = vllm_serve_command(_checkpoint(name), port, max_num_seqs=max_num_seqs, served_model_name=name)
        self.log = log
        with log.open("wb") as handle:
            self.process = subprocess.Popen(
                command, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
            )

    async def wait_healthy(self) -> None:
        try:
            await wait_healthy(self.url, self.process, WORKER_START_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the {self.name} worker: {exc}\n{tail}") from None

    async def unwatermarked(self, client: httpx.AsyncClient, topic: str, tokens: int) -> str:
        """The model's own sampling: no watermark arguments, so the logits processor passes through."""
        body = {
            "model": self.name,
            "messages": [{"role": "user", "content": _prompt(topic)}],
            "max_tokens": tokens,
            "temperature": 1.0,
        }
        response = await client.post(f"{self.url}/v1/chat/completions", json=body)
        response.raise_for_status()
        return str(response.json()["choices"][0]["message"]["content"])

    def stop(self) -> None:
        stop_server(self.process)


def _sample_unwatermarked(name: str, topics: list[str], tokens: int, seed: int, batch: int = 16) -> list[str]:
    """The checkpoint's own sampling with transformers (temperature 1): no watermark anywhere."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(_checkpoint(name))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(_checkpoint(name), dtype=torch.float32).eval()
    texts: list[str] = []
    for first in range(0, len(topics), batch):
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": _prompt(topic)}], tokenize=False, add_generation_prompt=True
            )
            for topic in topics[first : first + batch]
        ]
        encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                **encoded,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out[:, encoded["input_ids"].shape[1] :]
        texts += [str(text) for text in tokenizer.batch_decode(new, skip_special_tokens=True)]
    return texts


async def _generate(backend: Any, stamp: WatermarkStamp, topic: str, tokens: int) -> str:
    # no seed: seeded requests are generated one at a time, unseeded ones share batches
    request = GenerationRequest((ChatTurn("user", _prompt(topic)),), max_tokens=tokens, temperature=1.0)
    result = await backend.generate(request, stamp)
    return str(result.choices[0].text)


async def _texts(
    args: argparse.Namespace, resources: Any, users: list[Any], workers: dict[str, Worker] | None
) -> list[dict[str, Any]]:
    """Every text to trace: ``kind`` is watermarked (``author`` set), unwatermarked or foreign."""
    rng = random.Random(args.seed)
    handle = resources.keyring.active()
    params = handle.key.params
    other = WatermarkKey.from_secret(OTHER_SECRET, params)
    texts: list[dict[str, Any]] = []
    for served in resources.fleet:
        jobs = []
        for i in range(args.texts + args.foreign_per_model):
            author = rng.choice(users)
            if i < args.texts:
                stamp = WatermarkStamp(handle.key, Message.from_bits(author.message_id, params), handle.name)
                jobs.append(("watermarked", author.id, stamp, rng.choice(TOPICS)))
            else:
                stamp = WatermarkStamp(other, Message.from_bits(author.message_id, params), FOREIGN_KEY_VERSION)
                jobs.append(("foreign", None, stamp, rng.choice(TOPICS)))
        outputs = await asyncio.gather(
            *(_generate(served.backend, stamp, topic, args.tokens) for _, _, stamp, topic in jobs)
        )
        for (kind, author_id, _, _), text in zip(jobs, outputs, strict=True):
            texts.append({"model": served.name, "kind": kind, "author": author_id, "text": text})
        topics = [rng.choice(TOPICS) for _ in range(args.nulls_per_model)]
        if workers is not None:
            async with httpx.AsyncClient(timeout=600.0) as client:
                plain = await asyncio.gather(
                    *(workers[served.name].unwatermarked(client, topic, args.tokens) for topic in topics)
                )
        else:
            plain = await asyncio.to_thread(_sample_unwatermarked, served.name, topics, args.tokens, args.seed)
        texts += [{"model": served.name, "kind": "unwatermarked", "author": None, "text": text} for text in plain]
    return texts


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from service.app import create_app

    secret = secrets.token_hex(32)
    workers: dict[str, Worker] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        try:
            if args.backend == "vllm":
                for name in (DEFAULT_MODEL_NAME, TEST_MODEL_NAME):
                    workers[name] = Worker(name, secret, folder / f"{name}.log", args.max_num_seqs)
                for worker in workers.values():
                    await worker.wait_healthy()
            settings = Settings(
                database_url=f"sqlite+aiosqlite:///{folder / 'xmark.db'}",
                var_dir=folder / "var",
                watermark_secrets=f"{KEY_VERSION}:{secret}",
                models_file=_models_file(folder, {n: w.url for n, w in workers.items()} if workers else None),
                trace_warm_row_tokens=0,
            )
            await asyncio.to_thread(upgrade_database, settings.database_url)
            app = create_app(settings)
            async with app.router.lifespan_context(app):
                return await _measure(args, app, workers or None)
        finally:
            for worker in workers.values():
                worker.stop()


async def _measure(args: argparse.Namespace, app: Any, workers: dict[str, Worker] | None) -> dict[str, Any]:
    resources = app.state.resources
    for served in resources.fleet:
        assert await served.backend.wait_ready(300), f"{served.name} did not load"
    async with session_scope(resources.sessionmaker) as session:
        service = UserService(Repositories(session), resources.keyring.params, resources.api_key_hasher)
        users = [await service.create_user(f"user-{i}", Role.USER) for i in range(args.users)]
        auditor = await service.create_user("auditor", Role.AUDITOR)
    started = time.perf_counter()
    texts = await _texts(args, resources, users, workers)
    generation_s = time.perf_counter() - started
    print(f"generated {len(texts)} texts in {generation_s:.0f} s", file=sys.stderr, flush=True)
    headers = {"Authorization": f"Bearer {auditor.api_key}"}
    transport = httpx.ASGITransport(app=app)
    results: dict[str, dict[str, Any]] = {}
    one_all: list[float] = []
    both_all: list[float] = []
    first_s: list[float] = []  # each text's first trace, whichever it was, and its second
    second_s: list[float] = []
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
        for done, item in enumerate(texts, 1):
            cell = results.setdefault(
                item["model"],
                {
                    "texts": 0,
                    "right": 0,
                    "right_one_model": 0,
                    "wrong_user": 0,
                    "wrong_model": 0,
                    "unwatermarked": 0,
                    "unwatermarked_named": 0,
                    "foreign": 0,
                    "foreign_named": 0,
                    "one_model_s": [],
                    "two_models_s": [],
                },
            )
            # the order alternates, so that whatever a second read of the same text saves falls on both
            if done % 2:
                one, one_s = await traced({"text": item["text"], "model": item["model"]})
                both, both_s = await traced({"text": item["text"]})
            else:
                both, both_s = await traced({"text": item["text"]})
                one, one_s = await traced({"text": item["text"], "model": item["model"]})
            (first_s if done % 2 else second_s).append(one_s)
            (second_s if done % 2 else first_s).append(both_s)
            cell["one_model_s"].append(one_s)
            cell["two_models_s"].append(both_s)
            named = both["attribution"]["user_id"] if both["attribution"] else None
            if done % 100 == 0:
                print(f"traced {done} of {len(texts)}", file=sys.stderr, flush=True)
            if item["kind"] != "watermarked":
                cell[item["kind"]] += 1
                cell[f"{item['kind']}_named"] += named is not None
                continue
            cell["texts"] += 1
            alone = one["attribution"]["user_id"] if one["attribution"] else None
            cell["right_one_model"] += alone == item["author"]
            if named == item["author"] and both["model"] == item["model"]:
                cell["right"] += 1
            elif named is not None and named != item["author"]:
                cell["wrong_user"] += 1
            if named is not None and both["model"] != item["model"]:
                cell["wrong_model"] += 1
    summary: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, no GPU",
        "backend": args.backend,
        "users": args.users,
        "tokens": args.tokens,
        "generation_s": round(generation_s, 1),
        "models": {},
    }
    totals = {"unwatermarked": 0, "unwatermarked_named": 0, "foreign": 0, "foreign_named": 0}
    for model, cell in results.items():
        one_s, both_s = cell.pop("one_model_s"), cell.pop("two_models_s")
        one_all += one_s
        both_all += both_s
        for key in totals:
            totals[key] += cell[key]
        cell["named_right"] = round(cell["right"] / max(1, cell["texts"]), 4)
        cell["named_right_ci95"] = wilson(cell["right"], cell["texts"])
        cell["one_model_ms_p50"] = round(statistics.median(one_s) * 1000, 1)
        cell["two_models_ms_p50"] = round(statistics.median(both_s) * 1000, 1)
        cell["cost_ratio_mean"] = round(sum(both_s) / sum(one_s), 3)
        summary["models"][model] = cell
    summary.update(totals)
    summary["unwatermarked_named_ci95"] = wilson(totals["unwatermarked_named"], totals["unwatermarked"])
    summary["foreign_named_ci95"] = wilson(totals["foreign_named"], totals["foreign"])
    summary["cost_ratio_mean"] = round(sum(both_all) / sum(one_all), 3)
    summary["cost_ratio_p50"] = round(statistics.median(both_all) / statistics.median(one_all), 3)
    # a second trace of the same text against its first, over both kinds: an order effect shows here
    summary["second_over_first_trace"] = round(sum(second_s) / sum(first_s), 3)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet_trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("local", "vllm"), default="local")
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--texts", type=int, default=100, help="watermarked texts per model")
    parser.add_argument("--nulls-per-model", type=int, default=50, help="texts per model with no watermark")
    parser.add_argument(
        "--foreign-per-model", type=int, default=25, help="texts per model under a key this gateway does not hold"
    )
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="vLLM workers' batch size")
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
