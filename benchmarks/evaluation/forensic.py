"""The forensic evaluation: how often /trace names the author of a short text, and never the wrong one.

    python -m benchmarks.evaluation.forensic [--report-only] [--max-num-seqs 128]

Protocol (``FORENSIC``):

* For each message length b, 10,000 message IDs are allocated by the gateway's own allocator
  (``MessageAllocator``: registered IDs far apart); the authors are a seeded sample of them.
* Each author asks one prompt of the committed set and gets one answer of 300 tokens (EOS and
  special tokens suppressed, as in the paper's protocol), watermarked with their message ID under
  the setting's parameters (δ = 2, d = 2), at the setting's sampling temperature. The
  unwatermarked answers of the same prompts are the null texts and the copy-paste sources.
* Trace view: the answer is decoded to text and tokenized again, with no prompt, as a text pasted
  into ``/trace``. A text of T tokens is the re-tokenized answer's first T' tokens, T' being the
  length of the re-tokenized T-token prefix. The model's top-20 log-probabilities come from one
  forward pass over the whole re-tokenized answer (``service.backends.scoring``, the local
  backend's own code); a causal model gives a prefix the same scores.
* Every text is read by the gateway's own analysis (``service.trace.analysis``), with one
  key version and α = 0.001: counting alone, likelihood alone (temperature 0.7 assumed, as the
  gateway's default), and ``auto`` (the gateway's default: counting, then likelihood when counting
  names nobody; both tested at α / 2).
* Null: every unwatermarked text is traced under the evaluation key and under independent keys
  that never touched a text, each (text, key) pair a separate trace with one key version.
* Robustness at T = 300: copy-paste (30 % of the tokens replaced by the same span of the
  unwatermarked answer to the same prompt), word deletion and token substitution (20 %).
* A preset with a per-request key version (``ForensicConfig.key_version``, the ``temperature``
  preset: the gateway's default ``spec_for("auto")``) writes each cell with one of its encoders,
  chosen by the gateway's own rule (``encoder_choice.companion_reason``) or set to the other one
  for comparison, and traces every text, the null texts included, under both encoders: two
  readings of one fan-out, each one test of its count, as ``/trace`` reads such a version. Its
  cells may carry sampling options (penalties, ``logit_bias``) that the engine applies, and its
  null texts are per temperature and options; it writes ``TEMPERATURE.md`` (``report.render_temperature``).

Every rate comes with its count and a Wilson 95 % interval. Writes ``docs/results/FORENSIC.md``
and ``docs/results/forensic.json``; completions and model scores are cached under
``var/eval/forensic-seed<seed>`` so ``--report-only`` re-analyses without the model.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.trace.policy import TracePolicy
from xmark_core import (
    CandidateSet,
    Message,
    MessageAllocator,
    ModelScores,
    WatermarkKey,
    WatermarkParams,
)
from xmark_core.encoders import PER_REQUEST, KeyVersionSpec, encoder_keys, spec_for

from .attacks import copy_paste, delete_words, substitute_tokens
from .config import UNWATERMARKED, GenSpec, SamplingOptions, request_options
from .generation import RowJob, RowResult
from .metrics import rate_cell
from .population import evaluation_key, evaluation_secret, null_keys
from .prompts import Prompt, load_prompts
from .store import GenerationStore

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from service.keyring import KeyVersionHandle
    from service.services.encoder_choice import EncoderRule
    from service.services.registry_cache import RegistrySnapshot
    from service.trace.analysis import LengthGroup, TraceOutcome

# every threshold of a trace, as the gateway's default settings fill it
PRODUCT_POLICY = TracePolicy()
DECODERS = ("counting", "likelihood", "auto")
ATTACKS = ("copy_paste", "word_deletion", "token_substitution")


@dataclass(frozen=True)
class Setting:
    """One generation setting: ``bits`` 0 = unwatermarked (null texts and copy-paste sources)."""

    bits: int
    num_keys: int
    temperature: float
    authors: int
    headline: bool = False
    delta: float = 2.0
    min_entropy: float = 0.0  # the entropy rule (WatermarkParams.min_entropy)
    scheme: str = "xmark"
    block_bits: int = 2
    salts: int = 1  # WatermarkParams.salts (``gumbel``): each author's answer under a salt drawn at random
    # a per-request key version's biasing encoder (ForensicConfig.key_version): its companion key
    companion: bool = False
    # sampling options of the requests (penalties, logit_bias), as the engine applies them
    options: SamplingOptions = ()
    # the encoder the gateway's rule chooses for this cell's requests (False: the version's other
    # encoder, measured beside it to show what the rule's choice buys)
    by_rule: bool = False

    @property
    def spec(self) -> GenSpec:
        if self.bits == 0:
            return GenSpec(UNWATERMARKED, temperature=self.temperature, options=self.options)
        return GenSpec(
            self.scheme,
            self.bits,
            self.num_keys,
            self.delta,
            self.temperature,
            min_entropy=self.min_entropy,
            block_bits=self.block_bits,
            salts=self.salts,
            companion=self.companion,
            options=self.options,
        )

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class ForensicConfig:
    settings: tuple[Setting, ...]
    t_grid: tuple[int, ...] = (100, 150, 200, 300)
    max_tokens: int = 300
    registry_size: int = 10_000
    # the trace's policy: the product's (service.trace.policy) unless a preset or a flag varies it
    alpha: float = PRODUCT_POLICY.alpha
    trace_temperature: float = PRODUCT_POLICY.temperature
    trace_edit_rate: float = PRODUCT_POLICY.edit_rate
    # the likelihood decoder's identity test (xmark_core.likelihood.identity_test); None: off, as /trace
    trace_identity_level: float | None = PRODUCT_POLICY.identity_level
    top_k: int = PRODUCT_POLICY.top_k
    # (text, key) pairs per null text: the evaluation key plus this many independent keys
    null_keys: dict[float, int] | None = None
    attack_level: float = 0.2
    copy_paste_level: float = 0.3
    attack_authors: int = 100
    # null pairs at T other than 150 (auto only): keys per text
    other_t_keys: int = 3
    # larger registries (beyond registry_size: random IDs), per message length
    scaling_sizes: dict[int, tuple[int, ...]] = field(default_factory=lambda: {16: (65_536,), 32: (100_000, 1_000_000)})
    seed: int = 0
    # a per-request key version (configured scheme ``auto``): each watermarked setting is written by
    # one of its encoders (``Setting.companion``), and every text is traced under both, as /trace
    # reads a version (two readings, each one test of the count); None: one key version per setting
    key_version: KeyVersionSpec | None = None
    decoders: tuple[str, ...] = DECODERS
    # presets whose caches hold answers this one would generate identically (same seed, registry,
    # answer length and setting names: each row's seed is its own): copied instead of generated
    reuse: tuple[str, ...] = ()
    # the stem of the files written (``temperature``: temperature.json and TEMPERATURE.md); "": forensic
    report: str = ""

    def policy(self, *, counting_only: bool = False) -> TracePolicy:
        """The policy this preset traces with (``counting_only``: a counting trace, which runs no
        identity test)."""
        return replace(
            PRODUCT_POLICY,
            alpha=self.alpha,
            temperature=self.trace_temperature,
            edit_rate=self.trace_edit_rate,
            identity_level=None if counting_only else self.trace_identity_level,
            top_k=self.top_k,
        )

    def null_key_count(self, temperature: float) -> int:
        return (self.null_keys or {}).get(temperature, 9)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["null_keys"] = {str(k): v for k, v in (self.null_keys or {}).items()}
        out["scaling_sizes"] = {str(k): list(v) for k, v in self.scaling_sizes.items()}
        return out


FORENSIC = ForensicConfig(
    settings=(
        Setting(32, 4, 0.7, 300, headline=True),
        Setting(32, 4, 1.0, 300, headline=True),
        Setting(32, 2, 0.7, 100),
        Setting(16, 2, 0.7, 50),
        Setting(0, 0, 0.7, 100),
        Setting(0, 0, 1.0, 100),
    ),
    null_keys={0.7: 29, 1.0: 29},
)

# Stronger watermarks than the gateway's default (b=32, k=4, δ=2) at temperature 0.7, where the
# default names 97 % at T=150: more hash keys (a smaller boosted list) or a larger bias, with the
# same authors, prompts, registry and null texts as FORENSIC (its cache is not shared: the answers
# are generated again). Larger registries only at 100,000 (the analysis of 1,000,000 is the longest).
STRENGTH = ForensicConfig(
    settings=(
        Setting(32, 6, 0.7, 300, headline=True),
        Setting(32, 4, 0.7, 300, headline=True, delta=2.5),
        Setting(0, 0, 0.7, 100),
    ),
    null_keys={0.7: 29},
    scaling_sizes={32: (100_000,)},
)

# The entropy rule (WatermarkParams.min_entropy = h): no bias where the model's top token has
# probability above 1/2 (h = 0.69 nats), at the default bias and at a larger one, with the default
# key otherwise (b=32, k=4); FORENSIC.md (δ = 2) and FORENSIC-STRENGTH.md (δ = 2.5) hold the same
# biases without the rule. Answers of 200 tokens (T up to 200): the naming rates at T = 150 compare
# with theirs; the perplexities (over 200 tokens) compare with this run's unwatermarked answers.
ENTROPY = ForensicConfig(
    settings=(
        Setting(32, 4, 0.7, 300, headline=True, min_entropy=0.69),
        Setting(32, 4, 0.7, 300, headline=True, delta=2.5, min_entropy=0.69),
        Setting(32, 4, 1.0, 300, headline=True, delta=2.5, min_entropy=0.69),
        Setting(0, 0, 0.7, 100),
        Setting(0, 0, 1.0, 100),
    ),
    t_grid=(100, 150, 200),
    max_tokens=200,
    null_keys={0.7: 29, 1.0: 29},
    scaling_sizes={},
)

# The distortion-free scheme (scheme ``gumbel``, xmark_core.gumbel: keyed Gumbel-max sampling, b = 32,
# d = 2), read by its own decoders (counting: exact Gamma p-values; likelihood: xmark_core.gumbel_likelihood,
# the model's probability of each token weighing its uniform). Answers of 200 tokens, the same authors,
# prompts and registry as the other presets.
GUMBEL = ForensicConfig(
    settings=(
        Setting(32, 1, 0.7, 300, headline=True, scheme="gumbel"),
        Setting(32, 1, 1.0, 300, headline=True, scheme="gumbel"),
        Setting(0, 0, 0.7, 100),
        Setting(0, 0, 1.0, 100),
    ),
    t_grid=(100, 150, 200),
    max_tokens=200,
    null_keys={0.7: 29, 1.0: 29},
    scaling_sizes={},
)

# The distortion-free scheme with blocks of 8 bits (b = 32: r = 4 blocks of 256 values) instead of 2:
# the same IDs (the allocator's, drawn far apart in bits), authors, prompts and null texts as GUMBEL.
# With 2-bit blocks an author's nearest registered ID differs from theirs in a few of 16 blocks, and
# the identity test, which reads only those blocks' tokens, refuses most authors the decoders rank
# first; with 8-bit blocks the nearest ID differs in most of the text.
GUMBEL8 = ForensicConfig(
    settings=(
        Setting(32, 1, 0.7, 300, headline=True, scheme="gumbel", block_bits=8),
        Setting(32, 1, 1.0, 300, headline=True, scheme="gumbel", block_bits=8),
        Setting(0, 0, 0.7, 100),
        Setting(0, 0, 1.0, 100),
    ),
    t_grid=(100, 150, 200),
    max_tokens=200,
    null_keys={0.7: 29, 1.0: 29},
    scaling_sizes={32: (100_000,)},
)

# The same with 16 salts (WatermarkParams.salts): each author's answer under a salt drawn at random,
# the decoders trying all 16 (p-values x 16); what the salts cost in naming.
GUMBEL8_SALTED = replace(
    GUMBEL8,
    settings=(
        Setting(32, 1, 0.7, 300, headline=True, scheme="gumbel", block_bits=8, salts=16),
        Setting(32, 1, 1.0, 300, headline=True, scheme="gumbel", block_bits=8, salts=16),
        *GUMBEL8.settings[2:],
    ),
)

# Where the distortion-free encoder stops carrying its message: the default scheme's keyed sampler
# (8-bit blocks, 16 salts) at temperatures 0.3 and 0.5, below the sweep above; a per-request key
# version's rule (XMARK_WATERMARK_SAMPLING_MIN_TEMPERATURE) sends requests below its threshold to the
# biasing encoder (service.services.encoder_choice).
GUMBEL8_LOW_TEMPERATURE = replace(
    GUMBEL8,
    settings=(
        Setting(32, 1, 0.3, 200, headline=True, scheme="gumbel", block_bits=8, salts=16),
        Setting(32, 1, 0.5, 200, headline=True, scheme="gumbel", block_bits=8, salts=16),
        Setting(0, 0, 0.3, 100),
        Setting(0, 0, 0.5, 100),
    ),
    null_keys={0.3: 29, 0.5: 29},
    attack_authors=0,
    scaling_sizes={},
)


@dataclass(frozen=True)
class _EvaluationEngine:
    """What the gateway's encoder rule reads of a backend: the evaluation's engine writes every
    answer as a request of its own (n = 1) and serves both encoders of a per-request version."""

    salts_per_answer: bool = True
    encoders_per_request: bool = True


def encoder_rule() -> EncoderRule:
    """The gateway's encoder rule at its default thresholds (``service.config.Settings``' defaults)."""
    from service.config import Settings
    from service.services.encoder_choice import EncoderRule

    fields = Settings.model_fields
    return EncoderRule(
        min_temperature=fields["watermark_sampling_min_temperature"].default,
        min_top_p=fields["watermark_sampling_min_top_p"].default,
    )


def companion_reason_of(temperature: float, options: SamplingOptions = (), rule: EncoderRule | None = None) -> str:
    """The request field that sends a request at ``temperature`` with ``options`` (full vocabulary:
    top_p 1, top_k off, n = 1, as the evaluation samples) to a per-request version's companion
    encoder, "" for the primary: the gateway's own rule (``encoder_choice.companion_reason``)."""
    from service.fleet import ServedModel
    from service.schemas.chat import SamplingRequest
    from service.services.encoder_choice import companion_reason

    fields = dict(options)
    body = SamplingRequest(model="evaluation", temperature=temperature, top_p=fields.pop("top_p", 1.0))
    served = ServedModel("evaluation", _EvaluationEngine())  # type: ignore[arg-type]  # the rule's view of a backend
    return companion_reason(body, request_options(tuple(fields.items())), served=served, rule=rule or encoder_rule())


def encoder_setting(
    version: KeyVersionSpec,
    temperature: float,
    authors: int,
    *,
    companion: bool,
    by_rule: bool,
    options: SamplingOptions = (),
) -> Setting:
    """A cell written by one encoder of ``version`` (its primary, or with ``companion`` its companion)."""
    params = version.companion if companion else version.primary
    if params is None:
        raise ValueError("a companion cell needs a key version with a companion encoder")
    return Setting(
        params.bits,
        params.num_keys,
        temperature,
        authors,
        headline=True,
        delta=params.delta,
        min_entropy=params.min_entropy,
        scheme=params.scheme,
        block_bits=params.block_bits,
        salts=params.salts,
        companion=companion,
        options=options,
        by_rule=by_rule,
    )


# The temperature sweep, and what else a client sends that the keyed sampler cannot honour:
# at OPTIONS_TEMPERATURE, a frequency penalty, a presence penalty and a logit_bias list. The list's
# token ids are SmolLM2's (the evaluated model's tokenizer): -100 (banned) on " the" (260), " a"
# (253), " and" (284) and " very" (1035), +5 on " indeed" (6392), " truly" (5416) and
# " remarkable" (7155).
SWEEP_TEMPERATURES = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.3)
OPTIONS_TEMPERATURE = 0.7
LOGIT_BIAS = ((260, -100.0), (253, -100.0), (284, -100.0), (1035, -100.0), (6392, 5.0), (5416, 5.0), (7155, 5.0))
SAMPLING_OPTIONS: tuple[SamplingOptions, ...] = (
    (("frequency_penalty", 0.5),),
    (("presence_penalty", 0.5),),
    (("logit_bias", LOGIT_BIAS),),
    (("top_p", 0.9),),  # the smallest nucleus the rule leaves to the keyed sampler
)


def temperature_config(
    *,
    authors: int = 200,
    option_authors: int = 100,
    null_texts: int = 100,
    keys_per_text: int = 10,
    neighbours: int | None = None,
    registry_size: int = 10_000,
    delta: float | None = None,
    temperatures: tuple[float, ...] = SWEEP_TEMPERATURES,
    option_sets: tuple[SamplingOptions, ...] = SAMPLING_OPTIONS,
    others: bool = True,
    reuse: tuple[str, ...] = ("gumbel8s16-low", "companion-d3", "companion-d4"),
    report: str = "temperature",
    bits: int = 32,
    max_tokens: int = 200,
) -> ForensicConfig:
    """The temperature sweep on the gateway's default key version (``spec_for("auto")``): at each
    temperature, the cell of the encoder the gateway's rule chooses (``companion_reason_of``, at
    the default thresholds); beside it, the other encoder at the ``neighbours`` temperatures on
    each side of the rule's switch (None: at every temperature; the keyed sampler never at a
    greedy temperature, where it cannot run), so that both encoders' naming and perplexity stand
    side by side wherever the switch could be; the option cells at OPTIONS_TEMPERATURE.
    Unwatermarked answers of the same prompts at every temperature and with every option set, each
    traced under ``keys_per_text`` key versions (the evaluation's and independent ones), both
    encoders read every time.

    ``delta`` sets the companion's bias (None: the gateway's default), ``bits`` both encoders'
    message length, ``temperatures`` and ``option_sets`` the cells, ``others`` False leaves the other
    encoder's cells out (a study of the rule's cells alone); ``reuse``, ``report`` and ``max_tokens``
    as ForensicConfig's."""
    from service.backends.base import GREEDY_TEMPERATURE

    version = spec_for(PER_REQUEST, bits=bits) if delta is None else spec_for(PER_REQUEST, bits=bits, delta=delta)
    rule = encoder_rule()
    settings = []
    below, above = [], []
    for temperature in temperatures:
        companion = bool(companion_reason_of(temperature, (), rule))
        settings.append(encoder_setting(version, temperature, authors, companion=companion, by_rule=True))
        if not companion:
            above.append(temperature)
        elif temperature >= GREEDY_TEMPERATURE:
            below.append(temperature)
    if not others:
        below, above = [], []
    for temperature in below if neighbours is None else below[len(below) - neighbours :]:
        settings.append(encoder_setting(version, temperature, authors, companion=False, by_rule=False))
    for temperature in above if neighbours is None else above[:neighbours]:
        settings.append(encoder_setting(version, temperature, authors, companion=True, by_rule=False))
    for options in option_sets:
        companion = bool(companion_reason_of(OPTIONS_TEMPERATURE, options, rule))
        settings.append(
            encoder_setting(
                version, OPTIONS_TEMPERATURE, option_authors, companion=companion, by_rule=True, options=options
            )
        )
    settings += [Setting(0, 0, temperature, null_texts) for temperature in temperatures]
    settings += [Setting(0, 0, OPTIONS_TEMPERATURE, null_texts, options=options) for options in option_sets]
    return ForensicConfig(
        settings=tuple(settings),
        t_grid=(150,),
        max_tokens=max_tokens,
        registry_size=registry_size,
        null_keys=dict.fromkeys((*temperatures, OPTIONS_TEMPERATURE), keys_per_text - 1),
        attack_authors=0,
        scaling_sizes={},
        key_version=version,
        decoders=("auto",),
        reuse=reuse,
        report=report,
    )


# Where the per-request rule switches encoders and why (``make eval-temperature``, TEMPERATURE.md):
# the rule's cells; the other encoder beside them is measured by the presets that chose the rule's
# threshold and bias (the keyed sampler below 0.7: gumbel8s16-low, FORENSIC-GUMBEL8S16-LOW.md; the
# companion's bias at 0-0.5 and under logit_bias: companion-d3 / companion-d4 / companion-d0.6).
TEMPERATURE = temperature_config(others=False)
# The same rule's cells at message length 64 (``make eval-temperature-b64``, TEMPERATURE-B64.md):
# what a 64-bit default key version names where the rule sends a request, the biasing companion's
# cells above all (32 blocks of 2 bits at 64 bits instead of 16). The keyed sampler's cells at 0.7
# and 1.0 at 64 bits are REGISTRY-SCALE.md's (200 authors each, 10^4 to 10^7 IDs); 1.3 and top_p 0.9
# are measured here. Answers of 150 tokens (read at T = 150), 50 unwatermarked answers per cell.
TEMPERATURE_B64 = temperature_config(
    bits=64,
    temperatures=(0.0, 0.1, 0.2, 0.3, 0.5, 1.3),
    null_texts=50,
    others=False,
    reuse=(),
    report="temperature-b64",
    max_tokens=150,
)
# The companion's bias on its frontier (docs/results/COMPANION-STRENGTH.md): the cells the gateway's
# rule sends to the biasing encoder where it named least at the default bias (temperatures 0, 0.3 and
# 0.5, and the logit_bias list), 100 authors each, at a larger bias than the default; the
# unwatermarked answers of the same prompts are the same in every one of these presets (shared
# cache). ``companion-d0.6`` is the bias added after temperature scaling (logits / T + 2 equals
# (logits + 2 T) / T: δ = 0.6 before it at T = 0.3), the other way the issue asked to weigh.
COMPANION_TEMPERATURES = (0.0, 0.3, 0.5)
COMPANION_OPTIONS: tuple[SamplingOptions, ...] = ((("logit_bias", LOGIT_BIAS),),)


def companion_config(delta: float, temperatures: tuple[float, ...] = COMPANION_TEMPERATURES) -> ForensicConfig:
    """The companion-strength study at bias ``delta`` (see COMPANION_TEMPERATURES)."""
    return temperature_config(
        authors=100,
        option_authors=100,
        delta=delta,
        temperatures=temperatures,
        option_sets=COMPANION_OPTIONS if temperatures == COMPANION_TEMPERATURES else (),
        others=False,
        reuse=("companion-d3", "companion-d4", "companion-d2", "temperature"),
        report=f"companion-d{delta:g}",
    )


# The same cells with 4 authors and texts each and a registry of 1,000 (a check of the pipeline).
TEMPERATURE_SMALL = temperature_config(authors=4, option_authors=4, null_texts=4, keys_per_text=2, registry_size=1_000)

SMALL = ForensicConfig(
    settings=(Setting(32, 4, 0.7, 8, headline=True), Setting(0, 0, 0.7, 8)),
    t_grid=(150, 300),
    registry_size=1_000,
    null_keys={0.7: 2},
    attack_authors=4,
    scaling_sizes={32: (20_000,)},
)


PRESETS = {
    "forensic": FORENSIC,
    "strength": STRENGTH,
    "entropy": ENTROPY,
    "gumbel": GUMBEL,
    "gumbel8": GUMBEL8,
    "gumbel8s16": GUMBEL8_SALTED,
    "gumbel8s16-low": GUMBEL8_LOW_TEMPERATURE,
    "temperature": TEMPERATURE,
    "temperature-small": TEMPERATURE_SMALL,
    "temperature-b64": TEMPERATURE_B64,
    "companion-d2": companion_config(2.0),
    "companion-d3": companion_config(3.0),
    "companion-d4": companion_config(4.0),
    "companion-d0.6": companion_config(0.6, temperatures=(0.3,)),
    "small": SMALL,
}


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Population:
    """The registry of each message length and which registered IDs are the authors."""

    def __init__(self, config: ForensicConfig, cache_dir: Path | None = None) -> None:
        self.config = config
        self.cache_dir = cache_dir
        self._registries: dict[int, list[Message]] = {}
        self._authors: dict[int, list[int]] = {}

    def registry(self, bits: int) -> list[Message]:
        """The allocator's first ``registry_size`` IDs (seeded; kept in the cache directory, since
        allocating 10,000 IDs far apart takes minutes)."""
        if bits not in self._registries:
            params = WatermarkParams(bits=bits)
            path = None if self.cache_dir is None else self.cache_dir / f"registry-b{bits}.txt"
            if path is not None and path.is_file():
                messages = [Message(line, params) for line in path.read_text(encoding="utf-8").split()]
            else:
                rng = random.Random(f"xmark-forensic/{self.config.seed}/{bits}")
                allocator = MessageAllocator([], params, rng=rng)
                messages = [allocator.allocate() for _ in range(self.config.registry_size)]
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text("\n".join(m.bits for m in messages) + "\n", encoding="utf-8")
            if len(messages) != self.config.registry_size:
                raise SystemExit(f"{path} holds {len(messages)} IDs, the protocol needs {self.config.registry_size}")
            self._registries[bits] = messages
        return self._registries[bits]

    def authors(self, bits: int) -> list[int]:
        """Registry indices of the authors (as many as the largest setting of this length needs)."""
        if bits not in self._authors:
            most = max(s.authors for s in self.config.settings if s.bits == bits)
            rng = random.Random(f"xmark-forensic/{self.config.seed}/authors/{bits}")
            self._authors[bits] = rng.sample(range(self.config.registry_size), most)
        return self._authors[bits]

    def candidates(self, params: WatermarkParams) -> CandidateSet:
        messages = self.registry(params.bits)
        return CandidateSet([m.bits for m in messages], list(range(len(messages))), params)


def prompt_of(prompts: Sequence[Prompt], seed: int, author: int) -> Prompt:
    """The prompt of the author numbered ``author`` (the same for every setting, null texts included)."""
    order = list(prompts)
    random.Random(f"xmark-forensic/{seed}/prompts").shuffle(order)
    return order[author % len(order)]


def version_secret(seed: int, version: int = 0) -> str:
    """The secret of the evaluation's key version ``version``: 0 is the one every answer is written
    under, j >= 1 the j-th independent one that never touched a text (``population.null_keys``)."""
    return evaluation_secret(seed) if version == 0 else f"{evaluation_secret(seed)}/null-{version - 1}"


def version_keys(config: ForensicConfig, version: int = 0) -> tuple[WatermarkKey, ...]:
    """The keys of each encoder of the per-request key version ``version`` (primary first), as the
    gateway derives them from a version's secret (``xmark_core.encoders.encoder_keys``)."""
    if config.key_version is None:
        raise ValueError("the preset has no per-request key version")
    return encoder_keys(version_secret(config.seed, version), config.key_version)


def setting_key(config: ForensicConfig, setting: Setting) -> WatermarkKey:
    """The key a watermarked setting's answers are written under: the evaluation key of its
    parameters, or under a per-request key version the key of its encoder."""
    params = setting.spec.params()
    if config.key_version is None:
        if setting.companion:
            raise ValueError(f"{setting.name}: a companion cell needs the preset's key_version")
        return evaluation_key(params, config.seed)
    key = version_keys(config)[1 if setting.companion else 0]
    if key.params != params:
        raise ValueError(f"{setting.name}: not an encoder of the preset's key version ({key.params})")
    return key


def jobs(config: ForensicConfig, population: Population, prompts: Sequence[Prompt]) -> list[RowJob]:
    out = []
    for setting in config.settings:
        spec = setting.spec
        key = setting_key(config, setting) if spec.watermarked else None
        registry = population.registry(setting.bits) if spec.watermarked else None
        authors = population.authors(setting.bits) if spec.watermarked else None
        for author in range(setting.authors):
            prompt = prompt_of(prompts, config.seed, author)
            message = None
            if registry is not None and authors is not None:
                message = registry[authors[author]]
                if setting.block_bits != message.params.block_bits:  # the same ID read in the setting's blocks
                    message = Message(message.bits, spec.params())
            salt = random.Random(f"salt/{config.seed}/{spec.name}/{author}").randrange(setting.salts)
            out.append(
                RowJob(
                    spec.name,
                    author,
                    0,
                    prompt.id,
                    prompt.text,
                    setting.temperature,
                    key,
                    message,
                    salt,
                    companion=setting.companion,
                    options=setting.options,
                )
            )
    return out


def cache_dir_of(preset: str, seed: int) -> Path:
    """A preset's default cache directory."""
    suffix = "" if preset == "forensic" else f"-{preset}"
    return Path("var/eval") / f"forensic{suffix}-seed{seed}"


def reused_caches(config: ForensicConfig) -> list[Path]:
    """The cache directories of the presets of ``config.reuse`` whose answers this one would
    generate identically: the same seed, registry size and answer length (a row's answer is a
    function of the seed, its setting's name, its author, its prompt and the registry)."""
    out = []
    for name in config.reuse:
        other = PRESETS[name]
        if other.settings == config.settings:  # the preset itself
            continue
        if (other.seed, other.registry_size, other.max_tokens) == (
            config.seed,
            config.registry_size,
            config.max_tokens,
        ):
            out.append(cache_dir_of(name, other.seed))
    return out


def adopt_registries(config: ForensicConfig, cache_dir: Path) -> None:
    """Copy the allocated registries of the reused caches (allocating 10,000 IDs takes minutes;
    the allocation is a function of the seed and the size alone)."""
    import shutil

    for source in reused_caches(config):
        for registry in source.glob("registry-b*.txt"):
            if not (cache_dir / registry.name).is_file():
                cache_dir.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(registry, cache_dir / registry.name)


def adopt(config: ForensicConfig, pending: list[RowJob], store: GenerationStore) -> list[RowJob]:
    """Copy into ``store`` the pending answers a reused cache holds (``reused_caches``); returns
    the answers still to generate."""
    left = pending
    for source in reused_caches(config):
        if not (source / "generations.jsonl").is_file():
            continue
        theirs = GenerationStore(source / "generations.jsonl")
        found, still = [], []
        for job in left:
            row = theirs.get(job.spec_name, job.user, job.slot)
            if row is not None and row.prompt_id == job.prompt_id and len(row.token_ids) == config.max_tokens:
                found.append(RowResult(job, row.token_ids, row.nll, row.text))
            else:
                still.append(job)
        if found:
            store.add(found)
            _log(f"{len(found)} answers copied from {source}")
        left = still
    return left


def generate(config: ForensicConfig, pending: list[RowJob], store: GenerationStore, args: argparse.Namespace) -> float:
    """Generate the missing completions with the vLLM engine; returns the seconds it took."""
    from .vllm_engine import VllmGenerator

    generator = VllmGenerator.for_jobs(args.model_path, pending, config.max_tokens, args.max_num_seqs)
    batch = args.max_num_seqs  # one wave of rows per call: each wave's answers are cached as it ends
    started = time.monotonic()
    for first in range(0, len(pending), batch):
        rows = pending[first : first + batch]
        store.add(generator.generate(rows, config.max_tokens, config.seed))
        done = first + len(rows)
        rate = (time.monotonic() - started) / done
        _log(f"{done}/{len(pending)} completions, ~{rate * (len(pending) - done) / 60:.1f} min left")
    return time.monotonic() - started


@dataclass
class Scored:
    """A text as /trace reads it: re-tokenized ids and the model's scores of them."""

    ids: list[int]
    scores: ModelScores


class Scorer:
    """Re-tokenizes texts and runs the forward pass in batches; caches everything on disk."""

    def __init__(self, model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase, path: Path, top_k: int):
        self.model = model
        self.tokenizer = tokenizer
        self.path = path
        self.top_k = top_k
        self.cache: dict[str, Scored] = {}
        if path.is_file():  # plain tuples on disk: (ids, token log-probs, top ids, top log-probs, vocabulary)
            for name, (ids, own, top_ids, top_lp, vocab) in pickle.loads(path.read_bytes()).items():
                self.cache[name] = Scored(ids, ModelScores(own, top_ids, top_lp, vocab))
        self.seconds = 0.0
        self.tokens = 0

    def adopt(self, path: Path, texts: dict[str, str]) -> None:
        """Take the scores of ``texts`` (by name) that another cache of the same model and dtype
        holds, where the text re-tokenizes to the same ids."""
        if not path.is_file():
            return
        taken = 0
        for name, (ids, own, top_ids, top_lp, vocab) in pickle.loads(path.read_bytes()).items():
            if name in texts and name not in self.cache and self.tokenize(texts[name]) == ids:
                self.cache[name] = Scored(ids, ModelScores(own, top_ids, top_lp, vocab))
                taken += 1
        if taken:
            _log(f"{taken} texts' scores taken from {path}")

    def tokenize(self, text: str) -> list[int]:
        from service.trace.analysis import tokenize

        return tokenize(self.tokenizer, text)

    def score_all(self, texts: dict[str, str], batch: int = 8) -> None:
        from service.backends.scoring import score_texts

        todo = [(name, self.tokenize(text)) for name, text in texts.items() if name not in self.cache]
        if not todo:
            return
        if self.model is None:
            raise SystemExit("--report-only: model scores are missing from the cache; run without it")
        todo.sort(key=lambda item: len(item[1]))
        started = time.monotonic()
        for first in range(0, len(todo), batch):
            part = todo[first : first + batch]
            t0 = time.monotonic()
            scores = score_texts(self.model, int(self.tokenizer.pad_token_id), [ids for _, ids in part], self.top_k)
            self.seconds += time.monotonic() - t0
            self.tokens += sum(len(ids) for _, ids in part)
            for (name, ids), s in zip(part, scores, strict=True):
                self.cache[name] = Scored(ids, s)
            if (first // batch) % 25 == 0:
                done = first + len(part)
                rate = (time.monotonic() - started) / done
                _log(f"scored {done}/{len(todo)} texts, ~{rate * (len(todo) - done) / 60:.1f} min left")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        plain = {
            name: (s.ids, s.scores.token_logprobs, s.scores.top_ids, s.scores.top_logprobs, s.scores.vocab_size)
            for name, s in self.cache.items()
        }
        self.path.write_bytes(pickle.dumps(plain))


def setting_fields(setting: Setting) -> dict[str, Any]:
    """A watermarked setting as the result rows name it."""
    out: dict[str, Any] = {
        "setting": setting.name,
        "bits": setting.bits,
        "num_keys": setting.num_keys,
        "delta": setting.delta,
        "min_entropy": setting.min_entropy,
        "scheme": setting.scheme,
        "block_bits": setting.block_bits,
        "salts": setting.salts,
        "temperature": setting.temperature,
    }
    if setting.companion or setting.options or setting.by_rule:  # a per-request version's cell
        out.update(companion=setting.companion, options=request_options(setting.options), by_rule=setting.by_rule)
    return out


def trace(
    decoder: str,
    scored: Scored,
    tokenizer: PreTrainedTokenizerBase,
    groups: Sequence[LengthGroup],
    config: ForensicConfig,
) -> TraceOutcome:
    """The gateway's reading of one text with one decoder, or ``auto`` as /trace runs it: the
    product's trace (``service.trace.service.run_trace``, its count included) under the preset's
    policy (``ForensicConfig.policy``). ``groups``: each message length's key versions and registry
    snapshot (a per-request version is two readings, one per encoder)."""
    from service.trace.fanout import TextReading
    from service.trace.plan import decoders_for
    from service.trace.service import run_trace_now
    from service.vocabulary import TraceDecoder

    decoders = decoders_for(TraceDecoder(decoder), scorer_available=True)
    policy = config.policy(counting_only=decoder == "counting")
    return run_trace_now(
        groups, [], TextReading(scored.ids, tokenizer), scored.scores, policy, decoders=decoders
    ).outcome


class Evaluation:
    def __init__(self, config: ForensicConfig, population: Population, store: GenerationStore, scorer: Scorer):
        self.config = config
        self.population = population
        self.store = store
        self.scorer = scorer
        self.tokenizer = scorer.tokenizer
        self._snapshots: dict[tuple[WatermarkParams, int], RegistrySnapshot] = {}

    # -- texts -------------------------------------------------------------------------------
    def completion(self, setting: Setting, author: int) -> list[int]:
        row = self.store.get(setting.name, author, 0)
        assert row is not None, f"missing completion {setting.name}/{author}"
        return row.token_ids

    def decode(self, ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        assert isinstance(text, str)
        return text

    def null_setting(self, temperature: float, options: SamplingOptions = ()) -> Setting | None:
        """The unwatermarked cell of the same temperature and sampling options (the paired texts)."""
        return next(
            (s for s in self.config.settings if s.bits == 0 and s.temperature == temperature and s.options == options),
            None,
        )

    def attacked(self, setting: Setting, author: int, attack: str) -> str:
        own = self.completion(setting, author)
        rng = random.Random(f"xmark-forensic/{self.config.seed}/{attack}/{setting.name}/{author}")
        if attack == "copy_paste":
            base = self.null_setting(setting.temperature, setting.options)
            assert base is not None
            return self.decode(copy_paste(own, self.completion(base, author), self.config.copy_paste_level, rng))
        if attack == "word_deletion":
            return delete_words(self.decode(own), self.config.attack_level, rng)
        special = max(self.tokenizer.added_tokens_decoder) + 1 if self.tokenizer.added_tokens_decoder else 0
        return self.decode(substitute_tokens(own, self.config.attack_level, special, len(self.tokenizer), rng))

    def texts(self) -> dict[str, str]:
        """Every text the analysis scores: full answers and attacked answers, by name."""
        out: dict[str, str] = {}
        for setting in self.config.settings:
            for author in range(setting.authors):
                out[f"{setting.name}/{author}"] = self.decode(self.completion(setting, author))
                if setting.bits and author < self.attack_count(setting):
                    for attack in ATTACKS:
                        if attack == "copy_paste" and self.null_setting(setting.temperature, setting.options) is None:
                            continue
                        out[f"{setting.name}/{author}/{attack}"] = self.attacked(setting, author, attack)
        return out

    def attack_count(self, setting: Setting) -> int:
        """Authors whose answers are edited (robustness): the first ``attack_authors`` of a headline setting."""
        return min(setting.authors, self.config.attack_authors) if setting.headline else 0

    def prefix(self, setting: Setting, author: int, t: int) -> Scored:
        """The first T generated tokens as /trace sees them (see the module docstring)."""
        full = self.scorer.cache[f"{setting.name}/{author}"]
        n = len(self.scorer.tokenize(self.decode(self.completion(setting, author)[:t])))
        n = min(n, len(full.ids))
        return Scored(full.ids[:n], full.scores.prefix(n))

    # -- gateway objects ---------------------------------------------------------------------
    def snapshot(self, params: WatermarkParams, size: int | None = None) -> RegistrySnapshot:
        """The registry as the gateway holds it: the allocator's IDs, and beyond ``registry_size``
        (``size``) distinct uniformly random IDs (at b = 32 the allocator's IDs are random ones
        kept apart; at b = 16 a registry of 65,536 holds every ID)."""
        from service.services.registry_cache import RegisteredUser, RegistrySnapshot

        size = size or self.config.registry_size
        if (params, size) not in self._snapshots:
            bits = [m.bits for m in self.population.registry(params.bits)]
            if size > len(bits):
                if size > 1 << params.bits:
                    raise ValueError(f"a {params.bits}-bit registry holds at most {1 << params.bits} IDs")
                if size == 1 << params.bits:
                    rest = sorted(set(range(1 << params.bits)) - {int(b, 2) for b in bits})
                else:
                    taken = {int(b, 2) for b in bits}
                    rng = random.Random(f"xmark-forensic/{self.config.seed}/more/{params.bits}")
                    rest = []
                    while len(taken) < size:
                        value = rng.getrandbits(params.bits)
                        if value not in taken:
                            taken.add(value)
                            rest.append(value)
                bits += [format(v, f"0{params.bits}b") for v in rest]
            candidates = CandidateSet(bits[:size], list(range(size)), params)
            # names of the allocated users only: the report names others ""
            users = {i: RegisteredUser(i, f"user-{i}", "active") for i in range(self.config.registry_size)}
            self._snapshots[(params, size)] = RegistrySnapshot(candidates, users)
        return self._snapshots[(params, size)]

    def scaling(self) -> list[dict[str, Any]]:
        """How the registry's size changes naming (``auto``): the same authors' texts traced against
        larger registries, and the headline null texts against them (T = 150)."""
        cfg = self.config
        rows = []
        for setting, params, _, authors in self.watermarked():
            base = self.null_setting(setting.temperature, setting.options)
            for size in cfg.scaling_sizes.get(setting.bits, ()):
                groups = self.reading(params, size=size)
                for t in (150, max(cfg.t_grid)):
                    named = wrong = 0
                    for author in range(setting.authors):
                        outcome = trace("auto", self.prefix(setting, author, t), self.tokenizer, groups, cfg)
                        named += outcome.attributed_user_id == authors[author]
                        wrong += outcome.named and outcome.attributed_user_id != authors[author]
                    row = {
                        **setting_fields(setting),
                        "registry": size,
                        "T": t,
                        "decoder": "auto",
                        "named": rate_cell(named, setting.authors),
                        "wrong": rate_cell(wrong, setting.authors),
                    }
                    if t == 150 and setting.headline and base is not None:
                        readings = [self.reading(params, version, size) for version in range(cfg.other_t_keys)]
                        false = pairs = 0
                        for author in range(base.authors):
                            text = self.prefix(base, author, t)
                            for reading in readings:
                                pairs += 1
                                false += trace("auto", text, self.tokenizer, reading, cfg).named
                        row["null_named"] = rate_cell(false, pairs)
                    rows.append(row)
            _log(f"scaling: {setting.name} done")
        return rows

    @staticmethod
    def versions(key: Any, companion: WatermarkKey | None = None) -> list[KeyVersionHandle]:
        from service.keyring import KeyVersionHandle
        from service.vocabulary import KeyVersionStatus

        return [KeyVersionHandle(id=1, name="v1", key=key, status=KeyVersionStatus.ACTIVE, companion=companion)]

    def reading(self, params: WatermarkParams, version: int = 0, size: int | None = None) -> list[LengthGroup]:
        """What /trace reads a text under, each message length with its registry (``size``: of that
        size): key version ``version`` (0: the evaluation's, j: the j-th independent one). One key
        version of ``params``, or the preset's per-request version, one reading per encoder, each
        encoder's message length against its registry (``Keyring.readings``, ``group_by_length``)."""
        from service.trace.analysis import LengthGroup, group_by_length

        if self.config.key_version is None:
            key = (
                evaluation_key(params, self.config.seed)
                if version == 0
                else null_keys(params, self.config.seed, version)[-1]
            )
            return [LengthGroup(tuple(self.versions(key)), self.snapshot(params, size))]
        primary, companion = version_keys(self.config, version)
        handles = self.versions(primary, companion)[0].encoders()
        return [LengthGroup(group, self.snapshot(group[0].key.params, size)) for group in group_by_length(handles)]

    def watermarked(self) -> Iterator[tuple[Setting, WatermarkParams, list[LengthGroup], list[int]]]:
        """Each watermarked setting with its parameters, what /trace reads its texts under (the
        evaluation's key version) and its authors' registry indices."""
        for setting in self.config.settings:
            if setting.bits:
                params = setting.spec.params()
                yield setting, params, self.reading(params), self.population.authors(setting.bits)

    # -- sections ----------------------------------------------------------------------------
    def attribution(self) -> list[dict[str, Any]]:
        cfg = self.config
        rows = []
        for setting, _, groups, authors in self.watermarked():
            for t in cfg.t_grid:
                for decoder in cfg.decoders:
                    named = wrong = top1 = by_likelihood = 0
                    lengths, confidences, seconds = [], [], []
                    by_encoder: dict[str, int] = {}  # names, by the encoder whose reading named
                    for author in range(setting.authors):
                        text = self.prefix(setting, author, t)
                        t0 = time.perf_counter()
                        outcome = trace(decoder, text, self.tokenizer, groups, cfg)
                        seconds.append(time.perf_counter() - t0)
                        truth = authors[author]
                        report = outcome.report
                        lengths.append(len(text.ids))
                        top1 += bool(report.candidates) and report.candidates[0].user_id == truth
                        named += outcome.attributed_user_id == truth
                        wrong += outcome.named and outcome.attributed_user_id != truth
                        by_likelihood += outcome.named and report.decoder == "likelihood"
                        if outcome.named:
                            by_encoder[str(report.encoder)] = by_encoder.get(str(report.encoder), 0) + 1
                        if report.confidence is not None:
                            confidences.append(report.confidence)
                    n = setting.authors
                    rows.append(
                        {
                            **setting_fields(setting),
                            "T": t,
                            "decoder": decoder,
                            "authors": n,
                            "text_tokens": {"min": min(lengths), "median": statistics.median(lengths)},
                            "named": rate_cell(named, n),
                            "wrong": rate_cell(wrong, n),
                            "top1": rate_cell(top1, n),
                            "named_by_likelihood": by_likelihood,
                            "named_by_encoder": by_encoder,
                            "median_confidence": round(statistics.median(confidences), 4) if confidences else None,
                            "analysis_ms_p50": round(1000 * statistics.median(seconds), 2),
                        }
                    )
            _log(f"attribution: {setting.name} done")
        return rows

    def null(self) -> list[dict[str, Any]]:
        """False attribution: unwatermarked texts (at each watermarked setting's temperature and
        sampling options) traced under key versions that never marked them: the evaluation's and
        independent ones, of that setting's parameters or the preset's per-request version (read
        under both encoders). At T = 150 every decoder reads every (text, key) pair; at other T,
        ``auto`` reads the pairs of ``other_t_keys`` keys."""
        cfg = self.config
        rows = []
        done: set[tuple[WatermarkParams | KeyVersionSpec, str]] = set()
        for setting in cfg.settings:
            base = self.null_setting(setting.temperature, setting.options)
            if not setting.bits or base is None:
                continue
            params = setting.spec.params()
            reads: WatermarkParams | KeyVersionSpec = params if cfg.key_version is None else cfg.key_version
            if (reads, base.name) in done:
                continue
            done.add((reads, base.name))
            texts = base.authors if setting.headline else min(base.authors, cfg.attack_authors)
            readings = [self.reading(params, version) for version in range(1 + cfg.null_key_count(base.temperature))]
            for t in cfg.t_grid:
                decoders = cfg.decoders if t == 150 else ("auto",)
                used = readings if t == 150 else readings[: cfg.other_t_keys]
                counts = dict.fromkeys(decoders, 0)
                by_encoder: dict[str, dict[str, int]] = {decoder: {} for decoder in decoders}
                pairs = 0
                for author in range(texts):
                    text = self.prefix(base, author, t)
                    for reading in used:
                        pairs += 1
                        for decoder in decoders:
                            outcome = trace(decoder, text, self.tokenizer, reading, cfg)
                            counts[decoder] += outcome.named
                            if outcome.named:
                                encoder = str(outcome.report.encoder)
                                by_encoder[decoder][encoder] = by_encoder[decoder].get(encoder, 0) + 1
                for decoder in decoders:
                    row: dict[str, Any] = {
                        "texts_temperature": base.temperature,
                        "bits": params.bits,
                        "num_keys": params.num_keys,
                        "delta": params.delta,
                        "scheme": params.scheme,
                        "block_bits": params.block_bits,
                        "salts": params.salts,
                        "T": t,
                        "decoder": decoder,
                        "pairs": pairs,
                        "named": rate_cell(counts[decoder], pairs),
                    }
                    if cfg.key_version is not None:  # both encoders read every pair
                        row.update(
                            scheme=PER_REQUEST,
                            texts_setting=base.name,
                            options=request_options(base.options),
                            named_by_encoder=by_encoder[decoder],
                        )
                    rows.append(row)
            under = f"b={params.bits} k={params.num_keys}" if cfg.key_version is None else "both encoders"
            _log(f"null: {base.name} under {under} done")
        return rows

    def robustness(self) -> list[dict[str, Any]]:
        cfg = self.config
        rows = []
        t = max(cfg.t_grid)
        for setting, _, groups, authors in self.watermarked():
            count = self.attack_count(setting)
            for attack in ATTACKS:
                name = f"{setting.name}/0/{attack}"
                if name not in self.scorer.cache:
                    continue
                level = cfg.copy_paste_level if attack == "copy_paste" else cfg.attack_level
                for decoder in cfg.decoders:
                    named = wrong = 0
                    for author in range(count):
                        text = self.scorer.cache[f"{setting.name}/{author}/{attack}"]
                        outcome = trace(decoder, text, self.tokenizer, groups, cfg)
                        named += outcome.attributed_user_id == authors[author]
                        wrong += outcome.named and outcome.attributed_user_id != authors[author]
                    rows.append(
                        {
                            **setting_fields(setting),
                            "T": t,
                            "attack": attack,
                            "level": level,
                            "decoder": decoder,
                            "authors": count,
                            "named": rate_cell(named, count),
                            "wrong": rate_cell(wrong, count),
                        }
                    )
        return rows

    def answer_nll(self, setting: Setting) -> list[float]:
        """Each answer's mean NLL per token under the unmodified model (raw log-probs from generation)."""
        out = []
        for author in range(setting.authors):
            row = self.store.get(setting.name, author, 0)
            assert row is not None
            out.append(statistics.fmean(row.nll[: self.config.max_tokens]))
        return out

    def quality(self) -> list[dict[str, Any]]:
        """Perplexity of each setting's answers under the same model (raw log-probs from generation);
        a watermarked setting's paired ratio against the unwatermarked answers to the same prompts
        (``quality.paired_ppl_ratio``: over the authors both have, bootstrap interval over them)."""
        import math

        from .quality import paired_ppl_ratio

        rows = []
        for setting in self.config.settings:
            nll = self.answer_nll(setting)
            values = [math.exp(x) for x in nll]
            base = self.null_setting(setting.temperature, setting.options) if setting.bits else None
            ratio = None
            if base is not None:
                plain = self.answer_nll(base)
                pairs = min(len(nll), len(plain))
                ratio = paired_ppl_ratio(nll[:pairs], plain[:pairs], seed=self.config.seed)
            extra: dict[str, Any] = {}
            if setting.companion or setting.options or setting.by_rule:
                extra = {"companion": setting.companion, "options": request_options(setting.options)}
            rows.append(
                {
                    **extra,
                    "setting": setting.name,
                    "bits": setting.bits or None,
                    "num_keys": setting.num_keys or None,
                    "delta": setting.delta if setting.bits else None,
                    "min_entropy": setting.min_entropy if setting.bits else None,
                    "scheme": setting.scheme if setting.bits else None,
                    "block_bits": setting.block_bits if setting.bits else None,
                    "salts": setting.salts if setting.bits else None,
                    "temperature": setting.temperature,
                    "texts": len(values),
                    "ppl_mean": round(statistics.fmean(values), 3),
                    "ppl_median": round(statistics.median(values), 3),
                    "ppl_ratio": ratio,
                }
            )
        return rows


def rule_summary(config: ForensicConfig) -> dict[str, Any]:
    """The per-request rule the cells were chosen by: its thresholds and, per cell, its choice."""
    rule = encoder_rule()
    version = config.key_version
    assert version is not None and version.companion is not None
    choices = []
    for setting in config.settings:
        if setting.bits:
            reason = companion_reason_of(setting.temperature, setting.options, rule)
            chosen = version.companion if reason else version.primary
            choices.append({"setting": setting.name, "encoder": chosen.scheme, "reason": reason})
    return {
        "min_temperature": rule.min_temperature,
        "min_top_p": rule.min_top_p,
        "primary": asdict(version.primary),
        "companion": asdict(version.companion),
        "choices": choices,
    }


def temperature_cells(config: ForensicConfig, results: dict[str, Any], t: int = 150) -> list[dict[str, Any]]:
    """One row per watermarked cell at ``t`` tokens (``auto``, as /trace): its encoder and the
    rule's choice, naming, wrong names, its unwatermarked texts' false names and its paired
    perplexity ratio."""
    choices = {c["setting"]: c for c in results["rule"]["choices"]}
    quality = {row["setting"]: row for row in results["quality"]}
    out = []
    for setting in config.settings:
        if not setting.bits:
            continue
        row = next(r for r in results["attribution"] if r["setting"] == setting.name and r["T"] == t)
        base = next(
            s
            for s in config.settings
            if s.bits == 0 and (s.temperature, s.options) == (setting.temperature, setting.options)
        )
        null = next(
            (
                r
                for r in results["null"]
                if r.get("texts_setting") == base.name and r["T"] == t and r["decoder"] == "auto"
            ),
            None,
        )
        out.append(
            {
                "setting": setting.name,
                "temperature": setting.temperature,
                "options": request_options(setting.options),
                "encoder": setting.scheme,
                "companion": setting.companion,
                "by_rule": setting.by_rule,
                "rule": choices[setting.name],
                "T": t,
                "authors": row["authors"],
                "named": row["named"],
                "wrong": row["wrong"],
                "named_by_encoder": row.get("named_by_encoder", {}),
                "null_setting": base.name,
                "null_named": None if null is None else null["named"],
                "ppl_ratio": quality[setting.name]["ppl_ratio"],
                "ppl_median": quality[setting.name]["ppl_median"],
                "null_ppl_median": quality[base.name]["ppl_median"],
            }
        )
    return out


def trace_cost(evaluation: Evaluation, setting: Setting, count: int = 40, t: int = 150) -> dict[str, Any]:
    """Seconds per likelihood trace of a T-token text, one text at a time: forward pass plus analysis."""
    from service.backends.scoring import score_texts

    scorer = evaluation.scorer
    assert scorer.model is not None
    groups = evaluation.reading(setting.spec.params())
    forward, analysis = [], []
    for author in range(min(count, setting.authors)):
        text = evaluation.prefix(setting, author, t)
        t0 = time.perf_counter()
        scores = score_texts(scorer.model, int(scorer.tokenizer.pad_token_id), [text.ids], scorer.top_k)[0]
        t1 = time.perf_counter()
        trace("likelihood", Scored(text.ids, scores), scorer.tokenizer, groups, evaluation.config)
        forward.append(t1 - t0)
        analysis.append(time.perf_counter() - t1)
    total = [a + b for a, b in zip(forward, analysis, strict=True)]
    return {
        "setting": setting.name,
        "T": t,
        "texts": len(total),
        "forward_s_p50": round(statistics.median(forward), 4),
        "analysis_s_p50": round(statistics.median(analysis), 4),
        "trace_s_p50": round(statistics.median(total), 4),
        "threads": _threads(),
    }


def _threads() -> int:
    import torch

    return int(torch.get_num_threads())


def main(argv: list[str] | None = None) -> int:
    from service.backends.scoring import resolve_scorer_dtype, scoring_model

    from .plots import temperature_frontier
    from .report import render_forensic, render_temperature

    parser = argparse.ArgumentParser(prog="python -m benchmarks.evaluation.forensic", description=__doc__)
    parser.add_argument("--model-path", type=Path, default=Path("var/models/smollm2-135m-instruct"))
    parser.add_argument("--output-dir", type=Path, default=Path("docs/results"))
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default="forensic",
        help="forensic: the gateway's settings (FORENSIC.md); strength: stronger watermarks at temperature 0.7 "
        "(FORENSIC-STRENGTH.md); entropy: the entropy rule (FORENSIC-ENTROPY.md); gumbel: the distortion-free "
        "scheme (FORENSIC-GUMBEL.md); gumbel8: the same with 8-bit blocks (FORENSIC-GUMBEL8.md); temperature: the "
        "default key version's two encoders across temperatures, penalties and logit_bias, each cell's encoder chosen "
        "by the gateway's rule (TEMPERATURE.md); small, temperature-small: a few authors (a check of the pipeline, "
        "not a result)",
    )
    parser.add_argument("--small", action="store_true", help="the same as --preset small")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="vLLM engine: rows decoded together")
    parser.add_argument(
        "--scorer-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the forward pass of the likelihood decoder, as XMARK_TRACE_SCORER_DTYPE",
    )
    parser.add_argument(
        "--edit-rate",
        type=float,
        default=PRODUCT_POLICY.edit_rate,
        help="the likelihood decoder's assumed share of edited tokens, as XMARK_TRACE_EDIT_RATE (0: none)",
    )
    parser.add_argument(
        "--identity-level",
        type=float,
        help="the likelihood decoder also requires its identity test at most this (default: off, as /trace)",
    )
    parser.add_argument(
        "--alpha",
        type=float,
        help="/trace's level (XMARK_TRACE_ALPHA; default: the preset's, 0.001); results go to files "
        "suffixed with it, e.g. forensic-gumbel8-alpha0.0001.json",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the forward pass")
    parser.add_argument("--report-only", action="store_true", help="no model: re-analyse the cache")
    parser.add_argument("--generate-only", action="store_true", help="stop once the answers are generated")
    args = parser.parse_args(argv)
    preset = "small" if args.small else args.preset
    suffix = "" if preset == "forensic" else f"-{preset}"
    config = replace(PRESETS[preset], trace_edit_rate=args.edit_rate, trace_identity_level=args.identity_level)
    if args.alpha is not None:
        if not 0.0 < args.alpha < 1.0:
            parser.error("--alpha must be in (0, 1)")
        config = replace(config, alpha=args.alpha)
    cache_dir = args.cache_dir or cache_dir_of(preset, config.seed)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from .generation import load_model

    torch.set_num_threads(args.threads)
    adopt_registries(config, cache_dir)
    population = Population(config, cache_dir)
    store = GenerationStore(cache_dir / "generations.jsonl")
    pending = [j for j in jobs(config, population, load_prompts()) if (j.spec_name, j.user, j.slot) not in store]
    if pending and config.reuse:
        pending = adopt(config, pending, store)
    generation_s = None
    if pending and not args.report_only:
        _log(f"generating {len(pending)} answers of {config.max_tokens} tokens")
        generation_s = generate(config, pending, store, args)
    elif pending:
        raise SystemExit(f"--report-only: {len(pending)} answers are missing from {cache_dir}")
    if args.generate_only:
        return 0
    model, tokenizer = load_model(args.model_path)
    tokenizer.padding_side = "right"
    dtype = resolve_scorer_dtype(args.scorer_dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    model = scoring_model(model, dtype)
    scores_path = cache_dir / f"scores-{dtype_name}.pickle"
    scorer = Scorer(None if args.report_only else model, tokenizer, scores_path, config.top_k)
    evaluation = Evaluation(config, population, store, scorer)
    texts = evaluation.texts()
    for source in reused_caches(config):
        scorer.adopt(source / scores_path.name, texts)
    _log(f"scoring {sum(name not in scorer.cache for name in texts)} texts ({len(texts)} in all)")
    scorer.score_all(texts)
    started = time.monotonic()
    results: dict[str, Any] = {
        "command": "python -m benchmarks.evaluation.forensic"
        + ("" if preset == "forensic" else f" --preset {preset}")
        + ("" if args.alpha is None else f" --alpha {args.alpha:g}"),
        "config": config.to_dict(),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, no GPU",
        "scorer_dtype": dtype_name,
        "quality": evaluation.quality(),
        "attribution": evaluation.attribution(),
        "robustness": evaluation.robustness(),
        "null": evaluation.null(),
        "scaling": evaluation.scaling(),
    }
    headline = next(s for s in config.settings if s.headline)
    if not args.report_only:  # the likelihood decoder's cost
        results["trace_cost"] = trace_cost(evaluation, headline)
    results["timing"] = {
        "generation_s": None if generation_s is None else round(generation_s, 1),
        "scoring_s": round(scorer.seconds, 1),
        "scored_tokens": scorer.tokens,
        "analysis_s": round(time.monotonic() - started, 1),
    }
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    if config.report:
        results["rule"] = rule_summary(config)
        results["cells"] = temperature_cells(config, results)
        stem = config.report + ("" if args.alpha is None else f"-alpha{args.alpha:g}")
        plot = out / f"{stem}_frontier.png"
        results["frontier_plot"] = plot.name if temperature_frontier(results, plot) else None
        (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        (out / f"{stem.upper()}.md").write_text(render_temperature(results), encoding="utf-8")
        _log(f"wrote {out / f'{stem.upper()}.md'}")
        return 0
    name = suffix + ("" if args.alpha is None else f"-alpha{args.alpha:g}")  # the cache is the preset's
    (out / f"forensic{name}.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    (out / f"FORENSIC{name.upper()}.md").write_text(render_forensic(results), encoding="utf-8")
    _log(f"wrote {out / f'FORENSIC{name.upper()}.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
