"""Chunked prefill in the local backend: abandoned long prompts, single-stream speed, and the
slice size, on the real model and the real backend object (``service.backends.local``).

* ``abandon``: three users send ~6,400-word prompts and leave after ``--abandon-after`` s (their
  streams are cancelled, as the gateway does when a client disconnects); then a fourth user asks
  for 4 tokens. Reported: the fourth user's time to the answer, with the slice budget
  ``--chunk`` and with slicing effectively off (a budget larger than any prompt).
* ``single stream``: tokens/s of one request with a short prompt (``--max-tokens`` new tokens,
  sampled with a fixed seed), both budgets, ``--rounds`` rounds in alternating order.
* ``sweep`` (``--sweep 128,256,512,1024``): per budget, a request decoding while one long prompt
  is read: the time to read the long prompt and the decoding request's longest pause between two
  tokens (one decoding step plus one slice).

The prompts are sized to the model's context (SmolLM2: 8,192 tokens): ~6,400 short English words
make ~6,400 tokens.

    python -m benchmarks.prefill_slices --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.launch import MODEL_NAME
from service.backends.base import ChatTurn, GenerationRequest, WatermarkStamp
from service.backends.local import LocalBackend, LocalStream
from xmark_core import Message, WatermarkKey, WatermarkParams

DEFAULT_MODEL_PATH = Path(__file__).resolve().parent.parent / "var" / "models" / MODEL_NAME
SECRET = b"prefill-slices-benchmark-secret-0123456789"
UNCHUNKED = 1 << 30  # larger than any prompt: every prompt read in one pass
SENTENCE = "the river runs to the sea and the boat goes with it while the birds sing in the trees"


def long_prompt(words: int, user: int) -> tuple[ChatTurn, ...]:
    words_of = SENTENCE.split()
    text = " ".join(words_of[i % len(words_of)] for i in range(words))
    return (ChatTurn("user", f"Reader {user}: summarise this text.\n\n{text}"),)


async def drain(stream: LocalStream) -> list[float]:
    """Read a stream to its end; the arrival times of its deltas that carried tokens."""
    arrivals = []
    async for delta in stream:
        if delta.completion_tokens:
            arrivals.append(time.perf_counter())
    return arrivals


async def abandon(backend: LocalBackend, stamp: WatermarkStamp, words: int, after: float) -> dict[str, Any]:
    """Three long prompts abandoned after ``after`` s, then a fourth user's 4 tokens."""
    streams = []
    for user in (1, 2, 3):
        request = GenerationRequest(long_prompt(words, user), max_tokens=64, temperature=0, user_id=user)
        streams.append(await backend.stream(request, stamp))
    readers = [asyncio.create_task(drain(stream)) for stream in streams]
    await asyncio.sleep(after)
    prefilled = [stream.prefilled_tokens for stream in streams]
    for stream in streams:
        stream.cancel()  # what the gateway does when the client's connection closes
    started = time.perf_counter()
    short = GenerationRequest((ChatTurn("user", "Say hi."),), max_tokens=4, temperature=0, user_id=4)
    result = await backend.generate(short, stamp)
    waited = time.perf_counter() - started
    await asyncio.gather(*readers)
    return {
        "fourth_user_s": round(waited, 2),
        "fourth_user_tokens": result.completion_tokens,
        "prompt_tokens": streams[0].prompt_tokens,
        "prefilled_at_abandon": prefilled,
    }


async def single_stream(backend: LocalBackend, stamp: WatermarkStamp, max_tokens: int, seed: int) -> tuple[float, str]:
    request = GenerationRequest(
        (ChatTurn("user", "Write a long story about a fox who learns to read, with many chapters."),),
        max_tokens=max_tokens,
        temperature=0.8,
        seed=seed,
    )
    started = time.perf_counter()
    result = await backend.generate(request, stamp)
    return result.completion_tokens / (time.perf_counter() - started), result.choices[0].text


async def decode_during_prefill(backend: LocalBackend, stamp: WatermarkStamp, words: int) -> dict[str, Any]:
    """A request decoding while a long prompt is read (slices between its steps): the time to
    read the prompt, and the decoding request's tokens meanwhile and longest pause between two."""
    counting = GenerationRequest(
        (ChatTurn("user", "Count from 1 to 1000, one number per line."),), max_tokens=4000, temperature=0, user_id=1
    )
    running = await backend.stream(counting, stamp)
    first = await running.__anext__()  # decoding now
    assert first.finish_reason is None
    long = await backend.stream(GenerationRequest(long_prompt(words, 2), max_tokens=1, temperature=0, user_id=2), stamp)
    started = last = time.perf_counter()
    target = long.prompt_tokens - 1
    tokens, longest = 0, 0.0
    async for delta in running:
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
        if delta.finish_reason is not None:
            raise SystemExit("the decoding request ended before the long prompt was read; use fewer --words")
        tokens += 1
        if long.prefilled_tokens >= target:
            break
    read_s = time.perf_counter() - started
    running.cancel()
    await drain(running)
    await drain(long)
    return {"read_prompt_s": round(read_s, 2), "tokens_decoded_meanwhile": tokens, "longest_pause_s": round(longest, 2)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    backend = LocalBackend(args.model_path, "bench", threads=args.threads, prefill_chunk_tokens=args.chunk)
    await backend.start()
    if not await backend.wait_ready(300):
        raise SystemExit(f"the model did not load: {backend.load_error}")
    params = WatermarkParams(bits=32, block_bits=2, num_keys=2, delta=2.0)
    stamp = WatermarkStamp(WatermarkKey.from_secret(SECRET, params), Message.from_int(0x5EED1234, params))
    budgets = {"chunked": args.chunk, "unchunked": UNCHUNKED}
    report: dict[str, Any] = {"chunk_tokens": args.chunk, "abandon": {}, "single_stream": {}, "sweep": []}
    try:
        for name, budget in budgets.items():
            backend.prefill_chunk_tokens = budget
            report["abandon"][name] = await abandon(backend, stamp, args.words, args.abandon_after)
            print(f"abandon, {name}: {report['abandon'][name]}", flush=True)
        rates: dict[str, list[float]] = {name: [] for name in budgets}
        texts: dict[str, set[str]] = {name: set() for name in budgets}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            order = list(budgets) if round_ % 2 else list(reversed(budgets))
            for name in order:
                backend.prefill_chunk_tokens = budgets[name]
                rate, text = await single_stream(backend, stamp, args.max_tokens, seed=1234)
                texts[name].add(text)
                if round_:
                    rates[name].append(rate)
        for name in budgets:
            report["single_stream"][name] = {
                "tokens_per_s": round(statistics.median(rates[name]), 2),
                "rounds": [round(r, 2) for r in rates[name]],
            }
        report["single_stream"]["ratio"] = round(
            report["single_stream"]["chunked"]["tokens_per_s"] / report["single_stream"]["unchunked"]["tokens_per_s"], 3
        )
        report["single_stream"]["same_text"] = len(texts["chunked"] | texts["unchunked"]) == 1
        print(f"single stream: {report['single_stream']}", flush=True)
        for budget in [int(b) for b in args.sweep.split(",") if b.strip()]:
            backend.prefill_chunk_tokens = budget
            entry = {"chunk_tokens": budget, **await decode_during_prefill(backend, stamp, args.words)}
            report["sweep"].append(entry)
            print(f"sweep: {entry}", flush=True)
    finally:
        await backend.close()
    return report


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{'budget':>10} | {'4th user s':>10} | {'single-stream tok/s':>19}",
        f"{'-' * 10}-+-{'-' * 10}-+-{'-' * 19}",
    ]
    for name, label in (("chunked", str(report["chunk_tokens"])), ("unchunked", "off")):
        lines.append(
            f"{label:>10} | {report['abandon'][name]['fourth_user_s']:>10} | "
            f"{report['single_stream'][name]['tokens_per_s']:>19}"
        )
    lines.append(f"chunked / unchunked tok/s: {report['single_stream']['ratio']}")
    if report["sweep"]:
        lines += [
            "",
            f"{'budget':>10} | {'long prompt read in s':>23} | {'longest decode pause s':>22}",
            f"{'-' * 10}-+-{'-' * 23}-+-{'-' * 22}",
        ]
        for entry in report["sweep"]:
            lines.append(f"{entry['chunk_tokens']:>10} | {entry['read_prompt_s']:>23} | {entry['longest_pause_s']:>22}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--model-path", type=Path, default=Path(os.environ.get("XMARK_MODEL_PATH", DEFAULT_MODEL_PATH)))
    parser.add_argument("--threads", type=int, default=None, help="model threads (default: the backend's)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill slice budget, tokens")
    parser.add_argument("--words", type=int, default=6400, help="words of each long prompt")
    parser.add_argument("--abandon-after", type=float, default=2.0)
    parser.add_argument("--max-tokens", type=int, default=160, help="new tokens of the single stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sweep", default="", help="comma-separated budgets for the decode-pause sweep")
    args = parser.parse_args(argv)
    if not (args.model_path / "config.json").is_file():
        parser.error(f"no model checkpoint at {args.model_path} (run `make model`)")
    report = asyncio.run(run(args))
    report |= {
        "benchmark": "prefill_slices",
        "model": MODEL_NAME,
        "words": args.words,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    print(table(report))
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
