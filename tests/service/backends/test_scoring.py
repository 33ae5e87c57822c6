"""The likelihood decoder's forward pass: which dtype it runs in, and what bfloat16 changes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from service.backends.scoring import native_bfloat16, resolve_scorer_dtype, score_texts, scoring_model
from tests.conftest import checkpoint_path

X86_FLAGS = "fpu vme de pse tsc msr pae avx2 avx512f avx512bw avx512vl"


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        (f"processor\t: 0\nflags\t\t: {X86_FLAGS} avx512_bf16 avx512_vnni\n", True),
        (f"processor\t: 0\nflags\t\t: {X86_FLAGS} amx_bf16 amx_tile\n", True),
        (f"processor\t: 0\nflags\t\t: {X86_FLAGS}\n", False),
        ("processor\t: 0\nFeatures\t: fp asimd evtstrm aes sha2 bf16 i8mm\n", True),
        ("processor\t: 0\nFeatures\t: fp asimd evtstrm aes sha2\n", False),
        ("processor\t: 0\n", False),
    ],
)
def test_native_bfloat16_reads_the_cpu_flags(tmp_path: Path, cpuinfo: str, native: bool) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo, encoding="utf-8")
    assert native_bfloat16(path) is native


def test_an_unreadable_cpuinfo_means_float32(tmp_path: Path) -> None:
    assert native_bfloat16(tmp_path / "missing") is False


def test_explicit_choices_are_kept() -> None:
    assert resolve_scorer_dtype("float32") == torch.float32
    assert resolve_scorer_dtype("bfloat16") == torch.bfloat16
    assert resolve_scorer_dtype("auto") == (torch.bfloat16 if native_bfloat16() else torch.float32)


@pytest.mark.model
def test_a_bfloat16_scorer_reads_texts_as_the_float32_model_does() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoint_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    assert scoring_model(model, torch.float32) is model
    scorer = scoring_model(model, torch.bfloat16)
    assert next(scorer.parameters()).dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32
    text = (
        "The committee met on Tuesday to review the budget. After a long discussion about road repairs, "
        "the members agreed to postpone the vote on the new library until the spring, when the final "
        "cost estimates from the architects would be available to everyone."
    )
    ids = tokenizer(text).input_ids
    exact, rounded = (score_texts(m, int(tokenizer.eos_token_id), [ids], 20)[0] for m in (model, scorer))
    gap = np.abs(exact.token_logprobs[1:] - rounded.token_logprobs[1:])
    assert gap.max() < 0.5 and float(np.median(gap)) < 0.1, (gap.max(), np.median(gap))
    assert (exact.top_ids[1:, 0] == rounded.top_ids[1:, 0]).mean() >= 0.9
