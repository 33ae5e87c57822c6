"""What the counting decoder's identity test costs in naming, on the synthetic LM of the core tests.

    python -m benchmarks.identity_counting [--texts 200] [--registry 1000000] [--substitution 0.2]

``--texts`` authors among ``--registry`` uniformly random registered IDs (b = 32, k = 4, δ = 2, the
gateway's default key) each write ``--tokens`` tokens with the synthetic LM (``tests.core.synthetic``:
i.i.d. Gaussian logits over 4,096 tokens, ``--scale``, sampled at ``--temperature``); with
``--substitution`` that share of each text's tokens is then replaced by random tokens. Every text is
read by the counting decoder (cTMM) and attributed as ``xmark_core.attribute`` does (α = 0.001,
posterior ≥ 0.99), then again with ``identity_level`` at each ``--levels``. Prints one JSON object:
named and wrong-named rates (Wilson 95 % intervals) without and with the test, and the seconds the
test took per named text. A synthetic model, not the forensic evaluation: it shows the direction
and size of the cost, not the product's naming figures.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from benchmarks.evaluation.metrics import wilson
from tests.core.synthetic import LM_VOCAB, SECRET, generate, random_messages
from xmark_core import CandidateSet, WatermarkKey, WatermarkParams, attribute, decode
from xmark_core.attribution import counting_identity_p


def _rate(count: int, trials: int) -> dict[str, Any]:
    return {"count": count, "of": trials, "rate": round(count / max(trials, 1), 4), "ci95": wilson(count, trials)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    params = WatermarkParams(bits=32, num_keys=4, delta=2.0)
    key = WatermarkKey.from_secret(SECRET, params)
    messages = random_messages(params, args.registry, seed=args.seed)
    candidates = CandidateSet([m.bits for m in messages], list(range(args.registry)), params)
    started = time.perf_counter()
    generation = generate(
        key, messages[: args.texts], args.tokens, seed=args.seed + 1, scale=args.scale, temperature=args.temperature
    )
    generated_s = time.perf_counter() - started
    rng = np.random.default_rng(args.seed + 2)
    named = {"none": [0, 0], **{f"{level:g}": [0, 0] for level in args.levels}}  # [right, wrong]
    identity_s: list[float] = []
    for author, row in enumerate(generation.tokens):
        text = row.copy()
        chosen = rng.random(text.size) < args.substitution
        chosen[:2] = False  # the context the generation started from
        text[chosen] = rng.integers(0, LM_VOCAB, int(chosen.sum()))
        result = decode(text, key)
        found = attribute(result, candidates)
        if found.best is None:
            continue
        right = found.best.id == author
        named["none"][0 if right else 1] += 1
        tick = time.perf_counter()
        p_value = counting_identity_p(result, candidates, int(found.best.id))  # ids are the indices
        identity_s.append(time.perf_counter() - tick)
        for level in args.levels:
            if p_value is not None and p_value <= level:
                named[f"{level:g}"][0 if right else 1] += 1
    return {
        "command": "python -m benchmarks.identity_counting",
        "texts": args.texts,
        "registry": args.registry,
        "tokens": args.tokens,
        "scale": args.scale,
        "temperature": args.temperature,
        "substitution": args.substitution,
        "mean_entropy_nats": round(float(generation.entropy.mean()), 3),
        "named": {
            level: {"right": _rate(right, args.texts), "wrong": _rate(wrong, args.texts)}
            for level, (right, wrong) in named.items()
        },
        "identity_s_per_named_text_p50": round(float(np.median(identity_s)), 4) if identity_s else None,
        "generate_s": round(generated_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=200)
    parser.add_argument("--registry", type=int, default=1_000_000)
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--scale", type=float, default=4.0, help="the synthetic LM's logit scale")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--substitution", type=float, default=0.0, help="share of tokens replaced at random")
    parser.add_argument("--levels", type=float, nargs="+", default=[1e-3, 1e-2])
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    if args.texts > args.registry:
        parser.error("--texts must not exceed --registry")
    print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
