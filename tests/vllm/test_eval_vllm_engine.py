"""The evaluation's vLLM engine: its processor against the transformers path, and a real engine run.

``EvalLogitsProcessor`` must give exactly the logits of ``generation.MixedRowsProcessor`` (the
transformers path) for any mix of settings, follow vLLM's persistent batch, and the engine must
return exactly max_new_tokens tokens with the raw model NLL of each.
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip(
    "vllm.sampling_params", reason="vLLM is not installed in this interpreter (make test-vllm installs it)"
)

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from benchmarks.evaluation.config import GenSpec
from benchmarks.evaluation.generation import MixedRowsProcessor, RowJob
from benchmarks.evaluation.population import evaluation_key, user_messages
from benchmarks.evaluation.vllm_engine import EvalLogitsProcessor, request_args
from tests.conftest import checkpoint_path
from xmark_core.hf import XMarkLogitsProcessor

pytestmark = pytest.mark.vllm

VOCAB = 49152
SEED = 5
SUPPRESS = [0, 1, 2, 7, 16]
SPECS = [
    GenSpec("xmark", 16, 2, 2.0),
    GenSpec("mpac", 8, 1, 3.0),
    GenSpec("none"),
    GenSpec("loso", 32, 1, 1.0),
    GenSpec("xmark", 32, 4, 2.0),
    GenSpec("xmark", 16, 2, 2.0),
]
HISTORIES = [
    ([1, 9, 3021, 44], []),
    ([1, 9, 77], [5012, 14, 2]),
    ([31], []),
    ([1, 2, 3, 4, 5], [6, 7]),
    ([1, 9, 3021, 44], [49151]),
    ([12, 0], [0, 0, 0, 1]),
]


def job(row: int) -> RowJob:
    spec = SPECS[row]
    key = evaluation_key(spec.params(), SEED) if spec.watermarked else None
    message = user_messages(spec.bits, 6, SEED)[row] if spec.watermarked else None
    return RowJob(spec.name, row, 0, "p", "prompt", 1.0, key, message)


def sampling(row_job: RowJob) -> SamplingParams:
    return SamplingParams(max_tokens=8, extra_args=request_args(row_job, SEED, SUPPRESS))


def base_logits(batch: int, seed: int = 3) -> torch.Tensor:
    return torch.randn((batch, VOCAB), generator=torch.Generator().manual_seed(seed))


def transformers_logits(jobs: list[RowJob], histories: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    """What the transformers path does to the same rows (temperature 1: no scaling)."""
    width = max(len(h) for h in histories)
    input_ids = torch.tensor([[0] * (width - len(h)) + h for h in histories], dtype=torch.long)
    groups: dict[str, list[int]] = {}
    for row, j in enumerate(jobs):
        if j.key is not None:
            groups.setdefault(j.spec_name, []).append(row)
    processors = [
        (torch.tensor(rows), XMarkLogitsProcessor(jobs[rows[0]].key, [jobs[r].message for r in rows]))  # type: ignore[arg-type]
        for rows in groups.values()
    ]
    mixer = MixedRowsProcessor(processors, torch.ones(len(jobs)), SUPPRESS)
    return mixer(input_ids, logits)


def processor_with(rows: list[int]) -> EvalLogitsProcessor:
    processor = EvalLogitsProcessor(VllmConfig(), torch.device("cpu"), False)
    added = [(i, sampling(job(r)), list(HISTORIES[r][0]), list(HISTORIES[r][1])) for i, r in enumerate(rows)]
    processor.update_state(BatchUpdate(batch_size=len(rows), removed=[], added=added, moved=[]))
    return processor


def test_mixed_settings_match_the_transformers_path_exactly() -> None:
    rows = list(range(len(SPECS)))
    base = base_logits(len(rows))
    out = processor_with(rows).apply(base.clone())
    expected = transformers_logits([job(r) for r in rows], [p + o for p, o in HISTORIES], base.clone())
    assert torch.equal(out, expected)
    assert torch.isinf(out[:, SUPPRESS]).all()
    unwatermarked = 2
    keep = torch.ones(VOCAB, dtype=torch.bool)
    keep[SUPPRESS] = False
    assert torch.equal(out[unwatermarked, keep], base[unwatermarked, keep])
    for row in (0, 1, 3, 4):
        assert (out[row, keep] != base[row, keep]).any()


def test_a_setting_with_the_entropy_rule_matches_the_transformers_path() -> None:
    """The evaluation processor carries the rule to its worker (request_args, _setting): rows whose
    model is nearly sure are left alone there as in the transformers path."""
    spec = GenSpec("xmark", 32, 4, 2.0, min_entropy=0.69)
    assert spec.name == "xmark-b32-k4-d2-h0.69-t0.7"
    key = evaluation_key(spec.params(), SEED)
    messages = user_messages(32, 3, SEED)
    jobs = [RowJob(spec.name, row, 0, "p", "prompt", 1.0, key, messages[row]) for row in range(3)]
    histories = [HISTORIES[row] for row in range(3)]
    processor = EvalLogitsProcessor(VllmConfig(), torch.device("cpu"), False)
    added = [(i, sampling(j), list(h[0]), list(h[1])) for i, (j, h) in enumerate(zip(jobs, histories, strict=True))]
    processor.update_state(BatchUpdate(batch_size=3, removed=[], added=added, moved=[]))
    base = base_logits(3, seed=9)
    base[1, 42] = base[1].amax() + 30.0  # row 1: one token far above the rest
    out = processor.apply(base.clone())
    expected = transformers_logits(jobs, [p + o for p, o in histories], base.clone())
    assert torch.equal(out, expected)
    marked = (out != base) & torch.isfinite(out)
    assert bool(marked[0].any()) and bool(marked[2].any()) and not bool(marked[1].any())


def test_rows_follow_removals_moves_and_swaps() -> None:
    processor = processor_with([0, 1, 2, 3])
    processor.update_state(
        BatchUpdate(
            batch_size=3,
            removed=[1],
            added=[],
            moved=[(3, 1, MoveDirectionality.UNIDIRECTIONAL), (0, 2, MoveDirectionality.SWAP)],
        )
    )
    layout = [2, 3, 0]
    base = base_logits(3, seed=9)
    out = processor.apply(base.clone())
    expected = transformers_logits(
        [job(r) for r in layout], [HISTORIES[r][0] + HISTORIES[r][1] for r in layout], base.clone()
    )
    assert torch.equal(out, expected)


def test_suppression_is_each_rows_own() -> None:
    """A row that suppresses nothing (a rewrite) keeps every logit beside rows that suppress."""
    processor = EvalLogitsProcessor(VllmConfig(), torch.device("cpu"), False)
    plain = job(2)  # unwatermarked
    added = [
        (0, sampling(plain), [1, 2], []),
        (1, SamplingParams(max_tokens=8, extra_args=request_args(plain, SEED, [])), [1, 2], []),
        (2, SamplingParams(max_tokens=8, extra_args=request_args(plain, SEED, [3, 4])), [1, 2], []),
    ]
    processor.update_state(BatchUpdate(batch_size=3, removed=[], added=added, moved=[]))
    base = base_logits(3, seed=11)
    out = processor.apply(base.clone())
    assert torch.isinf(out[0, SUPPRESS]).all() and not torch.isinf(out[0, [3, 4]]).any()
    assert torch.equal(out[1], base[1])
    assert torch.isinf(out[2, [3, 4]]).all() and not torch.isinf(out[2, SUPPRESS]).any()
    # the rows keep their own lists after a swap
    processor.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    out = processor.apply(base.clone())
    assert torch.equal(out[0], base[0])
    assert torch.isinf(out[1, SUPPRESS]).all()


def test_requests_without_or_with_a_malformed_setting_are_refused() -> None:
    with pytest.raises(ValueError, match="xmark_eval"):
        EvalLogitsProcessor.validate_params(SamplingParams(max_tokens=4))
    args = request_args(job(0), SEED, SUPPRESS)
    args["xmark_eval"]["message"] = "01"
    with pytest.raises(ValueError, match="message"):
        EvalLogitsProcessor.validate_params(SamplingParams(max_tokens=4, extra_args=args))


@pytest.mark.model
def test_real_engine_gives_exact_lengths_and_the_raw_model_nll() -> None:
    """A real CPU engine: every row has max_new_tokens non-special tokens; its NLLs are the model's own."""
    from benchmarks.evaluation.generation import chat_prompt, load_model
    from benchmarks.evaluation.vllm_engine import VllmGenerator

    model_path = checkpoint_path()
    if not (model_path / "config.json").is_file():
        pytest.fail(f"no model checkpoint at {model_path}: run `xmark fetch-model` first")
    model, tokenizer = load_model(model_path)
    environment = dict(os.environ)
    generator = VllmGenerator(model_path, tokenizer, max_model_len=256, max_num_seqs=4)
    # its KV cache is the engine's own: the vLLM servers this process starts later (tests/e2e_vllm)
    # must not inherit it through the environment
    assert {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")} == {
        k: v for k, v in environment.items() if k.startswith("VLLM_CPU")
    }
    spec = GenSpec("xmark", 8, 2, 2.0, temperature=0.7)
    key = evaluation_key(spec.params(), SEED)
    messages = user_messages(8, 2, SEED)
    jobs = [
        RowJob(spec.name, 0, 0, "a", "Write a short poem about rivers.", 0.7, key, messages[0]),
        RowJob(spec.name, 1, 0, "b", "Explain what a compiler does.", 0.7, key, messages[1]),
        RowJob("none-t1", 0, 0, "c", "Tell me about tea.", 1.0, None, None),
    ]
    max_new = 24
    results = generator.generate(jobs, max_new, SEED)
    again = generator.generate(jobs, max_new, SEED)
    assert [r.token_ids for r in again] == [r.token_ids for r in results]  # a seed per row: reproducible
    special = set(tokenizer.all_special_ids)
    for result in results:
        assert len(result.token_ids) == max_new and len(result.nll) == max_new
        assert not special & set(result.token_ids)
        prompt = tokenizer(chat_prompt(tokenizer, result.job.prompt), add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + result.token_ids])
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
        nll = -logprobs.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
        for got, want in zip(result.nll, nll.tolist(), strict=True):
            assert math.isfinite(got) and got >= 0
            assert abs(got - want) < 2e-3 + 2e-3 * want
    # the quality protocol: answers end at the end-of-turn token (or the cap), with one seed per
    # answer whatever the setting, so an unwatermarked row and a watermarked one start alike
    eos = tokenizer.eos_token_id
    plain = RowJob("none-t0.7", 0, 0, "a", "Say hello.", 0.7, None, None)
    ended = generator.generate([plain, jobs[0]], 64, SEED, stop_at_eos=True, seed_of=lambda j: 11)
    for result in ended:
        assert 0 < len(result.token_ids) <= 64
        others = special - {eos}
        assert not others & set(result.token_ids)
        assert eos not in result.token_ids[:-1]
    assert ended[0].token_ids[-1] == eos  # a greeting ends well before 64 tokens


def test_gumbel_rows_choose_after_suppression_at_their_own_temperature() -> None:
    """Scheme gumbel: the row's token is chosen among the tokens left after suppression, at the
    request's temperature, exactly as the op chooses it; a context the answer already used is
    sampled normally (only suppression applies)."""
    from xmark_core.encoder import TorchWatermarker

    spec = GenSpec("gumbel", 32, 1, 2.0, temperature=0.7)
    key = evaluation_key(spec.params(), SEED)
    messages = user_messages(32, 2, SEED)
    jobs = [RowJob(spec.name, row, 0, "p", "prompt", 0.7, key, messages[row]) for row in range(2)]
    histories = [([1, 9, 3021, 44], []), ([1, 9, 77], [5012, 14, 2])]
    processor = EvalLogitsProcessor(VllmConfig(), torch.device("cpu"), False)
    added = [
        (i, SamplingParams(max_tokens=8, temperature=temp, extra_args=request_args(j, SEED, SUPPRESS)), p, o)
        for i, (j, (p, o), temp) in enumerate(zip(jobs, histories, (0.7, 1.0), strict=True))
    ]
    processor.update_state(BatchUpdate(batch_size=2, removed=[], added=added, moved=[]))
    base = base_logits(2, seed=21)
    base[:, SUPPRESS] = base.amax() + 50.0  # the suppressed tokens would win if they were not removed first
    out = processor.apply(base.clone())
    expected = base.clone()
    expected[:, SUPPRESS] = float("-inf")
    expected = TorchWatermarker(key).apply(
        expected,
        torch.tensor([[3021, 44], [14, 2]]),
        torch.stack([torch.from_numpy(m.blocks) for m in messages]),
        torch.ones(2, dtype=torch.bool),
        temperature=torch.tensor([0.7, 1.0]),
    )
    assert torch.equal(out, expected)
    assert (torch.isfinite(out).sum(dim=1) == 1).all()
    # row 1's answer goes on to use the context (14, 2) again: that step is sampled normally
    added[1][3].extend([9, 14, 2])
    again = processor.apply(base.clone())
    keep = torch.ones(VOCAB, dtype=torch.bool)
    keep[SUPPRESS] = False
    assert torch.equal(again[1, keep], base[1, keep])


def _until_a_context_repeats(prompt_tail: list[int], ids: list[int]) -> int:
    """How many tokens of an answer were written before one's context (its two previous tokens,
    the prompt's last two for the first) had already been used in the answer."""
    history, used = list(prompt_tail), set()
    for position, token in enumerate(ids):
        context = (history[-2], history[-1])
        if context in used:
            return position
        used.add(context)
        history.append(token)
    return len(ids)


@pytest.mark.model
def test_real_engine_gumbel_answers_are_fixed_by_user_and_prompt() -> None:
    """What the distortion-free scheme costs, on a real engine: one user's answer to one prompt is
    the same whatever the sampling seed, and the n = 2 completions of one request are the same,
    until a context recurs in the answer (sampled with the request's own randomness from there);
    another user gets another answer, and the decoder reads the author's message. With salts
    (WatermarkParams.salts) one user's answers under two salts differ from the first token the model
    had a choice at, the same salt and seed give the same answer, and the decoder reads the salt."""
    from benchmarks.evaluation.generation import load_model
    from benchmarks.evaluation.vllm_engine import VllmGenerator
    from xmark_core import CandidateSet, attribute, decode

    model_path = checkpoint_path()
    if not (model_path / "config.json").is_file():
        pytest.fail(f"no model checkpoint at {model_path}: run `xmark fetch-model` first")
    _, tokenizer = load_model(model_path)
    generator = VllmGenerator(model_path, tokenizer, max_model_len=256, max_num_seqs=4)
    spec = GenSpec("gumbel", 32, 1, 2.0, temperature=1.0)
    key = evaluation_key(spec.params(), SEED)
    messages = user_messages(32, 2, SEED)
    prompt = "Write a short poem about rivers."
    prompt_ids = generator._prompt_ids(prompt)
    jobs = [RowJob(spec.name, user, 0, "a", prompt, 1.0, key, messages[user]) for user in (0, 1)]
    max_new = 48
    first = generator.generate(jobs, max_new, SEED, seed_of=lambda j: 1)
    second = generator.generate(jobs, max_new, SEED, seed_of=lambda j: 2)
    for a, b in zip(first, second, strict=True):
        fixed = _until_a_context_repeats(prompt_ids[-2:], a.token_ids)
        assert fixed >= 3  # the chat template's answer opening alone
        assert a.token_ids[:fixed] == b.token_ids[:fixed]  # the seed changes nothing up to there
    assert first[0].token_ids != first[1].token_ids  # another user, another answer
    plain = RowJob("none-t1", 0, 0, "a", prompt, 1.0, None, None)
    unmarked = generator.generate([plain], max_new, SEED, seed_of=lambda j: 1)
    # n = 2 in one request: both completions are the user's one answer up to the first repeated context
    params = SamplingParams(
        n=2,
        temperature=1.0,
        max_tokens=max_new,
        min_tokens=max_new,
        ignore_eos=True,
        detokenize=False,
        extra_args=request_args(jobs[0], SEED, generator._suppress),
    )
    out = generator._llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
    fixed = _until_a_context_repeats(prompt_ids[-2:], first[0].token_ids)
    assert [list(c.token_ids)[:fixed] for c in out.outputs] == [first[0].token_ids[:fixed]] * 2
    candidates = CandidateSet([m.bits for m in messages], [0, 1], spec.params())
    for user, result in enumerate(first):
        read = attribute(decode(prompt_ids[-2:] + result.token_ids, key), candidates)
        assert read.candidates[0].id == user
    assert unmarked[0].token_ids != first[0].token_ids
    salted_spec = GenSpec("gumbel", 32, 1, 2.0, temperature=1.0, salts=16)
    salted_key = evaluation_key(salted_spec.params(), SEED)
    salted_jobs = [
        RowJob(salted_spec.name, 0, salt, "a", prompt, 1.0, salted_key, messages[0], salt) for salt in (3, 4, 3)
    ]
    three, four, again = generator.generate(salted_jobs, max_new, SEED, seed_of=lambda j: 1)
    assert three.token_ids == again.token_ids and three.token_ids != four.token_ids
    salted_candidates = CandidateSet([m.bits for m in messages], [0, 1], salted_spec.params())
    for salt, result in ((3, three), (4, four)):
        read_salted = decode(prompt_ids[-2:] + result.token_ids, salted_key)
        assert read_salted.salt == salt
        assert attribute(read_salted, salted_candidates).candidates[0].id == 0
