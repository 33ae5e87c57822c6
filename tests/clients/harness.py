"""The client matrix's harness: a client row, its callers, and the checks every row's answers pass.

A row is one client (one file ``tests/clients/test_client_*.py``): a ``ClientRow`` naming the calls it
makes and a function that makes them for a ``Caller`` (a user of the live gateway) and returns one
``Answer`` per call. Clients the product's test environment holds (``openai``, ``anthropic``) run in
the test process; the others run as a snippet in their own pinned environment (``python_client``:
``.venv-clients``, ``node_client``: ``tests/clients/node``), which reads the gateway's address, the
caller's key and the request from ``CLIENT_*`` variables and prints its answers as one JSON object,
``{call: {"text", "kind", "pieces", "output_tokens", "requests"}}``, on its last line (``requests``,
the requests the call made, where it made more than one).

Each row builds its client, then waits for the start signal (``start``): the matrix gives it when
every row is ready, so that all the rows' calls reach the gateway together and share one batch.
A snippet calls ``wait_for_start()`` (Python) or ``await waitForStart()`` (Node), which the harness
defines, once its client is built and before its first call.

Every answer is checked the same way (``check_answer``): the client's own result type, a text long
enough to trace, several pieces for a streamed call, and ``/trace`` naming the caller. The gateway's
own count of the caller's requests (``GET /admin/usage``) is checked once per row (``check_recorded``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import select
import subprocess
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIENTS_PYTHON = REPO_ROOT / ".venv-clients" / "bin" / "python"
NODE_PROJECT = REPO_ROOT / "tests" / "clients" / "node"

MODEL = "smollm2-135m-instruct"
# a prompt the model answers at length: with a budget of 150 tokens the answer is cut at 150,
# which /trace reads with a wide margin
PROMPT = "Write a long, detailed story about a lighthouse keeper. Use many paragraphs."
MAX_TOKENS = 150
# a text shorter than this many of the served model's tokens is not a real answer, but a client's
# empty or cut-off output (counted in tokens, not words: 150-token answers of 35 and 39 words, in
# several scripts, failed a 40-word floor; and the model ends some answers itself, one at 46 tokens
# under a 50-token floor): whether the answer carries its caller's watermark is /trace's check below
MIN_TOKENS = 20
# one client call: queued behind the other rows' calls on the 2-core CPU model; 5x margin and more:
# a round of batched 150-200 token answers took 35 s here, up to about 140 s on cores busy with
# other test runs (tests/e2e), and the LangChain row's two calls, run alone, 95 s (47 and 90 s each)
CALL_TIMEOUT_S = 900.0
# how long the rows wait for each other to be ready before they start anyway, and the bound on a
# snippet's start (its first line); 5x margin and more: the clients' imports (openai, agents) took
# 17 s here, cold, on two busy cores
START_TIMEOUT_S = 180.0
_READY = "client ready"
# 5x margin and more: a trace took 2.5 s at most with the in-process model here (tests/e2e: 400
# tokens), 28 s on the vLLM gateway (test_vllm_e2e: the likelihood decoder's first scoring on the
# worker); was 120 s: 4x that
TRACE_TIMEOUT_S = 300.0
# variables of the developer's shell that would point a client elsewhere
_CLIENT_ENV_PREFIXES = ("XMARK_", "OPENAI_", "ANTHROPIC_", "LANGCHAIN_", "LANGSMITH_", "AI_SDK_")


@dataclass(frozen=True)
class Caller:
    """A user of the live gateway: who a row's texts must be traced to."""

    base_url: str  # http://127.0.0.1:PORT (no /v1)
    user_id: int
    name: str
    api_key: str


@dataclass(frozen=True)
class Answer:
    """What one client call returned, in the client's own terms."""

    text: str
    kind: str  # the client's result type (a class name, or the wire `object` where the client has none)
    pieces: int = 0  # streamed text pieces the client delivered (0: not streamed)
    output_tokens: int | None = None  # the usage the client reported, where it reports one
    requests: int = 1  # the requests the call made (a row that makes a refused call again says so)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Answer:
        return cls(
            text=str(data["text"]),
            kind=str(data["kind"]),
            pieces=int(data.get("pieces") or 0),
            output_tokens=None if data.get("output_tokens") is None else int(data["output_tokens"]),
            requests=int(data.get("requests") or 1),
        )


@dataclass(frozen=True)
class Call:
    """A call a row makes: its name, the result type the client must return, and whether it streams."""

    name: str
    kind: str
    streamed: bool = False


# A row's calls: made for the caller once ``start()`` returns (the matrix returns when every row is
# ready, so that all their calls reach the gateway together), returning the answers by call name.
RunRow = Callable[[Caller, Callable[[], None]], dict[str, Answer]]


@dataclass(frozen=True)
class ClientRow:
    """One client of the matrix. ``run`` makes every call of ``calls`` for the caller (concurrently
    where the client allows) and returns the answers by call name."""

    client: str  # the client, as the docs name it (its version is its environment's pin)
    calls: tuple[Call, ...]
    run: RunRow

    @property
    def call_names(self) -> list[str]:
        return [call.name for call in self.calls]

    def call(self, name: str) -> Call:
        return next(call for call in self.calls if call.name == name)


def create_user(base_url: str, admin_key: str, name: str, role: str = "user") -> Caller:
    """A new user of the gateway at ``base_url``, made through its admin API."""
    response = httpx.post(
        f"{base_url}/admin/users",
        json={"name": name, "role": role},
        headers={"Authorization": f"Bearer {admin_key}"},
        timeout=30.0,  # 5x margin and more: a user is created in well under a second here
    )
    assert response.status_code == 201, response.text
    created = response.json()
    return Caller(base_url=base_url, user_id=created["id"], name=name, api_key=created["api_key"])


@dataclass(frozen=True)
class Auditor:
    """Reads the live gateway's /trace and usage with an auditor's and an admin's key."""

    base_url: str
    auditor_key: str
    admin_key: str

    def trace(self, text: str) -> dict[str, Any]:
        response = httpx.post(
            f"{self.base_url}/trace",
            json={"text": text},
            headers={"Authorization": f"Bearer {self.auditor_key}"},
            timeout=TRACE_TIMEOUT_S,
        )
        assert response.status_code == 200, response.text
        return dict(response.json())

    def requests_recorded(self, user_id: int) -> int:
        response = httpx.get(
            f"{self.base_url}/admin/usage",
            params={"days": 2, "user_id": user_id},
            headers={"Authorization": f"Bearer {self.admin_key}"},
            timeout=30.0,  # 5x margin and more: a usage query answers in milliseconds here
        )
        assert response.status_code == 200, response.text
        return sum(int(day["requests"]) for day in response.json()["data"])


@functools.cache
def _served_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from tests.conftest import checkpoint_path

    return AutoTokenizer.from_pretrained(checkpoint_path())


def check_answer(auditor: Auditor, caller: Caller, call: Call, answer: Answer) -> None:
    """The call came back as the client's own type with a real answer, and /trace names its caller."""
    assert answer.kind == call.kind, f"{call.name}: the client returned {answer.kind}, not {call.kind}"
    tokens = len(_served_tokenizer()(answer.text, add_special_tokens=False)["input_ids"])
    assert tokens >= MIN_TOKENS, f"{call.name}: a {tokens}-token answer is not an answer: {answer.text!r}"
    if call.streamed:
        assert answer.pieces > 1, f"{call.name}: the text came in {answer.pieces} piece(s), not as a stream"
    if answer.output_tokens is not None:
        assert answer.output_tokens > 0
    # the answer is sampled at the client's default temperature, 1, by the distortion-free encoder,
    # a function of the key, the caller's ID and salt and the prompt, all fixed for the matrix
    # (tests/clients/seeded_serve.py): answers that start alike on every run, until a batch's make-up
    # moves a near-tie. Drawn afresh, a miss would be rare: the forensic evaluation names 99 % of single
    # 150-token answers at temperature 1 among 10,000 IDs (docs/results/FORENSIC.md), and the
    # matrix has a few IDs
    report = auditor.trace(answer.text)
    attribution = report["attribution"]
    assert attribution is not None and attribution["user_id"] == caller.user_id, (
        f"{call.name}: /trace named {attribution} instead of {caller.name} (user {caller.user_id}); "
        f"decoder {report['decoder']}, p-value {report['p_value']}, {report['scored_tokens']} scored tokens"
    )


def check_recorded(auditor: Auditor, caller: Caller, answers: Mapping[str, Answer]) -> None:
    """The gateway counted every request the caller's calls made, one per call unless a call says it
    made more (records are written as responses end)."""
    made = sum(answer.requests for answer in answers.values())
    # 5x margin and more: a record is committed as its response ends (0.03 s after it in tests/e2e here)
    deadline = time.monotonic() + 30.0
    while (recorded := auditor.requests_recorded(caller.user_id)) < made and time.monotonic() < deadline:
        time.sleep(0.5)
    assert recorded == made, f"{recorded} requests recorded for {made} requests of {len(answers)} calls"


@dataclass(frozen=True)
class RowAnswers:
    """A row's caller and answers, with the checks of the matrix."""

    row: ClientRow
    caller: Caller
    answers: dict[str, Answer]
    auditor: Auditor

    def check(self, call: str) -> None:
        check_answer(self.auditor, self.caller, self.row.call(call), self.answers[call])

    def check_recorded(self) -> None:
        check_recorded(self.auditor, self.caller, self.answers)


def client_environment(caller: Caller, **request: str) -> dict[str, str]:
    """The environment of a client snippet: the gateway, the caller's key and the request, and
    nothing of the developer's own client configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLIENT_ENV_PREFIXES)}
    env.update(
        {
            "CLIENT_BASE_URL": caller.base_url,
            "CLIENT_API_KEY": caller.api_key,
            "CLIENT_MODEL": MODEL,
            "CLIENT_PROMPT": PROMPT,
            "CLIENT_MAX_TOKENS": str(MAX_TOKENS),
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }
    )
    env.update(request)
    return env


def no_wait() -> None:
    """The start signal of a row run on its own: go at once."""


def in_process(calls: Callable[[Caller], Coroutine[Any, Any, dict[str, Answer]]]) -> RunRow:
    """A row's calls made in the test process (clients of the product's test environment)."""

    def run(caller: Caller, start: Callable[[], None]) -> dict[str, Answer]:
        start()
        return asyncio.run(calls(caller))

    return run


# Each snippet starts with one of these: it calls ``wait_for_start()`` / ``await waitForStart()``
# once its client is built and before its first call.
_PYTHON_PRELUDE = f"""
import sys
def wait_for_start():
    print("{_READY}", flush=True)
    sys.stdin.readline()
"""
_NODE_PRELUDE = f"""
import {{ once as onceEvent }} from "node:events";
import {{ createInterface }} from "node:readline";
async function waitForStart() {{
  console.log("{_READY}");
  await onceEvent(createInterface({{ input: process.stdin }}), "line");
}}
"""


def _run_snippet(command: list[str], cwd: Path, env: dict[str, str], start: Callable[[], None]) -> dict[str, Any]:
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    try:
        # the snippet's first line once its client is built (its imports take seconds on a busy machine)
        ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
        first = process.stdout.readline() if ready else ""
    finally:
        start()
    try:
        out, err = process.communicate(input="go\n", timeout=CALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    assert first.strip() == _READY, f"the client did not start (exit {process.returncode}):\n{err[-6000:]}"
    assert process.returncode == 0, f"the client failed (exit {process.returncode}):\n{err[-6000:]}"
    lines = out.strip().splitlines()
    assert lines, f"the client printed nothing:\n{err[-6000:]}"
    return dict(json.loads(lines[-1]))


def _answers(printed: dict[str, Any]) -> dict[str, Answer]:
    return {name: Answer.from_json(data) for name, data in printed.items()}


def run_python_snippet(
    snippet: str, caller: Caller, start: Callable[[], None] = no_wait, **request: str
) -> dict[str, Any]:
    """Run a Python snippet in the clients' virtualenv (``make venv-clients``) for ``caller``;
    ``request`` sets or overrides ``CLIENT_*`` variables. Returns the JSON object it printed last."""
    if not CLIENTS_PYTHON.is_file():
        start()
        pytest.skip(f"no {CLIENTS_PYTHON.parent.parent.name} (run `make venv-clients`)")
    command = [str(CLIENTS_PYTHON), "-c", _PYTHON_PRELUDE + snippet]
    return _run_snippet(command, REPO_ROOT, client_environment(caller, **request), start)


def python_client(snippet: str, **request: str) -> RunRow:
    """A row's calls as a Python snippet run by the clients' virtualenv."""

    def run(caller: Caller, start: Callable[[], None]) -> dict[str, Answer]:
        return _answers(run_python_snippet(snippet, caller, start, **request))

    return run


def node_client(snippet: str, **request: str) -> RunRow:
    """A row's calls as an ES module snippet run by Node in tests/clients/node (``make clients-node``),
    whose node_modules its imports resolve from; ``request`` sets or overrides ``CLIENT_*`` variables."""

    def run(caller: Caller, start: Callable[[], None]) -> dict[str, Answer]:
        if not (NODE_PROJECT / "node_modules").is_dir():
            start()
            pytest.skip(f"no {NODE_PROJECT / 'node_modules'} (run `make clients-node`)")
        command = ["node", "--input-type=module", "-e", _NODE_PRELUDE + snippet]
        return _answers(_run_snippet(command, NODE_PROJECT, client_environment(caller, **request), start))

    return run


# -- the row's tests: each test_client_*.py module imports these two; the package's conftest
# parametrizes ``call`` with the names of the module's ``CLIENT`` calls --------------------------


def test_the_answer_is_the_clients_and_traced_to_its_caller(row: RowAnswers, call: str) -> None:
    """The call's answer is the client's own type, carries text, and /trace names its caller."""
    row.check(call)


def test_the_gateway_recorded_every_call(row: RowAnswers) -> None:
    """Every call the row made has exactly one request recorded under its caller."""
    row.check_recorded()
