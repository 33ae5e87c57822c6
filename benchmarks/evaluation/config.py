"""What an evaluation run generates and measures: generation specs and the run presets."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from xmark_core import WatermarkParams

UNWATERMARKED = "none"

# Sampling options a generation setting may pass to the engine (``vllm.SamplingParams`` fields, as
# the OpenAI request fields of the same names), each with the short label it adds to the setting's
# name. A ``logit_bias`` value is a tuple of (token id, bias) pairs.
SamplingOptions = tuple[tuple[str, Any], ...]
OPTION_LABELS: Mapping[str, str] = {
    "frequency_penalty": "fp",
    "presence_penalty": "pp",
    "repetition_penalty": "rp",
    "logit_bias": "lb",
    "top_p": "tp",  # the nucleus (the engine's default 1.0: the full vocabulary)
}


def options_label(options: SamplingOptions) -> str:
    """The part of a setting's name its sampling options make ("" without any): a penalty by its
    value (``-fp0.5``), a ``logit_bias`` by a digest of its entries (``-lb`` and 8 hex digits)."""
    out = []
    for name, value in sorted(options):
        if name not in OPTION_LABELS:
            raise ValueError(f"unknown sampling option {name!r} (one of {', '.join(OPTION_LABELS)})")
        if name == "logit_bias":
            digest = hashlib.sha256(json.dumps(sorted((int(t), float(b)) for t, b in value)).encode()).hexdigest()
            out.append(f"-lb{digest[:8]}")
        else:
            out.append(f"-{OPTION_LABELS[name]}{float(value):g}")
    return "".join(out)


def engine_options(options: SamplingOptions) -> dict[str, Any]:
    """The options as ``vllm.SamplingParams`` keyword arguments (``logit_bias``: token id -> bias)."""
    return {name: ({int(t): float(b) for t, b in value} if name == "logit_bias" else value) for name, value in options}


def request_options(options: SamplingOptions) -> dict[str, Any]:
    """The options as the fields of a chat request would carry them (``logit_bias``: JSON object,
    token ids as strings), the form the gateway's encoder rule reads."""
    return {
        name: ({str(int(t)): float(b) for t, b in value} if name == "logit_bias" else value) for name, value in options
    }


@dataclass(frozen=True)
class GenSpec:
    """One generation setting: every user's two prompts are completed once under it.

    scheme is ``none`` (unwatermarked), ``xmark``, ``loso`` or ``mpac``; tier orders the work
    (tier 0 first) so that a run cut short still holds the most important settings.
    """

    scheme: str
    bits: int = 8
    num_keys: int = 1
    delta: float = 2.0
    temperature: float = 0.7
    tier: int = 0
    min_entropy: float = 0.0  # the entropy rule (WatermarkParams.min_entropy); 0: every position biased
    block_bits: int = 2  # d (``gumbel`` allows up to 8)
    salts: int = 1  # S (``gumbel``: WatermarkParams.salts)
    # the biasing companion of a per-request key version (xmark_core.encoders): its key derives
    # from the version's secret under the companion's label (``companion_key``)
    companion: bool = False
    options: SamplingOptions = ()  # sampling options the engine applies (penalties, logit_bias)

    @property
    def name(self) -> str:
        options = options_label(self.options)
        if self.scheme == UNWATERMARKED:
            return f"none{options}-t{self.temperature:g}"
        rule = f"-h{self.min_entropy:g}" if self.min_entropy else ""
        blocks = f"-bb{self.block_bits}" if self.block_bits != 2 else ""
        salts = f"-s{self.salts}" if self.salts != 1 else ""
        companion = "-companion" if self.companion else ""
        return (
            f"{self.scheme}-b{self.bits}{blocks}-k{self.num_keys}-d{self.delta:g}{rule}{salts}{companion}{options}"
            f"-t{self.temperature:g}"
        )

    @property
    def watermarked(self) -> bool:
        return self.scheme != UNWATERMARKED

    def params(self) -> WatermarkParams:
        if not self.watermarked:
            raise ValueError("the unwatermarked setting has no watermark parameters")
        return WatermarkParams(
            bits=self.bits,
            block_bits=self.block_bits,
            num_keys=self.num_keys,
            delta=float(self.delta),
            scheme=self.scheme,
            min_entropy=self.min_entropy,
            salts=self.salts,
        )


@dataclass(frozen=True)
class EvalConfig:
    """A run preset. T values are per user (two completions of T/2 tokens each)."""

    name: str
    users: int
    t_grid: tuple[int, ...]
    bits_grid: tuple[int, ...]
    ablation_bits: int
    keys_grid: tuple[int, ...]
    delta_grid: tuple[float, ...]
    temperatures: tuple[float, ...]
    main_bits: int = 8
    main_delta: float = 2.0
    main_temperature: float = 0.7
    attribution_bits: tuple[int, ...] = (16, 32)
    registry_size: int = 10_000
    fpr_bits: tuple[int, ...] = (8, 16)
    null_keys: int = 49
    alpha: float = 1e-3
    alphas: tuple[float, ...] = (1e-2, 1e-3)
    sigma_threshold: float = 3.30
    copy_paste_fractions: tuple[float, ...] = (0.1, 0.3, 0.5)
    edit_rates: tuple[float, ...] = (0.1, 0.2, 0.3)
    robustness_methods: tuple[str, ...] = ("xmark", "loso", "mpac")
    seed: int = 0
    batch_size: int = 48
    threads: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def max_new_tokens(self) -> int:
        return max(self.t_grid) // 2

    def with_overrides(self, **changes: Any) -> EvalConfig:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def specs(self) -> list[GenSpec]:
        """Every generation setting of the run, most important first (tier order), without duplicates."""
        t0, b0, d0 = self.main_temperature, self.main_bits, self.main_delta
        wanted: list[GenSpec] = [GenSpec(UNWATERMARKED, temperature=t0, tier=0)]
        baselines = (("mpac", 1), ("loso", 1), ("xmark", 2))
        # tier 0: the Table 1 setting (b = main_bits, delta = main_delta)
        wanted += [GenSpec(s, b0, k, d0, t0, 0) for s, k in baselines]
        # tier 1: BA against b
        wanted += [GenSpec(s, b, k, d0, t0, 1) for b in self.bits_grid if b != b0 for s, k in baselines]
        # tier 2: the ablation over k at ablation_bits (k = 1 is LoSo)
        wanted += [GenSpec("loso" if k == 1 else "xmark", self.ablation_bits, k, d0, t0, 2) for k in self.keys_grid]
        # tier 3: delta
        wanted += [GenSpec(s, b0, k, d, t0, 3) for d in self.delta_grid if d != d0 for s, k in baselines]
        # tier 4: other temperatures
        for temp in self.temperatures:
            if temp != t0:
                wanted.append(GenSpec(UNWATERMARKED, temperature=temp, tier=4))
                wanted += [GenSpec(s, b0, k, d0, temp, 4) for s, k in baselines]
        out: dict[str, GenSpec] = {}
        for spec in wanted:
            out.setdefault(spec.name, spec)
        return list(out.values())


SMOKE = EvalConfig(
    name="smoke",
    users=8,
    t_grid=(150, 300),
    bits_grid=(8,),
    ablation_bits=8,
    keys_grid=(1, 2),
    delta_grid=(2.0,),
    temperatures=(0.7,),
    attribution_bits=(8,),
    registry_size=128,
    fpr_bits=(8,),
    null_keys=249,
    robustness_methods=("xmark",),
    batch_size=64,
)

FULL = EvalConfig(
    name="full",
    users=50,
    t_grid=(150, 200, 250, 300),
    bits_grid=(8, 16, 32),
    ablation_bits=32,
    keys_grid=(1, 2, 3, 4),
    delta_grid=(1.0, 2.0, 3.0),
    temperatures=(0.7, 1.0),
    null_keys=19,
)

# The full grids with 16 users (about a third of the full run).
REDUCED = replace(FULL, name="reduced", users=16, null_keys=74)

PRESETS: dict[str, EvalConfig] = {c.name: c for c in (SMOKE, REDUCED, FULL)}
