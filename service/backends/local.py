"""In-process transformers backend (CPU), the embedded default.

One dedicated worker thread owns the model: it loads it (``ready`` flips afterwards), then takes
jobs from a queue, groups compatible ones into one batched ``generate`` call and streams the text
of every row back to the event loop. The event loop never runs model code. Every row carries the
XMark watermark of its own caller's message; nobody's output is left unmarked. ``/trace``'s
scoring jobs (one forward pass over a suspect text) go through the same queue; those waiting
together share one batched forward pass, ahead of the next generation. Waiting generation jobs
are taken in turns per user (``batch.FairBacklog``). A generation that fails ends its streams
with ``BackendError``; the rows it had produced are not reported as finished.

Prompts are read in slices of at most ``prefill_chunk_tokens`` tokens (``prefill``): while a
batch decodes, each of its steps is followed by one slice of the next batch's prompts, so a long
prompt neither stalls the running rows nor, once its client has left, holds the model past its
next slice (its cache is dropped then). Scoring jobs run between the slices of a batch's prompts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.backends.attention import use_grouped_sdpa
from service.backends.base import (
    LOAD_LOCK,
    BackendError,
    ChoiceDelta,
    GenerationRequest,
    GenerationResult,
    WatermarkStamp,
    collect,
)
from service.backends.batch import (
    BetweenSteps,
    FairBacklog,
    Job,
    LogprobCapture,
    RowTracker,
    StreamEnd,
    StreamEvent,
    StreamFailure,
    deliver_to_loop,
    logprobs_wanted,
)
from service.backends.fields import DEFAULT_HONOURED
from service.backends.penalties import penalty_processor, sampling_penalties
from service.backends.prefill import (
    DEFAULT_PREFILL_CHUNK_TOKENS,
    batch_cache,
    prefill_done,
    prefill_slice,
    release,
)
from service.backends.scoring import ScorerDtype, resolve_scorer_dtype, score_texts, scoring_model
from service.errors import InvalidRequestError, ServiceUnavailableError, UpstreamUnavailableError
from service.vocabulary import FinishReason
from xmark_core.params import SCHEMES

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from xmark_core import ModelScores, WatermarkKey
    from xmark_core.encoder import TorchWatermarker

logger = logging.getLogger(__name__)

MAX_BATCH_ROWS = 8
# scoring jobs that share one forward pass: at most this many tokens in all (padding included)
MAX_SCORE_BATCH_TOKENS = 8192
# key versions whose op (and token codes) the worker keeps; more are rebuilt when next used
MAX_KEY_VERSIONS = 8


@dataclass(eq=False)
class ScoreJob:
    """A text to score (``Backend.score``); the worker thread sets ``result``."""

    token_ids: list[int]
    top_k: int
    result: concurrent.futures.Future[ModelScores] = field(default_factory=concurrent.futures.Future)


def default_threads() -> int:
    """Intra-op threads for the model: every core but one.

    The event loop (HTTP, database, /trace) shares the machine. If torch claimed every core, its
    threads would spin at their barriers while the loop held one of them, and decoding slows
    down by an order of magnitude under such contention.
    """
    return max(1, len(os.sched_getaffinity(0)) - 1)


class LocalStream:
    """Deltas of one job, read on the event loop."""

    def __init__(self, job: Job, events: asyncio.Queue[StreamEvent], prompt_tokens: int) -> None:
        self._job = job
        self._events = events
        self._open_choices = job.request.n
        self.prompt_tokens = prompt_tokens

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> ChoiceDelta:
        if self._open_choices == 0:
            raise StopAsyncIteration
        event = await self._events.get()
        if isinstance(event, StreamFailure):
            self._open_choices = 0
            if event.retryable:
                raise UpstreamUnavailableError(event.message)
            raise BackendError(event.message)
        if isinstance(event, StreamEnd):
            self._open_choices = 0
            raise StopAsyncIteration
        if event.finish_reason is not None:
            self._open_choices -= 1
        return event

    def cancel(self) -> None:
        self._job.cancelled.set()

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens in the job's cache now: read ahead of its batch's ``generate`` call (which
        reads the last one), in slices; 0 again once the cache is released (the job ran, failed or
        was cancelled)."""
        return self._job.prefilled

    @property
    def prefill_slices(self) -> int:
        """Slices of the prompt read so far (``LocalBackend.prefill_chunk_tokens`` tokens each, or fewer)."""
        return self._job.slices


class LocalBackend:
    """The served model, run by transformers on this machine's CPU."""

    # log-probabilities from the model's own distribution (``batch.LogprobCapture``); penalties and
    # logit_bias per row (``penalties.PenaltyProcessor``)
    honoured_fields = DEFAULT_HONOURED | {
        "logprobs",
        "top_logprobs",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
    }
    # every scheme: the biasing ones through the op, ``gumbel`` by keyed sampling at the request's temperature
    schemes = frozenset(SCHEMES)
    salts_per_answer = True
    # the stamp's key is the encoder the gateway chose: the batch's processor runs whichever it is
    encoders_per_request = True

    def __init__(
        self,
        model_path: Path,
        model_id: str,
        *,
        max_batch_rows: int = MAX_BATCH_ROWS,
        threads: int | None = None,
        scorer_dtype: ScorerDtype = "auto",
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
    ) -> None:
        if prefill_chunk_tokens <= 0:
            raise ValueError("prefill_chunk_tokens must be positive")
        self.model_id = model_id
        # the most prompt tokens read per model step (one prefill slice); read by the worker at
        # every slice
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._scorer_dtype: ScorerDtype = scorer_dtype
        self._threads = threads if threads is not None else default_threads()
        self._model_path = model_path
        self._max_batch_rows = max_batch_rows
        self._inbox: queue.Queue[Job | ScoreJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._model: PreTrainedModel | None = None
        self._scorer: PreTrainedModel | None = None  # the /trace forward pass (scoring_model)
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._eos_ids: set[int] = set()
        self._context_length = 0
        self._vocab_size = 0  # the width of the model's logits: logit_bias keys are below it
        self._running: list[Job] = []  # jobs of the batch on the model right now (worker thread)
        # waiting work, owned by the worker thread
        self._backlog = FairBacklog()
        self._scoring: list[ScoreJob] = []
        # prompts encoded by count_prompt_tokens, reused by stream for the same request object
        self._encoded: weakref.WeakKeyDictionary[GenerationRequest, list[int]] = weakref.WeakKeyDictionary()
        self._loaded = threading.Event()
        self._closing = threading.Event()
        self.load_error: str | None = None
        # the watermark op per key version (by fingerprint), kept across batches (worker thread)
        self._markers: dict[str, TorchWatermarker] = {}
        self.watermark_op = ""  # "cpp" (xmark_core.cpu_op) or "eager", once loaded

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._loaded.is_set() and self._model is not None and not self._closing.is_set()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self._tokenizer

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="xmark-local-model", daemon=True)
        self._thread.start()

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the model is loaded (or failed to load); True when ready."""
        await asyncio.to_thread(self._loaded.wait, timeout)
        return self.ready

    async def close(self) -> None:
        self._closing.set()
        for job in list(self._running):
            job.cancelled.set()  # the batch on the model stops at its next token
        self._inbox.put(None)
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join, 60.0)

    def _load(self) -> None:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(self._threads)
        tokenizer = AutoTokenizer.from_pretrained(self._model_path, local_files_only=True)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self._tokenizer = tokenizer
        model = AutoModelForCausalLM.from_pretrained(self._model_path, local_files_only=True, dtype=torch.float32)
        model.eval()
        use_grouped_sdpa(model)  # the KV cache read in place, not copied per step (backends.attention)
        eos = model.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self._eos_ids = eos_ids
        self._context_length = int(getattr(model.config, "max_position_embeddings", 2048))
        self._vocab_size = int(model.config.vocab_size)
        # the C++ watermark op: built once per machine (`make venv` builds it), loaded here so that
        # no request waits for it; where it cannot be built the eager op serves
        from xmark_core import cpu_op

        self.watermark_op = "cpp" if cpu_op.load() is not None else "eager"
        self._warm_up(model, tokenizer)
        scorer = scoring_model(model, resolve_scorer_dtype(self._scorer_dtype))
        score_texts(scorer, int(tokenizer.pad_token_id), [[int(tokenizer.pad_token_id)] * 8], 1)  # warm up
        self._scorer = scorer
        self._model = model

    @staticmethod
    def _warm_up(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        """Run one tiny generation so the first request does not pay for lazy initialisation."""
        import torch
        from transformers import GenerationConfig

        ids: Any = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        input_ids = torch.tensor([list(ids)], dtype=torch.long)  # [1, prompt] int64
        config = GenerationConfig(max_new_tokens=2, do_sample=True, top_k=0, pad_token_id=tokenizer.pad_token_id)
        with torch.inference_mode():
            # transformers types generate through nn.Module.__getattr__ (Tensor | Module)
            model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)  # type: ignore[operator]

    def _run(self) -> None:
        try:
            with LOAD_LOCK:
                self._load()
            scorer = self._scorer
            dtype = "" if scorer is None else str(next(scorer.parameters()).dtype).removeprefix("torch.")
            logger.info(
                "local model loaded",
                extra={"model": self.model_id, "scorer_dtype": dtype, "watermark_op": self.watermark_op},
            )
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            logger.error("local model failed to load", extra={"model": self.model_id, "error": self.load_error})
            return
        finally:
            self._loaded.set()
        self._serve()

    # -- request side (event loop) -----------------------------------------------------------

    def _encode_prompt(self, request: GenerationRequest) -> list[int]:
        tokenizer = self._tokenizer
        assert tokenizer is not None
        if request.prompt is not None:  # /v1/completions: the text as it is
            return [int(token) for token in tokenizer(request.prompt)["input_ids"]]
        conversation = [{"role": turn.role, "content": turn.content} for turn in request.messages]
        encoded: Any = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        if hasattr(encoded, "keys"):
            encoded = encoded["input_ids"]
        return [int(token) for token in encoded]

    def _check_ready(self) -> None:
        if not self.ready:
            if self.load_error is not None:
                raise ServiceUnavailableError("The model backend is unavailable", code="backend_failed")
            raise ServiceUnavailableError("The model is still loading; retry shortly")

    async def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        ids = self._encoded.get(request)
        if ids is None:
            ids = await asyncio.to_thread(self._encode_prompt, request)
            self._encoded[request] = ids
        return ids

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """Encodes the prompt off the event loop; ``stream`` of the same request reuses the ids."""
        self._check_ready()
        return len(await self._prompt_ids(request))

    async def prompt_token_bound(self, request: GenerationRequest) -> int:
        """The exact count: ``stream`` needs the prompt's ids anyway (and reuses these)."""
        return await self.count_prompt_tokens(request)

    def check_options(self, options: Mapping[str, Any]) -> None:
        """Raise the 400 ``invalid_value`` a request's penalties or ``logit_bias`` earn
        (``sampling_penalties``); the gateway calls it before the request is admitted."""
        self._check_ready()
        sampling_penalties(options, self._vocab_size)

    async def stream(self, request: GenerationRequest, stamp: WatermarkStamp) -> LocalStream:
        self._check_ready()
        prompt_ids = await self._prompt_ids(request)
        self._encoded.pop(request, None)
        if len(prompt_ids) + request.max_tokens > self._context_length:
            raise InvalidRequestError(
                f"The prompt ({len(prompt_ids)} tokens) plus max_tokens ({request.max_tokens}) exceeds "
                f"the model's context length of {self._context_length} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        sampling_penalties(request.options, self._vocab_size)  # a bad value is a 400 here, never queued
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        job = Job(request, stamp, prompt_ids, deliver_to_loop(asyncio.get_running_loop(), events))
        self._inbox.put(job)
        return LocalStream(job, events, len(prompt_ids))

    async def generate(self, request: GenerationRequest, stamp: WatermarkStamp) -> GenerationResult:
        return await collect(await self.stream(request, stamp), request.n)

    async def score(self, token_ids: Sequence[int], top_k: int) -> ModelScores:
        self._check_ready()
        if len(token_ids) > self._context_length:
            raise InvalidRequestError(
                f"The text has {len(token_ids)} tokens; the model reads at most {self._context_length}",
                param="text",
                code="context_length_exceeded",
            )
        job = ScoreJob([int(t) for t in token_ids], top_k)
        self._inbox.put(job)
        try:
            return await asyncio.wrap_future(job.result)
        except asyncio.CancelledError:
            job.result.cancel()  # not started yet: the worker skips it
            raise

    # -- worker thread -----------------------------------------------------------------------

    def _gather(self) -> None:
        """Move everything already waiting in the inbox to the backlog or the scoring list,
        without blocking (a shutdown signal stays in the inbox for ``_next_batch``)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._inbox.put(None)  # keep the shutdown signal for the next round
                return
            if isinstance(item, ScoreJob):
                self._scoring.append(item)
            else:
                self._backlog.add(item)

    def _next_batch(self) -> list[Job] | list[ScoreJob] | None:
        """Every waiting scoring job, or else the next generation batch (``FairBacklog``: the
        oldest job of the user whose turn it is, and compatible jobs of users in turn)."""
        backlog, scoring = self._backlog, self._scoring
        if not backlog and not scoring:
            first = self._inbox.get()
            if first is None:
                return None
            if isinstance(first, ScoreJob):
                scoring.append(first)
            else:
                backlog.add(first)
        self._gather()
        if scoring:
            return self._take_scoring()
        return backlog.next_batch(self._max_batch_rows)

    def _take_scoring(self) -> list[ScoreJob]:
        scoring = self._scoring
        taken: list[ScoreJob] = []
        while scoring and (not taken or self._score_tokens([*taken, scoring[0]]) <= MAX_SCORE_BATCH_TOKENS):
            taken.append(scoring.pop(0))
        return taken

    @staticmethod
    def _score_tokens(jobs: Sequence[ScoreJob]) -> int:
        return len(jobs) * max(len(job.token_ids) for job in jobs)

    def _serve(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None or self._closing.is_set():
                for job in [*(batch or []), *self._backlog, *self._scoring]:
                    self._refuse(job)
                self._drain_on_shutdown()
                return
            if batch and isinstance(batch[0], ScoreJob):
                self._run_scoring([job for job in batch if isinstance(job, ScoreJob)])
                continue
            live = self._without_cancelled([job for job in batch if isinstance(job, Job)])
            if not live:
                continue
            self._running = live
            try:
                live = self._prefill(live)
                if live:
                    self._running = live
                    self._generate_batch(live)
            except Exception as exc:
                # the client gets a 5xx (or an error event), and the record says error: never a
                # completion cut short that looks finished
                logger.exception("generation failed", extra={"error_type": type(exc).__name__})
                for job in live:
                    job.deliver(StreamFailure("Generation failed in the model backend"))
            finally:
                for job in live:
                    release(job)
                self._running = []

    @staticmethod
    def _without_cancelled(jobs: list[Job]) -> list[Job]:
        """``jobs`` less those whose clients left, which end here as cancelled (cache dropped)."""
        live = []
        for job in jobs:
            if job.cancelled.is_set():
                release(job)
                for index in range(job.rows):
                    job.deliver(ChoiceDelta(index, "", 0, FinishReason.CANCELLED))
            else:
                live.append(job)
        return live

    def _prefill(self, jobs: list[Job]) -> list[Job]:
        """Read the rest of the batch's prompts (``prefill``), one slice at a time; between two
        slices a job whose client left is dropped, and waiting scoring jobs run. Returns the jobs
        still live."""
        model = self._model
        assert model is not None
        while True:
            if self._closing.is_set():
                for job in jobs:
                    job.cancelled.set()  # as ``close`` does to the batch on the model
            jobs = self._without_cancelled(jobs)
            if not jobs or all(prefill_done(job) for job in jobs):
                return jobs
            prefill_slice(model, jobs, self.prefill_chunk_tokens)
            self._gather()
            if self._scoring:
                self._run_scoring(self._take_scoring())

    def _between_steps(self) -> None:
        """After each decoding step of a batch: one prefill slice of the batch that would run
        next. A failure here is not the running batch's: the jobs read start again with their
        own batch, which reports it if it recurs."""
        model = self._model
        assert model is not None
        self._gather()
        upcoming = self._backlog.peek_batch(self._max_batch_rows)
        for job in upcoming:
            if job.cancelled.is_set():
                release(job)  # its client left: the cache goes now, the stream ends with its batch
        if self._closing.is_set() or all(prefill_done(job) or job.cancelled.is_set() for job in upcoming):
            return
        try:
            prefill_slice(model, upcoming, self.prefill_chunk_tokens)
        except Exception as exc:
            logger.warning("prefill failed", extra={"error_type": type(exc).__name__})
            for job in upcoming:
                release(job)

    @staticmethod
    def _refuse(job: Job | ScoreJob) -> None:
        if isinstance(job, ScoreJob):
            if job.result.set_running_or_notify_cancel():
                job.result.set_exception(ServiceUnavailableError("The model backend is shutting down"))
        else:
            job.deliver(StreamFailure("The model backend is shutting down", retryable=True))

    def _drain_on_shutdown(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._refuse(item)

    def _run_scoring(self, jobs: list[ScoreJob]) -> None:
        live = [job for job in jobs if job.result.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            results = self._score_batch(live)
        except Exception as exc:
            logger.exception("scoring failed", extra={"error_type": type(exc).__name__})
            for job in live:
                job.result.set_exception(UpstreamUnavailableError("Scoring failed in the model backend"))
            return
        for job, scores in zip(live, results, strict=True):
            job.result.set_result(scores)

    def _score_batch(self, jobs: list[ScoreJob]) -> list[ModelScores]:
        """One forward pass over every job's text (``scoring.score_texts``)."""
        model, tokenizer = self._scorer, self._tokenizer
        assert model is not None and tokenizer is not None
        top_k = max(job.top_k for job in jobs)
        scores = score_texts(model, int(tokenizer.pad_token_id), [job.token_ids for job in jobs], top_k)
        return [s if job.top_k == top_k else s.top(job.top_k) for job, s in zip(jobs, scores, strict=True)]

    def _watermarker(self, key: WatermarkKey) -> TorchWatermarker:
        """The op for one key version, kept across batches so its token codes are computed once:
        the C++ op on the float32 logits (``xmark_core.cpu_op``), the eager op where it cannot be built."""
        from xmark_core.encoder import TorchWatermarker

        marker = self._markers.get(key.fingerprint)
        if marker is None:
            if len(self._markers) >= MAX_KEY_VERSIONS:  # retired versions: drop the oldest
                del self._markers[next(iter(self._markers))]
            marker = self._markers[key.fingerprint] = TorchWatermarker(key, native_on_cpu=True)
        return marker

    def _generate_batch(self, jobs: list[Job]) -> None:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        from xmark_core.hf import XMarkLogitsProcessor

        model, tokenizer = self._model, self._tokenizer
        assert model is not None and tokenizer is not None
        first = jobs[0].request
        pad_id = int(tokenizer.pad_token_id)
        prompts = [job.prompt_ids for job in jobs for _ in range(job.rows)]
        messages = [job.stamp.message for job in jobs for _ in range(job.rows)]
        width = max(len(p) for p in prompts)
        # input_ids / attention_mask: [rows, width] int64, left-padded
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        wanted = [logprobs_wanted(job.request) for job in jobs]
        capture = LogprobCapture(max(top for _, top in wanted)) if any(w for w, _ in wanted) else None
        tracker = RowTracker(jobs, tokenizer, self._eos_ids, width, capture)
        # checked by ``stream``; each row with its own job's values
        penalties = penalty_processor(
            [sampling_penalties(job.request.options, self._vocab_size) for job in jobs for _ in range(job.rows)], width
        )
        config = GenerationConfig(
            max_new_tokens=max(job.request.max_tokens for job in jobs),
            do_sample=not first.greedy,
            temperature=None if first.greedy else first.temperature,
            top_p=None if first.greedy else first.top_p,
            top_k=None if first.greedy else 0,
            num_beams=1,
            pad_token_id=pad_id,
            eos_token_id=sorted(self._eos_ids),
        )
        key = jobs[0].stamp.key
        # ``gumbel`` samples itself at the batch's temperature and top_p (0 leaves a greedy row alone;
        # the gateway refuses greedy requests under such a key version before they get here)
        temperature = (0.0 if first.greedy else first.temperature) if key.params.distortion_free else None
        salts = None
        if key.params.salts > 1:  # answer j of a job: its stamp's salt + j (service.salts)
            salts = [(job.stamp.salt + j) % key.params.salts for job in jobs for j in range(job.rows)]
        processor = XMarkLogitsProcessor(
            key,
            messages,
            watermarker=self._watermarker(key),
            temperature=temperature,
            top_p=None if first.greedy else first.top_p,
            salts=salts,
        )
        seed = first.seed if len(jobs) == 1 else None
        between_steps = BetweenSteps(len(prompts), self._between_steps)
        with torch.inference_mode():
            if seed is not None:
                torch.manual_seed(seed)
            try:
                model.generate(  # type: ignore[operator]  # typed through nn.Module.__getattr__
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    # the prompts but their last tokens, read ahead in slices (``_prefill``)
                    past_key_values=batch_cache(model, jobs, width),
                    generation_config=config,
                    # the capture first: it reads the model's own distribution; then the penalties, on
                    # the raw logits, before the watermark (whose gumbel choice sees them)
                    logits_processor=LogitsProcessorList(p for p in (capture, penalties, processor) if p is not None),
                    # the tracker first: a row's token reaches its client before the next slice
                    stopping_criteria=StoppingCriteriaList([tracker, between_steps]),
                )
            finally:
                if seed is not None:
                    torch.seed()  # later unseeded requests must not be predictable
        tracker.cancel_unfinished()  # only when generate returned: rows of a failed call failed
