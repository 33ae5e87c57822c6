"""Local servers for the benchmarks and the tests: a free loopback port and the ``vllm serve`` command.

The vLLM command line is the one every local worker runs (``benchmarks.vllm_overhead``,
tests/e2e_vllm): the CPU engine in eager mode with the gateway's XMark logits processor loaded.
Nothing here imports vLLM, so this module loads in an interpreter without it.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

MODEL_NAME = "smollm2-135m-instruct"
PROCESSOR = "xmark_core.vllm_v1:XMarkLogitsProcessor"
MAX_MODEL_LEN = 1024


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def vllm_serve_command(
    model_path: Path,
    port: int,
    *,
    max_num_seqs: int,
    served_model_name: str = MODEL_NAME,
    processor: str = PROCESSOR,
) -> list[str]:
    """``vllm serve`` (its OpenAI server module, in this interpreter) on 127.0.0.1:``port``."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--served-model-name",
        served_model_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(max_num_seqs),
        "--enforce-eager",
        "--logits-processors",
        processor,
        # tools / tool_choice pass through the gateway; vLLM needs a parser for any tool choice
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
