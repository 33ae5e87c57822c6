"""The temperature preset of the forensic evaluation (no model): its cells take the encoder the
gateway's rule chooses, its texts are read under both encoders, the report."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.evaluation.config import engine_options, options_label, request_options
from benchmarks.evaluation.forensic import (
    GUMBEL8_LOW_TEMPERATURE,
    PRESETS,
    SAMPLING_OPTIONS,
    SWEEP_TEMPERATURES,
    TEMPERATURE,
    Evaluation,
    Population,
    jobs,
    temperature_cells,
    temperature_config,
)
from benchmarks.evaluation.metrics import wilson
from benchmarks.evaluation.plots import temperature_frontier
from benchmarks.evaluation.population import evaluation_key, evaluation_secret
from benchmarks.evaluation.prompts import load_prompts
from benchmarks.evaluation.report import render_temperature
from benchmarks.evaluation.store import GenerationStore
from service.config import Settings
from service.fleet import ServedModel
from service.schemas.chat import SamplingRequest
from service.services.encoder_choice import EncoderRule, companion_reason
from service.trace.plan import FanoutPlan, decoders_for, plan_for
from service.vocabulary import TraceDecoder
from xmark_core.encoders import companion_key, spec_for

VERSION = spec_for("auto")
SMALL = replace(TEMPERATURE, registry_size=200)


def _rule_says_companion(temperature: float, options: dict) -> bool:
    """The gateway's rule at its default thresholds, asked directly."""
    fields = Settings.model_fields
    rule = EncoderRule(
        min_temperature=fields["watermark_sampling_min_temperature"].default,
        min_top_p=fields["watermark_sampling_min_top_p"].default,
    )
    served = ServedModel("m", SimpleNamespace(salts_per_answer=True, encoders_per_request=True))  # type: ignore[arg-type]
    options = dict(options)
    body = SamplingRequest(model="m", temperature=temperature, top_p=options.pop("top_p", 1.0))
    return bool(companion_reason(body, options, served=served, rule=rule))


def test_every_cell_of_the_rule_has_the_encoder_the_gateways_rule_chooses() -> None:
    threshold = Settings.model_fields["watermark_sampling_min_temperature"].default
    marked = [s for s in TEMPERATURE.settings if s.bits]
    ruled = [s for s in marked if s.by_rule]
    assert {s.temperature for s in ruled if not s.options} == set(SWEEP_TEMPERATURES)
    for setting in ruled:
        assert setting.companion == _rule_says_companion(setting.temperature, request_options(setting.options))
        params = VERSION.companion if setting.companion else VERSION.primary
        assert setting.spec.params() == params
    # below the default threshold the companion writes, at and above it the distortion-free primary
    assert all(s.companion for s in ruled if s.temperature < threshold)
    assert not any(s.companion for s in ruled if s.temperature >= threshold and not s.options)
    # a penalty or a logit_bias list goes to the companion whatever the temperature; the nucleus of
    # top_p 0.9, the rule's bound, stays with the keyed sampler
    options = [s for s in ruled if s.options]
    assert [s.options for s in options] == list(SAMPLING_OPTIONS)
    assert [s.companion for s in options] == [dict(o).get("top_p") is None for o in SAMPLING_OPTIONS]
    assert [s.options for s in options if not s.companion] == [(("top_p", 0.9),)]
    assert all(s.temperature >= threshold for s in options)


def test_the_other_encoder_is_measured_next_to_the_switch_and_never_greedy() -> None:
    threshold = Settings.model_fields["watermark_sampling_min_temperature"].default
    others = [s for s in TEMPERATURE.settings if s.bits and not s.by_rule]
    gumbel = sorted(s.temperature for s in others if not s.companion)
    xmark = sorted(s.temperature for s in others if s.companion)
    # the preset measures the rule's cells alone (the other encoder: gumbel8s16-low, companion-d*);
    # asked for neighbours, the sweep puts the other encoder on each side of the switch, never greedy
    assert not gumbel and not xmark
    beside = temperature_config(neighbours=1)
    others = [s for s in beside.settings if s.bits and not s.by_rule]
    gumbel = sorted(s.temperature for s in others if not s.companion)
    xmark = sorted(s.temperature for s in others if s.companion)
    assert gumbel == [t for t in SWEEP_TEMPERATURES if 0.0 < t < threshold][-1:]
    assert xmark == [t for t in SWEEP_TEMPERATURES if t >= threshold][:1]
    # every cell name is one of its own
    names = [s.name for s in TEMPERATURE.settings]
    assert len(names) == len(set(names))


def test_the_counts_meet_the_issues_and_each_cell_has_its_unwatermarked_pair() -> None:
    marked = [s for s in TEMPERATURE.settings if s.bits]
    assert all(s.authors >= 200 for s in marked if not s.options)
    assert all(s.authors >= 100 for s in marked if s.options)
    for setting in marked:
        base = [
            s
            for s in TEMPERATURE.settings
            if s.bits == 0 and (s.temperature, s.options) == (setting.temperature, setting.options)
        ]
        assert len(base) == 1
        assert base[0].authors * (1 + TEMPERATURE.null_key_count(setting.temperature)) >= 1000
    assert wilson(0, 1000)[1] < 0.004
    assert TEMPERATURE.t_grid == (150,) and TEMPERATURE.registry_size == 10_000


def test_the_64_bit_preset_is_the_rules_cells_on_the_default_version_at_64_bits() -> None:
    """temperature-b64: every cell the rule sends to the biasing companion, and the keyed sampler's
    cells REGISTRY-SCALE.md does not measure (1.3, top_p 0.9), written by the 64-bit version's
    encoders as the gateway's rule picks them, each with its unwatermarked pair."""
    preset = PRESETS["temperature-b64"]
    version = spec_for("auto", bits=64)
    assert version.companion is not None and version.companion.bits == version.primary.bits == 64
    marked = [s for s in preset.settings if s.bits]
    assert all(s.by_rule for s in marked)
    for setting in marked:
        assert setting.companion == _rule_says_companion(setting.temperature, request_options(setting.options))
        assert setting.spec.params() == (version.companion if setting.companion else version.primary)
        base = [
            s
            for s in preset.settings
            if s.bits == 0 and (s.temperature, s.options) == (setting.temperature, setting.options)
        ]
        assert len(base) == 1 and base[0].authors * (1 + preset.null_key_count(setting.temperature)) >= 500
    companion = {(s.temperature, s.options) for s in marked if s.companion}
    assert companion == {(t, ()) for t in SWEEP_TEMPERATURES if t < 0.7} | {
        (0.7, o) for o in SAMPLING_OPTIONS if dict(o).get("top_p") is None
    }
    assert {(s.temperature, s.options) for s in marked if not s.companion} == {(1.3, ()), (0.7, (("top_p", 0.9),))}
    assert all(s.authors >= 200 for s in marked if not s.options) and all(s.authors >= 100 for s in marked)
    assert preset.t_grid == (150,) and preset.max_tokens == 150 and preset.registry_size == 10_000
    names = [s.name for s in preset.settings]
    assert len(names) == len(set(names)) and not set(names) & {s.name for s in TEMPERATURE.settings if s.bits}


def test_the_gumbel_cells_are_the_low_temperature_presets_answers() -> None:
    """The cached answers of gumbel8s16-low are reused: the same names, answer length, seed, registry."""
    low = {s.name for s in GUMBEL8_LOW_TEMPERATURE.settings}
    ours = {s.name for s in TEMPERATURE.settings}
    assert {"none-t0.3", "none-t0.5"} <= low & ours
    other = PRESETS["gumbel8s16-low"]
    assert "gumbel8s16-low" in TEMPERATURE.reuse
    assert (other.seed, other.registry_size, other.max_tokens) == (
        TEMPERATURE.seed,
        TEMPERATURE.registry_size,
        TEMPERATURE.max_tokens,
    )


def test_the_options_name_their_cells_and_reach_the_engine() -> None:
    fp, pp, lb, tp = SAMPLING_OPTIONS
    assert options_label(fp) == "-fp0.5" and options_label(pp) == "-pp0.5" and options_label(tp) == "-tp0.9"
    assert engine_options(tp) == {"top_p": 0.9}
    assert options_label(lb).startswith("-lb") and len(options_label(lb)) == 11
    assert options_label(()) == ""
    bias = engine_options(lb)["logit_bias"]
    assert bias[260] == -100.0 and all(isinstance(k, int) for k in bias)
    assert request_options(lb)["logit_bias"]["260"] == -100.0  # an OpenAI request's JSON object
    assert engine_options(fp) == {"frequency_penalty": 0.5}


def test_jobs_carry_each_encoders_key_and_the_options() -> None:
    population = Population(SMALL)
    rows = jobs(SMALL, population, load_prompts())
    marked = [r for r in rows if r.key is not None]
    secret = evaluation_secret(SMALL.seed)
    for row in marked:
        assert row.message is not None and row.message.params.block_bits == row.key.params.block_bits
        if row.companion:
            assert row.key.fingerprint == companion_key(secret, VERSION.companion).fingerprint
        else:  # the primary's key is the evaluation key of its parameters (the gumbel presets' answers)
            assert row.key.fingerprint == evaluation_key(VERSION.primary, SMALL.seed).fingerprint
    assert {r.options for r in rows if r.options} == set(SAMPLING_OPTIONS)
    # the same ID bits and prompts for either encoder of one author
    by_author = {}
    for row in marked:
        by_author.setdefault(row.user, set()).add((row.prompt, row.message.bits))
    assert all(len(v) == 1 for v in by_author.values())


def test_a_cells_trace_reads_both_encoders_and_counts_both(tmp_path: Path) -> None:
    population = Population(SMALL)
    evaluation = Evaluation(SMALL, population, GenerationStore(tmp_path / "g.jsonl"), SimpleNamespace(tokenizer=None))  # type: ignore[arg-type]
    setting = next(s for s in SMALL.settings if s.bits and not s.companion)
    groups = evaluation.reading(setting.spec.params())
    assert [g.versions[0].key.params for g in groups] == [VERSION.primary, VERSION.companion]
    assert [g.versions[0].is_companion for g in groups] == [False, True]
    assert all(len(g.snapshot) == SMALL.registry_size for g in groups)
    plan = trace_plan("auto", groups)
    assert plan.key_versions == 2
    assert plan.tries == 2 * trace_plan("auto", groups[:1]).tries
    # an independent key version: other keys of both encoders
    null = evaluation.reading(setting.spec.params(), version=1)
    assert {g.versions[0].key.fingerprint for g in null}.isdisjoint({g.versions[0].key.fingerprint for g in groups})
    # a single-scheme preset still reads one key version
    single = Evaluation(
        replace(GUMBEL8_LOW_TEMPERATURE, registry_size=200),
        Population(replace(GUMBEL8_LOW_TEMPERATURE, registry_size=200)),
        GenerationStore(tmp_path / "h.jsonl"),
        SimpleNamespace(tokenizer=None),
    )  # type: ignore[arg-type]
    assert trace_plan("auto", single.reading(VERSION.primary)).key_versions == 1


def trace_plan(decoder: str, groups: list) -> FanoutPlan:
    """The plan /trace runs over ``groups`` for one model's text (as ``forensic.trace`` traces)."""
    return plan_for(groups, [], decoders_for(TraceDecoder(decoder), scorer_available=True))


def _rate(count: int, trials: int) -> dict:
    return {"count": count, "of": trials, "rate": count / trials, "ci95": wilson(count, trials)}


def _results() -> dict:
    """Results of the sweep's cells as the run writes them (synthetic figures)."""
    config = TEMPERATURE
    attribution, quality, null = [], [], []
    choices = []
    for setting in config.settings:
        ratio = {"ratio": 1.0 if setting.scheme == "gumbel" else 1.3, "ci95": [0.95, 1.4], "n": 100}
        quality.append(
            {
                "setting": setting.name,
                "texts": setting.authors,
                "ppl_median": 3.0,
                "ppl_ratio": ratio if setting.bits else None,
            }
        )
        if setting.bits:
            named = 120 if setting.scheme == "gumbel" and setting.temperature < 0.7 else setting.authors - 1
            attribution.append(
                {"setting": setting.name, "T": 150, "authors": setting.authors, "named": _rate(named, setting.authors)}
                | {"wrong": _rate(0, setting.authors), "named_by_encoder": {setting.scheme: named}}
            )
            reason = "temperature" if setting.temperature < 0.7 else ""
            reason = reason or ("frequency_penalty" if setting.companion and setting.options else "")
            choices.append({"setting": setting.name, "encoder": "xmark" if reason else "gumbel", "reason": reason})
        else:
            null.append(
                {"texts_setting": setting.name, "texts_temperature": setting.temperature, "T": 150, "decoder": "auto"}
                | {"options": request_options(setting.options), "named": _rate(0, 1000), "named_by_encoder": {}}
            )
    results = {
        "command": "python -m benchmarks.evaluation.forensic --preset temperature",
        "machine": "x86_64 CPU, 2 cores, no GPU",
        "config": config.to_dict(),
        "attribution": attribution,
        "quality": quality,
        "null": null,
        "rule": {
            "min_temperature": 0.7,
            "min_top_p": 0.9,
            "primary": config.to_dict()["key_version"]["primary"],
            "companion": config.to_dict()["key_version"]["companion"],
            "choices": choices,
        },
        "timing": {"generation_s": None, "scoring_s": 1.0, "scored_tokens": 10, "analysis_s": 1.0},
    }
    results["cells"] = temperature_cells(config, results)
    return results


def test_the_report_has_every_cell_in_one_table_and_the_frontier(tmp_path: Path) -> None:
    results = _results()
    plot = tmp_path / "temperature_frontier.png"
    assert temperature_frontier(results, plot) and plot.stat().st_size > 0
    results["frontier_plot"] = plot.name
    text = render_temperature(results)
    cells = [s for s in TEMPERATURE.settings if s.bits]
    table = [line for line in text.splitlines() if line.startswith("| ") and "/ 1,000" in line]
    assert len(table) == len(cells)  # one row per cell, each with its unwatermarked traces
    assert "| 0.5 | – | xmark (companion) | xmark (temperature) | rule | 200 | 199/200 = 99.5 %" in text
    assert "| other |" not in text  # the preset measures the rule's cells alone
    assert "| 0.7 | top_p 0.9 | gumbel (primary) | gumbel | rule | 100 |" in text
    assert "| 0.7 | frequency_penalty 0.5 | xmark (companion) |" in text
    assert "missed at" not in text and "met in every cell" in text  # the rule's cells all name
    assert "x86_64 CPU, 2 cores" in text and "--preset temperature" in text
    assert "temperature_frontier.png" in text and "logit_bias" in text


@pytest.mark.parametrize("preset", ["temperature", "temperature-small"])
def test_the_presets_write_the_temperature_report(preset: str) -> None:
    assert PRESETS[preset].report == "temperature" and PRESETS[preset].decoders == ("auto",)
