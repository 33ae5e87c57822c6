"""The quality evaluation's measures (benchmarks.evaluation.quality): loops, diversity, pairing, jobs."""

from __future__ import annotations

import math

import pytest

from benchmarks.evaluation.quality import (
    GUMBEL,
    GUMBEL8_SALTED,
    QUALITY,
    answer_seed,
    distinct,
    ends_in_loop,
    frontier,
    jaccard4,
    jobs,
    paired_ppl_ratio,
    quality_prompts,
)


def test_the_quality_prompt_set_has_at_least_200_prompts_of_every_kind() -> None:
    prompts = quality_prompts()
    assert len(prompts) >= 200
    assert len({p.id for p in prompts}) == len(prompts)
    kinds = {p.category for p in prompts}
    assert kinds == {"completion", "story", "summarization", "explanation", "factual"}
    assert min(sum(p.category == k for p in prompts) for k in kinds) >= 30


def test_a_loop_is_a_periodic_tail_and_nothing_else() -> None:
    assert ends_in_loop(list(range(100)) + [5, 6, 7] * 20)  # period 3 over the last 48 tokens
    assert ends_in_loop([1] * 60)
    assert not ends_in_loop(list(range(200)))
    assert not ends_in_loop([5, 6, 7] * 10)  # shorter than the window
    # periodic once, then broken in the last tokens: the answer recovered
    assert not ends_in_loop([5, 6, 7] * 30 + [100, 101])
    assert not ends_in_loop(list(range(60)) + list(range(17)) * 3)  # period 17 > 16


def test_distinct_and_jaccard() -> None:
    assert distinct([1, 2, 3, 4], 2) == 1.0
    assert distinct([1, 1, 1, 1], 1) == 0.25
    assert distinct([1], 2) is None
    assert jaccard4([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) == 1.0
    assert jaccard4([1, 2, 3, 4, 5], [2, 3, 4, 5, 6]) == pytest.approx(1 / 3)
    assert jaccard4([1, 2, 3], [1, 2, 3, 4]) is None


def test_the_paired_ratio_is_the_ratio_of_geometric_means() -> None:
    plain = [1.0, 1.5, 2.0, 1.2]
    marked = [v + math.log(1.2) for v in plain]  # every answer 1.2x the perplexity of its pair
    out = paired_ppl_ratio(marked, plain)
    assert out["ratio"] == pytest.approx(1.2, abs=1e-4) and out["n"] == 4
    lo, hi = out["ci95"]
    assert lo == pytest.approx(1.2, abs=1e-4) and hi == pytest.approx(1.2, abs=1e-4)


def test_every_setting_answers_the_same_prompts_with_the_same_seeds() -> None:
    prompts = quality_prompts()[:30]
    rows = jobs(QUALITY, prompts)
    by_setting: dict[str, list[tuple[str, int]]] = {}
    for job in rows:
        by_setting.setdefault(job.spec_name, []).append((job.prompt_id, job.slot))
    pairs = list(by_setting.values())
    assert len(pairs) == len(QUALITY.specs) * len(QUALITY.temperatures)
    assert all(p == pairs[0] for p in pairs)
    assert len(pairs[0]) == 20 * QUALITY.repeats + 10  # the first 20 prompts answered 4 times
    assert answer_seed(0, 3, 1, 0.7) == answer_seed(0, 3, 1, 0.7) != answer_seed(0, 3, 2, 0.7)
    # the watermarked rows carry a message under the key of their own parameters, the others none
    for job in rows:
        if job.spec_name.startswith("none"):
            assert job.key is None and job.message is None
        else:
            assert job.key is not None and job.message is not None
            assert job.key.params.bits == 32 and job.message.params == job.key.params


def test_the_gumbel_preset_pairs_with_the_quality_runs_unwatermarked_answers() -> None:
    prompts = quality_prompts()[:25]
    plain = {(j.prompt_id, j.slot, j.temperature) for j in jobs(QUALITY, prompts) if j.key is None}
    rows = jobs(GUMBEL, prompts)
    assert {(j.prompt_id, j.slot, j.temperature) for j in rows if j.key is None} == plain
    marked = [j for j in rows if j.key is not None]
    assert {j.key.params.scheme for j in marked if j.key is not None} == {"gumbel"}
    # one user per prompt: the repeats are that user asking again
    by_prompt: dict[str, set[str]] = {}
    for j in marked:
        assert j.message is not None
        by_prompt.setdefault(j.prompt_id, set()).add(j.message.bits)
    assert all(len(messages) == 1 for messages in by_prompt.values())


def test_the_salted_preset_gives_a_users_answers_consecutive_salts() -> None:
    """As the gateway's rotation: one prompt's repeats (one user asking again) take consecutive salts
    from a first one drawn per user; the unwatermarked answers are the quality run's."""
    prompts = quality_prompts()[:25]
    rows = jobs(GUMBEL8_SALTED, prompts)
    plain = {(j.prompt_id, j.slot, j.temperature) for j in jobs(QUALITY, prompts) if j.key is None}
    assert {(j.prompt_id, j.slot, j.temperature) for j in rows if j.key is None} == plain
    marked = [j for j in rows if j.key is not None]
    assert {(j.key.params.block_bits, j.key.params.salts) for j in marked if j.key is not None} == {(8, 16)}
    firsts = set()
    for temperature in GUMBEL8_SALTED.temperatures:
        for prompt in prompts[: GUMBEL8_SALTED.repeat_prompts]:
            answers = sorted(
                (j.slot, j.salt) for j in marked if j.prompt_id == prompt.id and j.temperature == temperature
            )
            assert len(answers) == GUMBEL8_SALTED.repeats
            first = answers[0][1]
            assert [salt for _, salt in answers] == [(first + slot) % 16 for slot, _ in answers]
            firsts.add(first)
    assert len(firsts) > 5  # the first salt is drawn per user, not fixed
    assert all(j.salt == 0 for j in rows if j.key is None)


def _cell(count: int, of: int) -> dict[str, object]:
    return {"count": count, "of": of, "rate": count / of, "ci95": [0.0, 1.0]}


def test_the_frontier_joins_naming_and_paired_ratios_across_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    def attribution(scheme: str, k: int, decoder: str) -> dict[str, object]:
        return {
            "scheme": scheme,
            "bits": 32,
            "num_keys": k,
            "delta": 2.0,
            "min_entropy": 0.0,
            "temperature": 0.7,
            "T": 150,
            "decoder": decoder,
            "named": _cell(290, 300),
            "wrong": _cell(0, 300),
        }

    plain_quality = {"temperature": 0.7, "bits": None, "ppl_mean": 4.0}
    (tmp_path / "forensic.json").write_text(
        json.dumps(
            {
                "attribution": [attribution("xmark", 4, "auto"), attribution("xmark", 4, "counting")],
                "quality": [plain_quality, {**attribution("xmark", 4, "auto"), "ppl_mean": 6.0}],
            }
        )
    )
    (tmp_path / "forensic-gumbel.json").write_text(
        json.dumps(
            {
                "attribution": [attribution("gumbel", 1, "counting")],
                "quality": [plain_quality, {**attribution("gumbel", 1, "counting"), "ppl_mean": 4.1}],
            }
        )
    )
    paired = {"scheme": "gumbel", "bits": 32, "num_keys": 1, "delta": 2.0, "min_entropy": 0.0, "temperature": 0.7}
    (tmp_path / "quality-gumbel.json").write_text(
        json.dumps({"rows": [{**paired, "watermarked": True, "ppl_ratio": {"ratio": 1.01}}]})
    )
    wide = {**attribution("gumbel", 1, "auto"), "block_bits": 8, "named": _cell(292, 300)}
    null = {"scheme": "gumbel", "bits": 32, "block_bits": 8, "num_keys": 1, "delta": 2.0}
    (tmp_path / "forensic-gumbel8.json").write_text(
        json.dumps(
            {
                "attribution": [wide],
                "quality": [plain_quality, {**wide, "ppl_mean": 4.05}],
                # unwatermarked texts named under its keys: per text temperature, T and decoder
                "null": [
                    {**null, "texts_temperature": temperature, "T": t, "decoder": decoder, "named": _cell(n, 3000)}
                    for temperature, t, decoder, n in (
                        (0.7, 150, "auto", 3),
                        (1.0, 150, "auto", 2),
                        (0.7, 100, "auto", 9),
                    )
                ]
                + [{**null, "texts_temperature": 0.7, "T": 150, "decoder": "counting", "named": _cell(7, 3000)}],
            }
        )
    )
    points = frontier([], tmp_path)
    assert [(p["scheme"], p["block_bits"], p["ppl_ratio"], p["ppl_source"]) for p in points] == [
        ("gumbel", 2, 1.01, "quality"),  # its paired ratio from the gumbel quality run, its naming by counting
        # 8-bit blocks: a setting of its own (the 2-bit quality run does not stand for it)
        ("gumbel", 8, 1.0125, "forensic-gumbel8.json"),
        ("xmark", 2, 1.5, "forensic.json"),  # no quality run measured it here: the forensic run's ratio
    ]
    assert points[1]["named"]["count"] == 292
    assert points[1]["false"]["count"] == 3  # auto at T = 150 and its own temperature
    assert points[0]["false"] is None  # a forensic run without a null section
