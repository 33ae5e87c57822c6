"""Jobs waiting for the model, and the per-row bookkeeping of one batched ``generate`` call.

A job is one request (``n`` rows with the same prompt). Jobs with the same sampling settings and
watermark key share a batch; each row carries its own caller's message. ``FairBacklog`` decides
which waiting jobs run next: users take turns, so one user's queue of long jobs cannot hold back
another user's job for more than the batch already running. ``RowTracker`` runs as a
transformers stopping criterion: after every decoding step it detokenizes each row's new token,
applies stop strings and per-row token limits, honours cancellation, sends the text deltas to the
waiting client and tells ``generate`` which rows are finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import LogitsProcessor, StoppingCriteria

from service.backends.base import ChoiceDelta, GenerationRequest, WatermarkStamp
from service.backends.detokenizer import IncrementalDetokenizer
from service.backends.stop_strings import StopStringBuffer
from service.vocabulary import FinishReason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamEnd:
    """Sentinel event: no more deltas for this job."""


@dataclass(frozen=True)
class StreamFailure:
    """Event: the generation failed; ``message`` is safe to show to the client.

    ``retryable``: the backend could not take the job (shutting down), so another attempt may
    succeed (503); otherwise the model failed while running it (500 ``backend_error``).
    """

    message: str
    retryable: bool = False


StreamEvent = ChoiceDelta | StreamEnd | StreamFailure


@dataclass(eq=False)
class Job:
    """One request waiting for, or running on, the model."""

    request: GenerationRequest
    stamp: WatermarkStamp
    prompt_ids: list[int]
    deliver: Callable[[StreamEvent], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    # chunked prefill (``prefill``): the prompt's KV cache so far (worker thread), its length,
    # and the slices read into it
    cache: Any = None
    prefilled: int = 0
    slices: int = 0

    @property
    def rows(self) -> int:
        return self.request.n

    def batch_key(self) -> tuple[object, ...] | None:
        """Jobs with equal keys may share a ``generate`` call; None means "run alone"."""
        if self.request.seed is not None:
            return None  # reproducible sampling needs the generator to itself
        request = self.request
        sampling = ("greedy",) if request.greedy else ("sample", request.temperature, request.top_p)
        return (*sampling, self.stamp.key.fingerprint)


class FairBacklog:
    """Generation jobs waiting for the model, one queue per user, served in turns.

    ``next_batch`` starts a batch with the oldest job of the user whose turn it is (that user then
    goes to the back of the rotation), and fills the rest of the batch taking one compatible job
    per user per pass, in turn order. A user with many queued jobs thus gets the model as often as
    a user with one, never all of it ahead of them. Jobs without a user (``user_id`` None: direct
    callers such as benchmarks) share one queue, in arrival order.
    """

    def __init__(self) -> None:
        self._queues: dict[int | None, deque[Job]] = {}
        self._turns: deque[int | None] = deque()  # users with waiting jobs, whose turn comes first first

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def __iter__(self) -> Iterator[Job]:
        for queue in self._queues.values():
            yield from queue

    def add(self, job: Job) -> None:
        user = job.request.user_id
        queue = self._queues.get(user)
        if queue is None:
            queue = self._queues[user] = deque()
            self._turns.append(user)
        queue.append(job)

    def _take(self, user: int | None, job: Job) -> None:
        queue = self._queues[user]
        queue.remove(job)
        if not queue:
            del self._queues[user]
            self._turns.remove(user)

    def next_batch(self, max_rows: int) -> list[Job]:
        """The jobs of the next ``generate`` call (at least one; none when nothing waits)."""
        batch = self.peek_batch(max_rows)
        if not batch:
            return []
        user = batch[0].request.user_id
        for job in batch:
            self._take(job.request.user_id, job)
        if user in self._queues:  # still has jobs: to the back of the rotation
            self._turns.remove(user)
            self._turns.append(user)
        return batch

    def peek_batch(self, max_rows: int) -> list[Job]:
        """What ``next_batch`` would return now, leaving every job waiting (the worker reads
        their prompts ahead while another batch decodes)."""
        if not self._turns:
            return []
        user = self._turns[0]
        first = self._queues[user][0]
        batch, rows, key = [first], first.rows, first.batch_key()
        if key is None:
            return batch
        # the fill goes round the users in turn order, the first user now last
        turns = [*list(self._turns)[1:], user]
        taken = {id(first)}
        added = True
        while added and rows < max_rows:
            added = False
            for other in turns:
                job = next(
                    (
                        j
                        for j in self._queues[other]
                        if id(j) not in taken and j.batch_key() == key and rows + j.rows <= max_rows
                    ),
                    None,
                )
                if job is not None:
                    taken.add(id(job))
                    batch.append(job)
                    rows += job.rows
                    added = True
        return batch


def deliver_to_loop(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[StreamEvent]
) -> Callable[[StreamEvent], None]:
    """A thread-safe callback that puts events on an asyncio queue owned by ``loop``."""

    def deliver(event: StreamEvent) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            loop.call_soon_threadsafe(queue.put_nowait, event)

    return deliver


def logprobs_wanted(request: GenerationRequest) -> tuple[bool, int]:
    """(whether the request asked for log-probabilities, how many alternatives per token)."""
    wanted = bool(request.options.get("logprobs"))
    top = request.options.get("top_logprobs") or 0
    return wanted, int(top) if wanted and isinstance(top, int) else 0


class LogprobCapture(LogitsProcessor):
    """Keeps the log-probabilities of each decoding step for ``RowTracker``, changing nothing.

    It runs first in the processor list, so it sees the model's own distribution: before the
    watermark bias and before temperature and top-p (transformers applies those warpers after
    every custom processor), as vLLM's default ``raw_logprobs`` mode reports them.
    """

    def __init__(self, top: int) -> None:
        self._top = top
        self.logprobs: torch.Tensor | None = None  # [rows, vocab] float32, the latest step
        self.top_values: torch.Tensor | None = None  # [rows, top] float32
        self.top_ids: torch.Tensor | None = None  # [rows, top] int64

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # scores: [rows, vocab] logits of the next token
        self.logprobs = torch.log_softmax(scores.float(), dim=-1)
        if self._top:
            self.top_values, self.top_ids = self.logprobs.topk(self._top, dim=-1)
        return scores


@dataclass
class _Row:
    job: Job
    choice_index: int
    max_tokens: int
    detokenizer: IncrementalDetokenizer
    stop_buffer: StopStringBuffer
    tokens: int = 0
    done: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # logprobs entries of tokens whose text has not been delivered yet
    pending: list[dict[str, object]] = field(default_factory=list)


class RowTracker(StoppingCriteria):
    """Per-row streaming, stop strings, limits and cancellation for one batched ``generate``."""

    def __init__(
        self,
        jobs: Sequence[Job],
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: set[int],
        prompt_length: int,
        capture: LogprobCapture | None = None,
    ) -> None:
        self._rows: list[_Row] = [
            _Row(
                job=job,
                choice_index=i,
                max_tokens=job.request.max_tokens,
                detokenizer=IncrementalDetokenizer(tokenizer),
                stop_buffer=StopStringBuffer(job.request.stop),
                logprobs=logprobs_wanted(job.request)[0],
                top_logprobs=logprobs_wanted(job.request)[1],
            )
            for job in jobs
            for i in range(job.rows)
        ]
        self._tokenizer = tokenizer
        self._capture = capture
        self._eos_ids = eos_ids
        self._prompt_length = prompt_length
        self._done = torch.zeros(len(self._rows), dtype=torch.bool)

    def _deliver(self, row: _Row, text: str, reason: FinishReason | None = None) -> None:
        entries, row.pending = tuple(row.pending), []
        stop = row.stop_buffer.matched if reason is FinishReason.STOP else None
        row.job.deliver(ChoiceDelta(row.choice_index, text, row.tokens, reason, logprobs=entries, stop_sequence=stop))

    def _finish(self, row_number: int, row: _Row, reason: FinishReason, text: str = "") -> None:
        row.done = True
        self._done[row_number] = True
        self._deliver(row, text, reason)

    def _entry(self, token_id: int) -> dict[str, object]:
        piece = cast("str", self._tokenizer.decode([token_id]))  # one id: one string
        return {"token": piece, "bytes": list(piece.encode("utf-8"))}

    def _note_logprobs(self, row_number: int, row: _Row, token_id: int) -> None:
        """OpenAI's logprobs entry of the row's newest token (``LogprobCapture``'s latest step)."""
        capture = self._capture
        if capture is None or capture.logprobs is None:
            return
        entry = self._entry(token_id) | {"logprob": float(capture.logprobs[row_number, token_id])}
        alternatives: list[dict[str, object]] = []
        if row.top_logprobs and capture.top_values is not None and capture.top_ids is not None:
            values = capture.top_values[row_number, : row.top_logprobs].tolist()
            ids = capture.top_ids[row_number, : row.top_logprobs].tolist()
            alternatives = [self._entry(int(t)) | {"logprob": float(v)} for t, v in zip(ids, values, strict=True)]
        entry["top_logprobs"] = alternatives
        row.pending.append(entry)

    def _step_row(self, row_number: int, row: _Row, token_id: int) -> None:
        if row.job.cancelled.is_set():
            self._finish(row_number, row, FinishReason.CANCELLED)
            return
        row.tokens += 1
        if row.logprobs:
            self._note_logprobs(row_number, row, token_id)
        if token_id in self._eos_ids:
            tail = row.stop_buffer.push(row.detokenizer.flush())[0] + row.stop_buffer.flush()
            self._finish(row_number, row, FinishReason.STOP, tail)
            return
        text, stopped = row.stop_buffer.push(row.detokenizer.push(token_id))
        if stopped:
            self._finish(row_number, row, FinishReason.STOP, text)
        elif row.tokens >= row.max_tokens:
            tail, stopped = row.stop_buffer.push(row.detokenizer.flush())
            tail = text + tail + ("" if stopped else row.stop_buffer.flush())
            self._finish(row_number, row, FinishReason.STOP if stopped else FinishReason.LENGTH, tail)
        elif text:
            self._deliver(row, text)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: object) -> torch.BoolTensor:
        # input_ids: [rows, prompt_length + generated] int64; the last column is the newest token.
        if input_ids.shape[1] > self._prompt_length:
            newest = input_ids[:, -1].tolist()
            for row_number, row in enumerate(self._rows):
                if not row.done:
                    self._step_row(row_number, row, int(newest[row_number]))
        return cast("torch.BoolTensor", self._done.clone())  # _done: [rows] bool

    def cancel_unfinished(self) -> None:
        """Close rows that ``generate`` left open when it returned (it stopped for a reason of its
        own). Not after it raised: those rows failed, and must not look finished."""
        for row_number, row in enumerate(self._rows):
            if not row.done:
                tail, stopped = row.stop_buffer.push(row.detokenizer.flush())
                tail += "" if stopped else row.stop_buffer.flush()
                reason = FinishReason.CANCELLED if row.job.cancelled.is_set() else FinishReason.LENGTH
                self._finish(row_number, row, FinishReason.STOP if stopped else reason, tail)


class BetweenSteps(StoppingCriteria):
    """Runs ``work`` after every decoding step of a ``generate`` call and stops no row: the seam
    where the worker reads a slice of the next batch's prompts (chunked prefill)."""

    def __init__(self, rows: int, work: Callable[[], None]) -> None:
        self._rows = rows
        self._work = work

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: object) -> torch.BoolTensor:
        self._work()
        return cast("torch.BoolTensor", torch.zeros(self._rows, dtype=torch.bool))  # [rows] bool
