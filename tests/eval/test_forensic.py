"""The forensic evaluation's protocol pieces (no model): population, jobs, edits, the report."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from benchmarks.evaluation.forensic import (
    FORENSIC,
    GUMBEL,
    GUMBEL8,
    GUMBEL8_SALTED,
    STRENGTH,
    ForensicConfig,
    Population,
    Setting,
    jobs,
    prompt_of,
)
from benchmarks.evaluation.metrics import wilson
from benchmarks.evaluation.prompts import load_prompts
from benchmarks.evaluation.report import render_forensic
from xmark_core import WatermarkParams

SMALL = ForensicConfig(
    settings=(Setting(32, 4, 0.7, 12, headline=True), Setting(16, 2, 0.7, 5), Setting(0, 0, 0.7, 12)),
    t_grid=(150, 300),
    registry_size=200,
)


def test_wilson_interval_matches_closed_form() -> None:
    # 0 of n: the upper bound is z^2 / (n + z^2)
    lo, hi = wilson(0, 300)
    assert lo == 0.0
    assert hi == pytest.approx(1.959964**2 / (300 + 1.959964**2), abs=1e-4)
    # 300 of 300 names: the lower bound is above 98.7 % (what the headline cells rely on)
    assert wilson(300, 300)[0] > 0.987
    lo, hi = wilson(50, 100)
    assert lo < 0.5 < hi and math.isclose(0.5 - lo, hi - 0.5, abs_tol=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)


def test_authors_are_distinct_registered_ids_and_the_registry_is_the_allocators() -> None:
    population = Population(SMALL)
    registry = population.registry(32)
    assert len(registry) == 200 and len({m.bits for m in registry}) == 200
    authors = population.authors(32)
    assert len(authors) == 12 and len(set(authors)) == 12
    assert all(0 <= a < 200 for a in authors)
    assert Population(SMALL).authors(32) == authors  # seeded
    candidates = population.candidates(WatermarkParams(bits=32, num_keys=4))
    assert candidates.bits_of(authors[0]) == registry[authors[0]].bits


def test_jobs_give_each_author_one_prompt_shared_with_the_null_text() -> None:
    prompts = load_prompts()
    population = Population(SMALL)
    rows = jobs(SMALL, population, prompts)
    assert len(rows) == 12 + 5 + 12
    by_setting: dict[str, list] = {}
    for row in rows:
        by_setting.setdefault(row.spec_name, []).append(row)
    marked = by_setting["xmark-b32-k4-d2-t0.7"]
    null = by_setting["none-t0.7"]
    for job, plain in zip(marked, null, strict=True):
        assert job.user == plain.user and job.prompt == plain.prompt  # copy-paste source: same prompt
        assert job.prompt == prompt_of(prompts, SMALL.seed, job.user).text
        assert job.message is not None and plain.message is None and plain.key is None
        assert job.message.bits == population.registry(32)[population.authors(32)[job.user]].bits
        assert job.key is not None and job.key.params.num_keys == 4
    assert len({row.prompt for row in marked}) == 12  # 124 prompts: no repeats among 12 authors


@pytest.mark.parametrize(
    "config",
    [FORENSIC, STRENGTH, GUMBEL, GUMBEL8, GUMBEL8_SALTED],
    ids=["forensic", "strength", "gumbel", "gumbel8", "gumbel8s16"],
)
def test_the_committed_protocol_has_the_counts_its_claims_need(config: ForensicConfig) -> None:
    headline = [s for s in config.settings if s.headline]
    assert headline and all(s.authors >= 300 for s in headline)  # 300/300 -> 95 % lower bound > 98.7 %
    for setting in headline:
        null = next(s for s in config.settings if s.bits == 0 and s.temperature == setting.temperature)
        pairs = null.authors * (1 + config.null_key_count(setting.temperature))
        assert pairs >= 3000  # 0 of 3,000 -> upper bound about 0.13 %
    assert config.registry_size == 10_000


def test_the_strength_preset_generates_its_settings_with_their_own_bias() -> None:
    # a smaller registry than the protocol's (allocating 10,000 IDs takes minutes), the same for both
    strength, forensic = (replace(config, registry_size=400) for config in (STRENGTH, FORENSIC))
    rows = jobs(strength, Population(strength), load_prompts())
    deltas = {row.spec_name: row.key.params.delta for row in rows if row.key is not None}
    assert deltas == {"xmark-b32-k6-d2-t0.7": 2.0, "xmark-b32-k4-d2.5-t0.7": 2.5}
    # the same authors and prompts as the gateway's settings: the answers differ only by the watermark
    default = {(row.user, row.prompt, row.message) for row in jobs(forensic, Population(forensic), load_prompts())}
    assert {(row.user, row.prompt, row.message) for row in rows} <= default


def test_the_salted_preset_writes_each_author_under_a_salt_of_its_own() -> None:
    """The same authors, prompts and IDs as the unsalted 8-bit preset; each answer under a seeded
    random salt of 16 (the decoders do not know it)."""
    salted, plain = (replace(config, registry_size=400) for config in (GUMBEL8_SALTED, GUMBEL8))
    rows = [r for r in jobs(salted, Population(salted), load_prompts()) if r.key is not None]
    unsalted = [r for r in jobs(plain, Population(plain), load_prompts()) if r.key is not None]
    assert [(r.user, r.prompt, r.message.bits) for r in rows if r.message is not None] == [
        (r.user, r.prompt, r.message.bits) for r in unsalted if r.message is not None
    ]
    assert {r.key.params.salts for r in rows if r.key is not None} == {16}
    salts = [r.salt for r in rows]
    assert all(0 <= s < 16 for s in salts) and len(set(salts)) == 16
    assert [r.salt for r in jobs(salted, Population(salted), load_prompts()) if r.key is not None] == salts


def test_the_forensic_preset_has_the_gateway_settings() -> None:
    headline = [s for s in FORENSIC.settings if s.headline]
    assert {s.temperature for s in headline if s.bits == 32 and s.num_keys == 4 and s.delta == 2.0} == {0.7, 1.0}
    assert 150 in FORENSIC.t_grid and 100 in FORENSIC.t_grid


def _rate(count: int, trials: int) -> dict:
    return {"count": count, "of": trials, "rate": count / trials, "ci95": wilson(count, trials)}


def test_report_renders_every_section_with_counts_and_intervals() -> None:
    results = {
        "command": "python -m benchmarks.evaluation.forensic",
        "machine": "x86_64 CPU, 2 cores, no GPU",
        "config": SMALL.to_dict(),
        "attribution": [
            {
                "setting": "xmark-b32-k4-d2-t0.7",
                "bits": 32,
                "num_keys": 4,
                "temperature": 0.7,
                "T": 150,
                "decoder": "auto",
                "named": _rate(299, 300),
                "wrong": _rate(0, 300),
                "top1": _rate(300, 300),
                "median_confidence": 1.0,
            }
        ],
        "null": [
            {"texts_temperature": 0.7, "bits": 32, "num_keys": 4, "T": 150, "decoder": "auto", "named": _rate(0, 3000)}
        ],
        "robustness": [
            {
                "bits": 32,
                "num_keys": 4,
                "temperature": 0.7,
                "attack": "copy_paste",
                "level": 0.3,
                "decoder": "auto",
                "named": _rate(98, 100),
                "wrong": _rate(0, 100),
            }
        ],
        "quality": [
            {"bits": 32, "num_keys": 4, "temperature": 0.7, "texts": 300, "ppl_mean": 4.5, "ppl_median": 4.4},
            {"bits": None, "num_keys": None, "temperature": 0.7, "texts": 150, "ppl_mean": 3.3, "ppl_median": 3.2},
        ],
        "trace_cost": {
            "T": 150,
            "texts": 40,
            "threads": 2,
            "forward_s_p50": 0.2,
            "analysis_s_p50": 0.01,
            "trace_s_p50": 0.21,
        },
        "timing": {"generation_s": None, "scoring_s": 10.0, "scored_tokens": 1000, "analysis_s": 5.0},
    }
    text = render_forensic(results)
    assert "299/300 = 99.7 % (98.1–99.9)" in text
    assert "0/3000 = 0.0 % (0.0–0.1)" in text
    assert "copy paste 30 %" in text and "unwatermarked" in text
    assert "forward pass 0.200 s" in text
    assert "| b=32 k=4 τ=0.7 | 150 | auto |" in text  # the gateway's δ is not repeated per row


def test_report_names_a_stronger_bias_in_every_table() -> None:
    row = {"bits": 32, "num_keys": 4, "delta": 2.5, "temperature": 0.7}
    results = {
        "command": "python -m benchmarks.evaluation.forensic --preset strength",
        "machine": "x86_64 CPU, 2 cores, no GPU",
        "config": SMALL.to_dict(),
        "attribution": [
            {**row, "T": 150, "decoder": "auto", "named": _rate(300, 300), "wrong": _rate(0, 300)}
            | {"top1": _rate(300, 300), "median_confidence": 1.0}
        ],
        "null": [
            {"texts_temperature": 0.7, "bits": 32, "num_keys": 4, "delta": 2.5, "T": 150, "decoder": "auto"}
            | {"named": _rate(0, 3000)}
        ],
        "robustness": [],
        "quality": [{**row, "texts": 300, "ppl_mean": 6.1, "ppl_median": 6.0}],
        "timing": {"generation_s": 1.0, "scoring_s": 1.0, "scored_tokens": 10, "analysis_s": 1.0},
    }
    text = render_forensic(results)
    assert "| b=32 k=4 δ=2.5 τ=0.7 | 150 | auto |" in text
    assert "| b=32 k=4 δ=2.5 | 0.7 | 150 | auto |" in text
    assert "| b=32 k=4 δ=2.5 | 0.7 | 300 |" in text
    assert "--preset strength" in text and "identity test" not in text
    results["config"] = replace(SMALL, trace_identity_level=0.01).to_dict()
    assert "identity test against every other registered ID is at most 0.01" in render_forensic(results)


def test_the_gumbel_presets_sample_with_the_distortion_free_scheme() -> None:
    gumbel, forensic = (replace(config, registry_size=400) for config in (GUMBEL, FORENSIC))
    rows = jobs(gumbel, Population(gumbel), load_prompts())
    schemes = {row.spec_name: row.key.params.scheme for row in rows if row.key is not None}
    assert schemes == {"gumbel-b32-k1-d2-t0.7": "gumbel", "gumbel-b32-k1-d2-t1": "gumbel"}
    # the same authors, prompts and messages as the gateway's settings
    default = {(row.user, row.prompt, row.message) for row in jobs(forensic, Population(forensic), load_prompts())}
    assert {(row.user, row.prompt, row.message) for row in rows} <= default


def test_the_gumbel8_preset_reads_the_same_ids_in_8_bit_blocks() -> None:
    wide, narrow = (replace(config, registry_size=400) for config in (GUMBEL8, GUMBEL))
    rows = jobs(wide, Population(wide), load_prompts())
    marked = [row for row in rows if row.key is not None]
    assert {row.spec_name for row in marked} == {"gumbel-b32-bb8-k1-d2-t0.7", "gumbel-b32-bb8-k1-d2-t1"}
    assert {(row.key.params.block_bits, row.key.params.num_blocks) for row in marked} == {(8, 4)}
    assert {row.message.params.block_bits for row in marked if row.message is not None} == {8}
    # the same authors, prompts and ID bits as the 2-bit gumbel preset: only the blocks differ
    same = {(r.user, r.prompt, r.message.bits) for r in jobs(narrow, Population(narrow), load_prompts()) if r.message}
    assert {(r.user, r.prompt, r.message.bits) for r in marked if r.message is not None} == same
