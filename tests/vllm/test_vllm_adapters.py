"""The vLLM V1 and V2 adapters against each other and against the transformers adapter.

The V2 runner needs a GPU (Triton); its inputs (``req_states`` buffers, ``LogitsContext``) are
built here directly from CPU tensors with the layout the 0.32 runner uses, and every adapter
must produce bit-identical logits for the same batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

# a submodule: tests/vllm itself would pass for a namespace package named vllm
pytest.importorskip(
    "vllm.sampling_params", reason="vLLM is not installed in this interpreter (make test-vllm installs it)"
)

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import (
    BatchUpdate,
    MoveDirectionality,
    validate_logits_processors_parameters,
)
from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns as load_v1_classes
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    LogitsProcRequestState,
    build_custom_logits_processors_params_validator,
)
from vllm.v1.worker.gpu.sample.logits_processor.loader import (
    _load_v2_logitsprocs_by_fqcns as load_v2_classes,
)

from tests.vllm.conftest import WORKER_SECRETS
from xmark_core import (
    Message,
    WatermarkKey,
    vllm_common,
)
from xmark_core.encoders import DEFAULT_MESSAGE_BITS, KeyVersionSpec
from xmark_core.hf import XMarkLogitsProcessor as HFProcessor
from xmark_core.vllm_common import (
    ENV_BLOCK_BITS,
    ENV_MIN_ENTROPY,
    ENV_NUM_KEYS,
    ENV_SCHEME,
    ENV_SECRETS,
    WorkerConfigError,
    WorkerKeyring,
    worker_keyring,
)
from xmark_core.vllm_v1 import XMarkLogitsProcessor as V1Processor
from xmark_core.vllm_v2 import XMarkLogitsProcessor as V2Processor

pytestmark = pytest.mark.vllm

V1_FQCN = "xmark_core.vllm_v1:XMarkLogitsProcessor"
V2_FQCN = "xmark_core.vllm_v2:XMarkLogitsProcessor"
VOCAB = 49152  # SmolLM2's vocabulary
MAX_SLOTS = 8
MAX_MODEL_LEN = 64

# messages of the worker's default length (the gateway's, DEFAULT_MESSAGE_BITS = 64): 32-bit patterns twice
MESSAGES_32 = [
    "01101100000110111001001101100100",
    "11110000101001010000111101011010",
    "00000000000000000000000000000000",
    None,
    "10101010101010100101010101010101",
    "00110011001100111100110011001100",
]
MESSAGES = [None if m is None else m * 2 for m in MESSAGES_32]
assert DEFAULT_MESSAGE_BITS == 64
# (prompt, output so far) per batch row: fresh prompts, long outputs, a one-token prompt, a resumed one
HISTORIES: list[tuple[list[int], list[int]]] = [
    ([1, 9, 3021, 44], []),
    ([1, 9, 77], [5012, 14, 2]),
    ([31], []),
    ([1, 2, 3, 4, 5], [6, 7]),
    ([1, 9, 3021, 44], [49151]),
    ([12, 0], [0, 0, 0, 1]),
]


def xargs(bits: str | None, version: str = "v1") -> dict[str, Any] | None:
    return None if bits is None else {"xmark_message": bits, "xmark_key_version": version}


def params_for(bits: str | None, version: str = "v1") -> SamplingParams:
    return SamplingParams(max_tokens=8, extra_args=xargs(bits, version))


def logits_for(batch: int, seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, VOCAB, generator=generator)  # [B, V] float32


@dataclass
class DeviceBuffer:
    """Stands in for the runner's StagedWriteTensor / UvaBackedTensor: ``gpu`` is the device view."""

    gpu: torch.Tensor

    @property
    def np(self) -> np.ndarray:
        return self.gpu.numpy()


class V2Runner:
    """The slice of the 0.32 V2 runner a logits processor sees, on CPU tensors."""

    def __init__(self, keyring: WorkerKeyring) -> None:
        self.all_token_ids = torch.zeros((MAX_SLOTS, MAX_MODEL_LEN), dtype=torch.int32)
        self.total_len = torch.zeros(MAX_SLOTS, dtype=torch.int32)
        self.prompt_len = torch.zeros(MAX_SLOTS, dtype=torch.int32)
        self.req_states = LogitsProcRequestState(
            device=torch.device("cpu"),
            max_num_reqs=MAX_SLOTS,
            vocab_size=VOCAB,
            # arg-type: DeviceBuffer stands in for the runner's staged / UVA-backed buffer classes
            all_token_ids=DeviceBuffer(self.all_token_ids),  # type: ignore[arg-type]
            prompt_len=DeviceBuffer(self.prompt_len),  # type: ignore[arg-type]
            prefill_len=DeviceBuffer(self.prompt_len.clone()),  # type: ignore[arg-type]
            total_len=DeviceBuffer(self.total_len),  # type: ignore[arg-type]
        )
        self.processor = V2Processor(VllmConfig(), self.req_states)

    def admit(self, slot: int, params: SamplingParams, prompt: list[int], output: list[int]) -> bool:
        """add_request as the runner does it: (re)fill the slot's history, stage the processor."""
        history = prompt + output
        self.all_token_ids[slot].zero_()
        self.all_token_ids[slot, : len(history)] = torch.tensor(history, dtype=torch.int32)
        self.total_len[slot] = len(history)
        self.prompt_len[slot] = len(prompt)
        return self.processor.add_request(slot, params)

    def commit(self, slot: int, token: int) -> None:
        """post_update: the sampled token joins the device-side history."""
        self.all_token_ids[slot, int(self.total_len[slot])] = token
        self.total_len[slot] += 1

    def step(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        self.processor.apply_staged_writes()
        mapping = torch.tensor(slots, dtype=torch.int32)
        total = self.total_len[mapping.clamp(min=0).long()]
        ctx = LogitsContext(
            expanded_idx_mapping=mapping,
            idx_mapping=mapping,
            idx_mapping_np=mapping.numpy().copy(),
            expanded_local_pos=torch.zeros(len(slots), dtype=torch.int32),
            input_ids=self.all_token_ids[mapping.clamp(min=0).long(), (total - 1).clamp(min=0).long()],
            pos=(total - 1).clamp(min=0),
            seq_lens_upper_bound_np=total.numpy().copy(),
        )
        return self.processor.apply(logits, ctx)


def v1_processor(config: VllmConfig | None = None) -> V1Processor:
    return V1Processor(config or VllmConfig(), torch.device("cpu"), False)


def v1_with(params: list[SamplingParams]) -> V1Processor:
    """A V1 processor holding one row per HISTORIES entry, row i with ``params[i]``."""
    processor = v1_processor()
    added = [(row, params[row], list(p), list(o)) for row, (p, o) in enumerate(HISTORIES)]
    processor.update_state(BatchUpdate(batch_size=len(HISTORIES), removed=[], added=added, moved=[]))
    return processor


def v1_step(processor: V1Processor, logits: torch.Tensor) -> torch.Tensor:
    return processor.apply(logits)


def hf_step(
    key: WatermarkKey, messages: list[str | None], histories: list[list[int]], logits: torch.Tensor
) -> torch.Tensor:
    width = max(len(h) for h in histories)
    input_ids = torch.tensor([[0] * (width - len(h)) + h for h in histories], dtype=torch.long)  # [B, width]
    processor = HFProcessor(key, [None if m is None else Message.from_bits(m, key.params) for m in messages])
    return processor(input_ids, logits)


# -- the three adapters agree ----------------------------------------------------------------


def test_v2_equals_v1_equals_transformers_for_one_batch(keyring: WorkerKeyring) -> None:
    batch = len(HISTORIES)
    base = logits_for(batch)

    out_v1 = v1_step(v1_with([params_for(m) for m in MESSAGES]), base.clone())

    runner = V2Runner(keyring)
    slots = [5, 2, 7, 0, 3, 6]  # rows map to arbitrary persistent slots
    declared = [runner.admit(slot, params_for(MESSAGES[row]), *HISTORIES[row]) for row, slot in enumerate(slots)]
    assert declared == [m is not None for m in MESSAGES]
    out_v2 = runner.step(base.clone(), slots)

    out_hf = hf_step(keyring.keys[0], MESSAGES, [p + o for p, o in HISTORIES], base.clone())

    assert torch.equal(out_v1, out_hf)
    assert torch.equal(out_v2, out_hf)
    delta = keyring.params.delta
    for row, message in enumerate(MESSAGES):
        changed = out_v2[row] != base[row]
        if message is None:
            assert not changed.any()
        else:  # δ on the evergreen list only: about (3/4)^k of the vocabulary
            assert torch.allclose(out_v2[row][changed] - base[row][changed], torch.tensor(delta))
            assert abs(changed.float().mean().item() - 0.75**keyring.params.num_keys) < 0.06


def test_rows_with_different_key_versions_in_one_batch(keyring: WorkerKeyring) -> None:
    versions = ["v1", "v2", "v1", "v2", "v2", "v1"]
    batch = len(HISTORIES)
    base = logits_for(batch, seed=11)

    out_v1 = v1_step(v1_with([params_for(m, v) for m, v in zip(MESSAGES, versions, strict=True)]), base.clone())

    runner = V2Runner(keyring)
    slots = list(range(batch))
    for row, slot in enumerate(slots):
        runner.admit(slot, params_for(MESSAGES[row], versions[row]), *HISTORIES[row])
    out_v2 = runner.step(base.clone(), slots)

    histories = [p + o for p, o in HISTORIES]
    expected = base.clone()
    for index, name in enumerate(keyring.names):
        own = [m if v == name else None for m, v in zip(MESSAGES, versions, strict=True)]
        expected = hf_step(keyring.keys[index], own, histories, expected)
    assert torch.equal(out_v1, expected)
    assert torch.equal(out_v2, expected)


def test_both_adapters_follow_the_entropy_rule_of_the_workers_key_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """XMARK_WATERMARK_MIN_ENTROPY set: V1 (the C++ op's bound step) and V2 leave the watermarked rows
    whose model is nearly sure (min-entropy below the threshold) alone, bias the others as the
    transformers adapter does, and agree bit for bit."""
    monkeypatch.setenv(ENV_SECRETS, ",".join(f"{k}:{v}" for k, v in WORKER_SECRETS.items()))
    monkeypatch.setenv(ENV_MIN_ENTROPY, "0.5")
    worker_keyring.cache_clear()
    try:
        ruled = worker_keyring()
        assert ruled.params.min_entropy == 0.5
        batch = len(HISTORIES)
        base = logits_for(batch, seed=13)
        sure = [0, 2, 4]
        base[sure, 99] = base[sure].amax(dim=1) + 30.0  # one token far above the rest
        out_v1 = v1_step(v1_with([params_for(m) for m in MESSAGES]), base.clone())
        runner = V2Runner(ruled)
        slots = list(range(batch))
        for row, slot in enumerate(slots):
            runner.admit(slot, params_for(MESSAGES[row]), *HISTORIES[row])
        out_v2 = runner.step(base.clone(), slots)
        out_hf = hf_step(ruled.keys[0], MESSAGES, [p + o for p, o in HISTORIES], base.clone())
        assert torch.equal(out_v1, out_hf) and torch.equal(out_v2, out_hf)
        for row, message in enumerate(MESSAGES):
            changed = bool((out_v1[row] != base[row]).any())
            assert changed == (message is not None and row not in sure), row
        assert any(MESSAGES[row] is not None for row in sure)
    finally:
        worker_keyring.cache_clear()


@pytest.fixture
def gumbel_keyring(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A worker of the distortion-free scheme: 8-bit blocks, one key, 16 salts (its default)."""
    monkeypatch.setenv(ENV_SECRETS, ",".join(f"{k}:{v}" for k, v in WORKER_SECRETS.items()))
    monkeypatch.setenv(ENV_SCHEME, "gumbel")
    monkeypatch.setenv(ENV_BLOCK_BITS, "8")
    monkeypatch.setenv(ENV_NUM_KEYS, "1")
    worker_keyring.cache_clear()
    try:
        yield worker_keyring()
    finally:
        worker_keyring.cache_clear()


GUMBEL_TEMPERATURES = [0.7, 1.0, 0.5, 0.7, 1.3, 0.9]
GUMBEL_SALTS = [3, 0, 15, 0, 7, 3]


def gumbel_params(keyring: WorkerKeyring, row: int, **fields: Any) -> SamplingParams:
    bits = MESSAGES[row]
    extra = None
    if bits is not None:
        extra = {
            "xmark_message": bits,
            "xmark_key_version": "v1",
            "xmark_salt": GUMBEL_SALTS[row],
            "xmark_fingerprint": keyring.keys[0].fingerprint,
        }
    return SamplingParams(max_tokens=8, temperature=GUMBEL_TEMPERATURES[row], extra_args=extra, **fields)


def gumbel_reference(
    keyring: WorkerKeyring,
    base: torch.Tensor,
    contexts: list[tuple[int, int]],
    keyed: list[bool],
    truncation: Any = None,
):
    """What xmark_core's sampler chooses for these rows (each at its temperature, under its salt,
    within ``truncation``'s nucleus where given)."""
    from xmark_core import TorchWatermarker
    from xmark_core.gumbel import salted

    params = keyring.params
    blocks = np.stack(
        [
            salted(Message.from_bits(m, params).blocks, GUMBEL_SALTS[row], params)
            if m is not None
            else np.zeros(params.num_blocks, np.int64)
            for row, m in enumerate(MESSAGES)
        ]
    )
    return TorchWatermarker(keyring.keys[0]).apply(
        base.clone(),
        torch.tensor(contexts, dtype=torch.int64),
        torch.from_numpy(blocks),
        torch.tensor(keyed),
        temperature=torch.tensor(GUMBEL_TEMPERATURES),
        truncation=truncation,
    )


def test_both_adapters_sample_with_a_gumbel_workers_key(gumbel_keyring: WorkerKeyring) -> None:
    """XMARK_WATERMARK_SCHEME=gumbel: V1 and V2 choose each watermarked row's token as xmark_core's
    sampler does (the row's temperature, its salt), leave it the only finite logit and the other rows
    alone; a step whose context the answer already used is sampled normally (V1: the row's used
    contexts, V2: the slot's history on the device)."""
    keyring = gumbel_keyring
    assert keyring.params.distortion_free and keyring.params.block_bits == 8 and keyring.params.salts == 16
    batch = len(HISTORIES)
    base = logits_for(batch, seed=17)
    params = [gumbel_params(keyring, row) for row in range(batch)]
    outputs = [list(o) for _, o in HISTORIES]  # the live output lists V1 reads
    processor = v1_processor()
    added = [(row, params[row], list(p), outputs[row]) for row, (p, _) in enumerate(HISTORIES)]
    processor.update_state(BatchUpdate(batch_size=batch, removed=[], added=added, moved=[]))
    out_v1 = v1_step(processor, base.clone())
    runner = V2Runner(keyring)
    slots = [5, 2, 7, 0, 3, 6]
    for row, slot in enumerate(slots):
        runner.admit(slot, params[row], *HISTORIES[row])
    out_v2 = runner.step(base.clone(), slots)
    contexts = [vllm_common.last_two(p, o) for p, o in HISTORIES]
    keyed = [m is not None for m in MESSAGES]
    expected = gumbel_reference(keyring, base, contexts, keyed)
    assert torch.equal(out_v1, expected) and torch.equal(out_v2, expected)
    for row, message in enumerate(MESSAGES):
        finite = int(torch.isfinite(out_v1[row]).sum())
        assert finite == (1 if message is not None else VOCAB), row
    # every row writes its token; row 1's answer then goes on with (77, 5012), a context it used for
    # its first token: sampled normally there, the others keyed as before
    for row, slot in enumerate(slots):
        tokens = [77, 5012] if row == 1 else [int(out_v1[row].argmax())]
        outputs[row].extend(tokens)
        for token in tokens:
            runner.commit(slot, token)
        contexts[row] = vllm_common.last_two(HISTORIES[row][0], outputs[row])
    again_v1 = v1_step(processor, base.clone())
    again_v2 = runner.step(base.clone(), slots)
    assert torch.equal(again_v1[1], base[1]) and torch.equal(again_v2[1], base[1])
    keyed[1] = False
    expected = gumbel_reference(keyring, base, contexts, keyed)
    assert torch.equal(again_v1, expected) and torch.equal(again_v2, expected)
    assert sum(int(torch.isfinite(again_v1[row]).sum()) == 1 for row in range(batch)) == 4


# each row's nucleus: (top_k, top_p, min_p); row 3 is unwatermarked, row 5 untruncated
GUMBEL_NUCLEI = [(0, 0.9, 0.0), (40, 1.0, 0.0), (0, 1.0, 0.05), (20, 0.8, 0.0), (50, 0.95, 0.02), (0, 1.0, 0.0)]


def test_both_adapters_sample_within_each_rows_nucleus(gumbel_keyring: WorkerKeyring) -> None:
    """top_k / top_p / min_p per request: V1 and V2 choose what xmark_core's sampler chooses with
    each row's nucleus, a token vLLM's own sampler (min-p, then ``apply_top_k_top_p``, at the row's
    temperature) keeps; an unwatermarked row keeps its logits for vLLM to truncate itself."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from xmark_core.gumbel import Truncation

    keyring = gumbel_keyring
    batch = len(HISTORIES)
    base = logits_for(batch, seed=23)
    params = [gumbel_params(keyring, row, top_k=k, top_p=p, min_p=m) for row, (k, p, m) in enumerate(GUMBEL_NUCLEI)]
    processor = v1_processor()
    added = [(row, params[row], list(p), list(o)) for row, (p, o) in enumerate(HISTORIES)]
    processor.update_state(BatchUpdate(batch_size=batch, removed=[], added=added, moved=[]))
    out_v1 = v1_step(processor, base.clone())
    runner = V2Runner(keyring)
    slots = [4, 1, 6, 0, 7, 2]
    for row, slot in enumerate(slots):
        runner.admit(slot, params[row], *HISTORIES[row])
    out_v2 = runner.step(base.clone(), slots)
    table = torch.tensor(GUMBEL_NUCLEI, dtype=torch.float32)
    truncation = Truncation(top_k=table[:, 0].to(torch.int64), top_p=table[:, 1], min_p=table[:, 2])
    contexts = [vllm_common.last_two(p, o) for p, o in HISTORIES]
    keyed = [m is not None for m in MESSAGES]
    expected = gumbel_reference(keyring, base, contexts, keyed, truncation)
    assert torch.equal(out_v1, expected) and torch.equal(out_v2, expected)
    untruncated = gumbel_reference(keyring, base, contexts, keyed)
    # vLLM's own truncation of the same rows, at their temperatures
    scaled = base / torch.tensor(GUMBEL_TEMPERATURES)[:, None]
    probs = scaled.softmax(dim=1)
    scaled = scaled.masked_fill(probs < table[:, 2:3] * probs.amax(dim=1, keepdim=True), float("-inf"))
    k = torch.where(table[:, 0] > 0, table[:, 0], float(VOCAB)).to(torch.int64)
    nucleus = apply_top_k_top_p(scaled, k, table[:, 1])

    for row, message in enumerate(MESSAGES):
        if message is None:
            assert torch.equal(out_v1[row], base[row])
            continue
        chosen = int(out_v1[row].argmax())
        assert int(torch.isfinite(out_v1[row]).sum()) == 1
        assert torch.isfinite(nucleus[row, chosen]), row  # inside vLLM's nucleus
        assert int(torch.isfinite(nucleus[row]).sum()) < VOCAB or GUMBEL_NUCLEI[row] == (0, 1.0, 0.0)

    assert torch.equal(out_v1[5], untruncated[5])  # no setting: the full distribution, as before
    # the nucleus changed some choices (a processor ignoring it would fail the equality above)
    assert not torch.equal(expected, untruncated)


def test_a_resumed_gumbel_request_keeps_the_contexts_its_answer_used(gumbel_keyring: WorkerKeyring) -> None:
    """A request preempted and added again with its output: the contexts that output used count as
    used. Its answer has come back to (3021, 44), its first token's context: sampled normally, where
    the same request added fresh is keyed."""
    params = gumbel_params(gumbel_keyring, 0)
    base = logits_for(2, seed=19)
    processor = v1_processor()
    added = [(0, params, [1, 9, 3021, 44], [50, 60, 3021, 44]), (1, params, [1, 9, 3021, 44], [])]
    processor.update_state(BatchUpdate(batch_size=2, removed=[], added=added, moved=[]))
    out = v1_step(processor, base.clone())
    assert torch.equal(out[0], base[0])
    assert int(torch.isfinite(out[1]).sum()) == 1


def test_a_gumbel_worker_refuses_requests_it_cannot_honour(gumbel_keyring: WorkerKeyring) -> None:
    """At admission: greedy decoding, the fields vLLM applies after the processors (penalties), n > 1, a salt out
    of range and a fingerprint of another key are refused by name; an honourable request passes."""
    validate_v2 = build_custom_logits_processors_params_validator([V2_FQCN])
    good = gumbel_params(gumbel_keyring, 0)
    validate_logits_processors_parameters([V1_FQCN], good)
    validate_v2(good)
    extra = dict(good.extra_args or {})
    # the nucleus fields the worker applies before its choice pass
    nucleus = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, extra_args=extra)
    validate_logits_processors_parameters([V1_FQCN], nucleus)
    validate_v2(nucleus)
    for fields, match in (
        ({"temperature": 0.0}, "temperature must be above 0"),
        ({"presence_penalty": 0.5}, "presence_penalty is not supported"),
        ({"frequency_penalty": 0.5}, "frequency_penalty is not supported"),
        ({"repetition_penalty": 1.2}, "repetition_penalty is not supported"),
        ({"n": 2}, "n above 1 is not supported"),
        ({"extra_args": {**extra, "xmark_salt": 16}}, "xmark_salt must be an integer in \\[0, 16\\)"),
        ({"extra_args": {**extra, "xmark_salt": True}}, "xmark_salt must be an integer"),
        ({"extra_args": {**extra, "xmark_fingerprint": "0" * 64}}, "xmark_fingerprint differs"),
    ):
        bad = SamplingParams(**{"max_tokens": 8, "temperature": 0.7, "extra_args": extra, **fields})
        with pytest.raises(VLLMValidationError, match=match):
            validate_logits_processors_parameters([V1_FQCN], bad)
        with pytest.raises(VLLMValidationError, match=match):
            validate_v2(bad)
    # an unwatermarked request is the caller's own: any sampling passes
    validate_logits_processors_parameters([V1_FQCN], SamplingParams(temperature=0.0, top_p=0.5))


# -- two encoders per key version (configured scheme auto) ----------------------------------

# the mixed batch: each row's encoder (None: not watermarked) and key version; MESSAGES[3] is None
MIXED_ENCODERS = ["primary", "companion", "companion", None, "primary", "companion"]
MIXED_VERSIONS = ["v1", "v1", "v2", "v1", "v2", "v1"]
# what a companion row asks of vLLM's sampler, all of which a gumbel encoder refuses (the worker leaves
# them to vLLM: greedy, a penalty, logit_bias, a nucleus it does not apply itself)
COMPANION_SAMPLING: list[dict[str, Any]] = [
    {},
    {"temperature": 0.0},
    {"temperature": 0.0, "presence_penalty": 0.5, "top_p": 0.5},
    {},
    {},
    {"temperature": 0.2, "logit_bias": {5: 1.0}, "top_k": 5},
]


def mixed_params(
    keyring: WorkerKeyring, row: int, *, encoders: tuple[str, ...] = ("primary", "companion")
) -> SamplingParams:
    """Row ``row`` of the mixed batch as the gateway sends it to an auto worker: the primary's rows
    with their temperature and salt, the companion's with xmark_encoder and its fingerprint. A row
    whose encoder is not in ``encoders`` carries no watermark (what a single-scheme worker is sent)."""
    encoder, name, bits = MIXED_ENCODERS[row], MIXED_VERSIONS[row], MESSAGES[row]
    if encoder not in encoders or bits is None:
        return SamplingParams(max_tokens=8, temperature=GUMBEL_TEMPERATURES[row])
    slot = keyring.index(name, encoder) if keyring.spec.per_request else keyring.index(name)
    assert slot is not None
    extra: dict[str, Any] = {
        "xmark_message": bits,
        "xmark_key_version": name,
        "xmark_fingerprint": keyring.keys[slot].fingerprint,
    }
    if encoder == "primary":
        extra["xmark_salt"] = GUMBEL_SALTS[row]
        return SamplingParams(max_tokens=8, temperature=GUMBEL_TEMPERATURES[row], extra_args=extra)
    if keyring.spec.per_request:
        extra["xmark_encoder"] = "companion"
    return SamplingParams(**{"max_tokens": 8, "temperature": 0.7, "extra_args": extra, **COMPANION_SAMPLING[row]})


@pytest.fixture
def serve_keyring(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make the processors built next read ``keyring`` (a worker of exactly these keys)."""

    def serve(keyring: WorkerKeyring) -> None:
        monkeypatch.setattr(vllm_common, "worker_keyring", lambda: keyring)

    return serve


def run_both(
    keyring: WorkerKeyring, batch_params: list[SamplingParams], base: torch.Tensor, slots: list[int]
) -> tuple[torch.Tensor, torch.Tensor, V1Processor]:
    """One step of a fresh V1 and a fresh V2 processor of the worker serving ``keyring`` on the batch
    (V2: row i in request slot ``slots[i]``); the V1 processor too."""
    processor = v1_processor()
    added = [(row, batch_params[row], list(p), list(o)) for row, (p, o) in enumerate(HISTORIES)]
    processor.update_state(BatchUpdate(batch_size=len(HISTORIES), removed=[], added=added, moved=[]))
    out_v1 = v1_step(processor, base.clone())
    runner = V2Runner(keyring)
    for row, slot in enumerate(slots):
        runner.admit(slot, batch_params[row], *HISTORIES[row])
    return out_v1, runner.step(base.clone(), slots), processor


def test_a_mixed_batch_gives_each_row_its_own_encoders_treatment(
    auto_keyring: WorkerKeyring, serve_keyring: Any
) -> None:
    """An auto worker's batch of gumbel (primary) rows, xmark (companion) rows of both key versions and
    an unwatermarked row: in V1 and V2 each companion row gets exactly what a single-scheme xmark
    worker holding the companion's keys gives it (δ on its evergreen list, whatever its temperature,
    penalties or nucleus), each primary row the token a single-scheme gumbel worker chooses, and
    neither kind touches the other's rows."""
    keyring = auto_keyring
    companion = keyring.spec.companion
    assert companion is not None and companion.scheme == "xmark" and keyring.params.scheme == "gumbel"
    batch = len(HISTORIES)
    base = logits_for(batch, seed=37)
    slots = [5, 2, 7, 0, 3, 6]
    out_v1, out_v2, processor = run_both(keyring, [mixed_params(keyring, row) for row in range(batch)], base, slots)
    assert processor._steps, "float32 CPU logits should reach the C++ op for the companion slots"

    # a single-scheme gumbel worker: the same secrets and the primary's parameters (the same keys)
    gumbel = WorkerKeyring.from_variables(
        {ENV_SECRETS: ",".join(f"{k}:{v}" for k, v in WORKER_SECRETS.items()), ENV_SCHEME: "gumbel"}
    )
    assert [k.fingerprint for k in gumbel.keys] == [k.fingerprint for k in keyring.keys[:2]]
    serve_keyring(gumbel)
    gumbel_v1, gumbel_v2, _ = run_both(
        gumbel, [mixed_params(gumbel, row, encoders=("primary",)) for row in range(batch)], base, slots
    )
    # a single-scheme xmark worker holding the companions' keys
    xmark = WorkerKeyring(KeyVersionSpec(companion), keyring.names, keyring.keys[len(keyring.names) :])
    serve_keyring(xmark)
    xmark_v1, xmark_v2, _ = run_both(
        xmark, [mixed_params(xmark, row, encoders=("companion",)) for row in range(batch)], base, slots
    )
    assert torch.equal(gumbel_v1, gumbel_v2) and torch.equal(xmark_v1, xmark_v2)

    histories = [p + o for p, o in HISTORIES]
    reference = base.clone()
    for position, name in enumerate(keyring.names):  # the transformers adapter with each companion key
        own = [
            m if e == "companion" and v == name else None
            for m, e, v in zip(MESSAGES, MIXED_ENCODERS, MIXED_VERSIONS, strict=True)
        ]
        reference = hf_step(keyring.keys[len(keyring.names) + position], own, histories, reference)
    assert torch.equal(xmark_v1, reference)

    for out in (out_v1, out_v2):
        for row, encoder in enumerate(MIXED_ENCODERS):
            if encoder == "companion":
                assert torch.equal(out[row], xmark_v1[row]), row
                changed = out[row] != base[row]
                assert torch.allclose(out[row][changed] - base[row][changed], torch.tensor(companion.delta))
                assert abs(changed.float().mean().item() - 0.75**companion.num_keys) < 0.06
            elif encoder == "primary":
                assert torch.equal(out[row], gumbel_v1[row]), row
                assert int(torch.isfinite(out[row]).sum()) == 1
            else:
                assert torch.equal(out[row], base[row]), row


def test_v1_mixed_rows_keep_their_encoders_through_moves_and_swaps(auto_keyring: WorkerKeyring) -> None:
    """The blocks of rows of different widths (an 8-bit-block primary, a 2-bit-block companion) move
    with their rows; a gumbel row keeps the contexts its answer used."""
    keyring = auto_keyring
    batch = len(HISTORIES)
    params = [mixed_params(keyring, row) for row in range(batch)]
    outputs = [list(o) for _, o in HISTORIES]
    processor = v1_processor()
    added = [(row, params[row], list(p), outputs[row]) for row, (p, _) in enumerate(HISTORIES)]
    processor.update_state(BatchUpdate(batch_size=batch, removed=[], added=added, moved=[]))
    # swap a primary row with a companion row; row 3 (unwatermarked) leaves, row 5 moves into it
    processor.update_state(
        BatchUpdate(
            batch_size=5,
            removed=[3],
            added=[],
            moved=[(0, 1, MoveDirectionality.SWAP), (5, 3, MoveDirectionality.UNIDIRECTIONAL)],
        )
    )
    layout = [1, 0, 2, 5, 4]  # original row in each row now
    base = logits_for(5, seed=41)
    out = processor.apply(base.clone())
    # a fresh processor holds the rows in their original order: the same logits, row by row
    wide = torch.zeros(batch, VOCAB)
    for now, original in enumerate(layout):
        wide[original] = base[now]
    expected = v1_with(params).apply(wide.clone())
    for now, original in enumerate(layout):
        assert torch.equal(out[now], expected[original]), (now, original)
    # next step: row 1 (originally 0, primary) goes on with a context its answer used: sampled normally
    assert MIXED_ENCODERS[0] == "primary"
    prompt = HISTORIES[0][0]
    outputs[0].extend([prompt[-2], prompt[-1]])  # the context (x[-2], x[-1]) of its first token again
    again = processor.apply(base.clone())
    assert torch.equal(again[1], base[1])
    assert not torch.equal(again[0], base[0])  # the companion row is still biased


def test_an_auto_worker_admits_a_companion_request_whatever_its_sampling(auto_keyring: WorkerKeyring) -> None:
    """At admission (V1 and V2 validators): a request for the companion takes greedy decoding,
    penalties, logit_bias and n > 1; the same request for the primary is refused by name; the
    companion of a single-scheme version, an unknown encoder and a salt with the companion are
    refused by name."""
    validate_v2 = build_custom_logits_processors_params_validator([V2_FQCN])
    keyring = auto_keyring
    primary = {
        "xmark_message": MESSAGES[0],
        "xmark_key_version": "v1",
        "xmark_fingerprint": keyring.keys[0].fingerprint,
    }
    slot = keyring.index("v1", "companion")
    assert slot is not None
    companion = {**primary, "xmark_encoder": "companion", "xmark_fingerprint": keyring.keys[slot].fingerprint}
    for fields, match in (
        ({"temperature": 0.0}, "temperature must be above 0"),
        ({"presence_penalty": 0.5}, "presence_penalty is not supported"),
        ({"repetition_penalty": 1.2}, "repetition_penalty is not supported"),
        ({"logit_bias": {5: 1.0}}, "logit_bias is not supported"),
        ({"n": 2}, "n above 1 is not supported"),
    ):
        ok = SamplingParams(**{"max_tokens": 8, "temperature": 0.7, "extra_args": companion, **fields})
        validate_logits_processors_parameters([V1_FQCN], ok)
        validate_v2(ok)
        bad = SamplingParams(**{"max_tokens": 8, "temperature": 0.7, "extra_args": primary, **fields})
        for validate in (lambda p: validate_logits_processors_parameters([V1_FQCN], p), validate_v2):
            with pytest.raises(VLLMValidationError, match=match):
                validate(bad)
    for extra, match in (
        ({**companion, "xmark_encoder": "biasing"}, "xmark_encoder must be one of"),
        ({**companion, "xmark_salt": 0}, "xmark_salt applies to a salted gumbel encoder only"),
        ({**companion, "xmark_fingerprint": keyring.keys[0].fingerprint}, "xmark_fingerprint differs"),
    ):
        bad = SamplingParams(max_tokens=8, extra_args=extra)
        for validate in (lambda p: validate_logits_processors_parameters([V1_FQCN], p), validate_v2):
            with pytest.raises(VLLMValidationError, match=match):
                validate(bad)


def test_a_single_scheme_worker_refuses_the_companion(keyring: WorkerKeyring) -> None:
    bad = SamplingParams(max_tokens=8, extra_args={**(xargs(MESSAGES[0]) or {}), "xmark_encoder": "companion"})
    with pytest.raises(VLLMValidationError, match="has no companion encoder"):
        validate_logits_processors_parameters([V1_FQCN], bad)
    with pytest.raises(VLLMValidationError, match="has no companion encoder"):
        build_custom_logits_processors_params_validator([V2_FQCN])(bad)


# -- V1: the persistent batch ----------------------------------------------------------------


def test_v1_follows_removed_added_moved_and_swapped_rows(keyring: WorkerKeyring) -> None:
    processor = v1_processor()
    rows = [(params_for(MESSAGES[r]), list(p), list(o)) for r, (p, o) in enumerate(HISTORIES[:4])]
    processor.update_state(BatchUpdate(batch_size=4, removed=[], added=[(i, *rows[i]) for i in range(4)], moved=[]))
    # request 1 finishes; request 3 moves into its row (condense); requests 0 and 2 swap
    processor.update_state(
        BatchUpdate(
            batch_size=3,
            removed=[1],
            added=[],
            moved=[(3, 1, MoveDirectionality.UNIDIRECTIONAL), (0, 2, MoveDirectionality.SWAP)],
        )
    )
    layout = [2, 3, 0]  # original request in each row now
    base = logits_for(3, seed=3)
    out = processor.apply(base.clone())
    expected = hf_step(
        keyring.keys[0],
        [MESSAGES[i] for i in layout],
        [HISTORIES[i][0] + HISTORIES[i][1] for i in layout],
        base.clone(),
    )
    assert torch.equal(out, expected)


def test_v1_reads_live_output_lists_and_skips_async_placeholders(keyring: WorkerKeyring) -> None:
    processor = v1_processor()
    prompt, output = [1, 9, 3021, 44], [5012, -1]  # the last token is not known yet
    processor.update_state(
        BatchUpdate(batch_size=1, removed=[], added=[(0, params_for(MESSAGES[0]), prompt, output)], moved=[])
    )
    base = logits_for(1, seed=5)
    assert torch.equal(processor.apply(base.clone()), base)  # unknown context: no bias this step
    output[-1] = 14  # vLLM fills the placeholder in place before sampling
    expected = hf_step(keyring.keys[0], [MESSAGES[0]], [prompt + output], base.clone())
    assert torch.equal(processor.apply(base.clone()), expected)
    output.append(2)  # next step: the same list object grows
    expected = hf_step(keyring.keys[0], [MESSAGES[0]], [prompt + output], base.clone())
    assert torch.equal(processor.apply(base.clone()), expected)


def test_v1_placeholder_row_sits_out_while_the_others_are_marked(keyring: WorkerKeyring) -> None:
    """A batch where one row's context holds a placeholder: only that row is left alone this step,
    on the CPU worker's C++ step and on the generic path (bfloat16 logits) alike."""
    histories = [(list(p), list(o)) for p, o in HISTORIES]
    histories[1][1][-1] = -1  # row 1's last token is not known yet
    processor = v1_processor()
    added = [(r, params_for(MESSAGES[r]), p, o) for r, (p, o) in enumerate(histories)]
    processor.update_state(BatchUpdate(batch_size=len(histories), removed=[], added=added, moved=[]))
    for dtype in (torch.float32, torch.bfloat16):
        base = logits_for(len(histories), seed=13).to(dtype)
        own = [None if r == 1 else m for r, m in enumerate(MESSAGES)]
        expected = hf_step(keyring.keys[0], own, [p + o for p, o in histories], base.clone())
        assert torch.equal(processor.apply(base.clone()), expected)
    assert processor._steps, "float32 CPU logits should reach the C++ op"
    histories[1][1][-1] = 14  # filled in place: the row is marked again
    base = logits_for(len(histories), seed=17)
    expected = hf_step(keyring.keys[0], MESSAGES, [p + o for p, o in histories], base.clone())
    assert torch.equal(processor.apply(base.clone()), expected)


def test_v1_batch_larger_than_max_num_seqs_grows_the_rows(keyring: WorkerKeyring) -> None:
    """Rows past the configured capacity grow the host arrays and the op's views of them."""
    config = VllmConfig()
    config.scheduler_config.max_num_seqs = 2
    processor = v1_processor(config)
    batch = len(HISTORIES)
    added = [(r, params_for(MESSAGES[r]), list(p), list(o)) for r, (p, o) in enumerate(HISTORIES)]
    processor.update_state(BatchUpdate(batch_size=batch, removed=[], added=added, moved=[]))
    base = logits_for(batch, seed=19)
    expected = hf_step(keyring.keys[0], MESSAGES, [p + o for p, o in HISTORIES], base.clone())
    assert torch.equal(processor.apply(base.clone()), expected)


def test_v1_resumed_request_after_preemption(keyring: WorkerKeyring) -> None:
    processor = v1_processor()
    prompt, output = [1, 9, 3021, 44], [5012, 14]
    params = params_for(MESSAGES[1])
    processor.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, prompt, output)], moved=[]))
    processor.update_state(BatchUpdate(batch_size=0, removed=[0], added=[], moved=[]))  # preempted
    base = logits_for(1, seed=9)
    assert torch.equal(processor.apply(base.clone()), base)  # the row is empty now
    output.append(2)
    processor.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, prompt, output)], moved=[]))
    expected = hf_step(keyring.keys[0], [MESSAGES[1]], [prompt + output], base.clone())
    assert torch.equal(processor.apply(base.clone()), expected)


def test_v1_n_greater_than_one_marks_every_sample_with_the_message(keyring: WorkerKeyring) -> None:
    processor = v1_processor()
    params = params_for(MESSAGES[0])  # n children share copies of the parent's params
    prompt = [1, 9, 3021, 44]
    outputs = [[5012], [77]]
    processor.update_state(
        BatchUpdate(batch_size=2, removed=[], added=[(i, params, prompt, outputs[i]) for i in range(2)], moved=[])
    )
    base = logits_for(2, seed=13)
    expected = hf_step(keyring.keys[0], [MESSAGES[0]] * 2, [prompt + o for o in outputs], base.clone())
    assert torch.equal(processor.apply(base.clone()), expected)


def test_v1_does_not_claim_argmax_invariance(keyring: WorkerKeyring) -> None:
    assert v1_processor().is_argmax_invariant() is False


# -- V2: request slots on the device ---------------------------------------------------------


def test_v2_resumption_after_preemption_uses_prompt_plus_partial_output(keyring: WorkerKeyring) -> None:
    runner = V2Runner(keyring)
    prompt, output = [1, 9, 3021, 44], [5012, 14, 2]
    runner.admit(4, params_for(MESSAGES[0]), prompt, output[:1])
    runner.commit(4, output[1])
    base = logits_for(1, seed=17)
    first = runner.step(base.clone(), [4])
    assert torch.equal(first, hf_step(keyring.keys[0], [MESSAGES[0]], [prompt + output[:2]], base.clone()))
    # preempted, resumed in another slot with prefill = prompt + output so far
    runner.admit(1, params_for(MESSAGES[0]), prompt, output)
    resumed = runner.step(base.clone(), [1])
    assert torch.equal(resumed, hf_step(keyring.keys[0], [MESSAGES[0]], [prompt + output], base.clone()))


def test_v2_recycled_slot_loses_the_previous_watermark(keyring: WorkerKeyring) -> None:
    runner = V2Runner(keyring)
    assert runner.admit(3, params_for(MESSAGES[0]), [1, 2, 3], [])
    base = logits_for(1, seed=19)
    assert not torch.equal(runner.step(base.clone(), [3]), base)
    assert runner.admit(3, params_for(None), [1, 2, 3], []) is False  # a new request, no xargs
    assert torch.equal(runner.step(base.clone(), [3]), base)


def test_v2_padded_rows_and_declined_rows_are_untouched(keyring: WorkerKeyring) -> None:
    runner = V2Runner(keyring)
    runner.admit(0, params_for(MESSAGES[0]), [1, 2, 3], [4])
    runner.admit(1, params_for(None), [1, 2, 3], [4])
    base = logits_for(3, seed=23)
    out = runner.step(base.clone(), [0, 1, -1])
    assert not torch.equal(out[0], base[0])
    assert torch.equal(out[1:], base[1:])


def test_v2_n_greater_than_one(keyring: WorkerKeyring) -> None:
    runner = V2Runner(keyring)
    params = params_for(MESSAGES[4], "v2")
    runner.admit(2, params, [1, 9, 3021, 44], [5012])
    runner.admit(6, params, [1, 9, 3021, 44], [77])
    base = logits_for(2, seed=29)
    out = runner.step(base.clone(), [2, 6])
    expected = hf_step(keyring.keys[1], [MESSAGES[4]] * 2, [[1, 9, 3021, 44, 5012], [1, 9, 3021, 44, 77]], base.clone())
    assert torch.equal(out, expected)


def test_v2_apply_without_watermarked_requests_returns_logits_unchanged(keyring: WorkerKeyring) -> None:
    runner = V2Runner(keyring)
    runner.admit(0, params_for(None), [1, 2, 3], [])
    base = logits_for(1, seed=31)
    out = runner.step(base.clone(), [0])
    assert torch.equal(out, base)


# -- loading through vLLM's own machinery ----------------------------------------------------


def test_vllm_loaders_accept_each_class_for_its_runner_only() -> None:
    assert load_v1_classes([V1_FQCN]) == [V1Processor]
    assert load_v2_classes([V2_FQCN]) == [V2Processor]
    with pytest.raises(ValueError, match="not a subclass"):
        load_v2_classes([V1_FQCN])


def test_vllm_admission_turns_malformed_xargs_into_validation_errors(keyring: WorkerKeyring) -> None:
    bad = SamplingParams(extra_args={"xmark_message": "01"})
    good = params_for(MESSAGES[0], "v2")
    validate_logits_processors_parameters([V1_FQCN], good)
    with pytest.raises(VLLMValidationError, match="xmark_key_version is missing"):
        validate_logits_processors_parameters([V1_FQCN], bad)
    validate_v2 = build_custom_logits_processors_params_validator([V2_FQCN])
    validate_v2(good)
    with pytest.raises(VLLMValidationError, match="xmark_key_version is missing"):
        validate_v2(bad)


def test_speculative_decoding_is_refused_by_both_adapters(keyring: WorkerKeyring) -> None:
    config = VllmConfig()
    config.speculative_config = SimpleNamespace(num_speculative_tokens=2)  # type: ignore[assignment]  # a stand-in config
    with pytest.raises(WorkerConfigError, match="speculative decoding"):
        v1_processor(config)
    with pytest.raises(WorkerConfigError, match="speculative decoding"):
        V2Processor(config, V2Runner(keyring).req_states)


def test_worker_without_secrets_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_common.ENV_SECRETS, raising=False)
    monkeypatch.delenv(vllm_common.ENV_SECRETS_FILE, raising=False)
    vllm_common.worker_keyring.cache_clear()
    try:
        with pytest.raises(WorkerConfigError, match="needs the watermark secrets"):
            v1_processor()
    finally:
        vllm_common.worker_keyring.cache_clear()


@pytest.fixture(scope="module")
def model_config_factory() -> Any:
    """Real vLLM ModelConfigs on the local checkpoint (the processor reads ``logits_processors``)."""
    from vllm.config import ModelConfig

    root = os.environ.get("XMARK_MODEL_PATH") or os.path.join(
        os.path.dirname(__file__), "..", "..", "var", "models", "smollm2-135m-instruct"
    )
    if not os.path.isfile(os.path.join(root, "config.json")):
        pytest.skip("the SmolLM2 checkpoint is not built (make model)")

    def build(processors: list[str]) -> ModelConfig:
        return ModelConfig(model=root, logits_processors=processors, skip_tokenizer_init=True)

    return build


def test_loading_through_flag_and_entry_point_is_refused(
    keyring: WorkerKeyring, monkeypatch: pytest.MonkeyPatch, model_config_factory: Any
) -> None:
    flag_only = VllmConfig(model_config=model_config_factory([V1_FQCN]))
    v1_processor(flag_only)  # loaded once: fine
    twice_by_flag = VllmConfig(model_config=model_config_factory([V1_FQCN, V1_FQCN]))
    with pytest.raises(WorkerConfigError, match="loaded 2 times"):
        v1_processor(twice_by_flag)
    plugin = EntryPoint("xmark", V1_FQCN, vllm_common.LOGITS_PROCESSORS_GROUP)
    monkeypatch.setattr(vllm_common, "entry_points", lambda group: [plugin] if group == plugin.group else [])
    with pytest.raises(WorkerConfigError, match="loaded 2 times"):
        v1_processor(flag_only)
    v2_flag = VllmConfig(model_config=model_config_factory([V2_FQCN]))
    V2Processor(v2_flag, V2Runner(keyring).req_states)  # the V1 plugin is not a V2 processor


def test_v1_profile_counts_steps_and_time_when_asked(
    keyring: WorkerKeyring, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """XMARK_PROCESSOR_PROFILE (benchmarks only): every apply and update_state is counted and
    timed into the file, watermarked steps apart; without it nothing is written."""
    from xmark_core.vllm_common import ENV_PROFILE, read_processor_profile

    assert v1_processor()._profile is None
    path = tmp_path / "profile.txt"
    monkeypatch.setenv(ENV_PROFILE, str(path))
    processor = v1_processor()
    assert read_processor_profile(path)["applies"] == 0
    processor.apply(logits_for(2))  # no request yet: not watermarked
    rows = [(params_for(MESSAGES[r]), list(p), list(o)) for r, (p, o) in enumerate(HISTORIES[:2])]
    processor.update_state(BatchUpdate(batch_size=2, removed=[], added=[(i, *rows[i]) for i in range(2)], moved=[]))
    for _ in range(3):
        processor.apply(logits_for(2))
    counters = read_processor_profile(path)
    assert counters["applies"] == 4 and counters["watermarked_applies"] == 3 and counters["updates"] == 1
    assert counters["watermarked_apply_s"] > 0 and counters["apply_s"] >= counters["watermarked_apply_s"]
    assert counters["update_s"] > 0
