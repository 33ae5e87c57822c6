"""Where the watermark's bias costs quality and where it buys evidence, by the model's confidence.

    python -m benchmarks.evaluation.bias_budget [--prompts 32] [--tokens 150] [--temperature 0.7]

An offline reading of the served model's own distributions, to choose how the bias should depend
on them (``WatermarkParams.min_entropy`` and what may follow it). The model answers ``--prompts``
prompts of the committed set without a watermark (transformers, sampled at the temperature); at
every generated position, with p the model's distribution at that temperature, p1 the one at
temperature 1, and the bias a = δ / τ added to a random boosted list (each token in it with
probability gamma = (3/4)^4, the default key's share; ``--draws`` draws per position):

* cost: the expected rise of the answer's negative log-likelihood under the model (what
  perplexity reads), E_q[-log p1(x)] - E_p[-log p1(x)] with q the biased distribution;
* signal: the expected rise of the boosted share, E_q[B] - E_p[B] (what the counting decoder reads).

Printed per bucket of the position's top-token probability (temperature 1), for δ = 1 and 2, and
for the threshold rule at several thresholds and biases: the share of positions biased, the cost
(nats per token, and the perplexity factor it implies) and the signal per token. A first-order
reading: over random boosted lists the cost is second order in δ and the signal first order, so
the bias buys most where signal / cost is largest.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01)


def main(argv: list[str] | None = None) -> int:
    import torch

    from .generation import chat_prompt, load_model
    from .prompts import load_prompts

    parser = argparse.ArgumentParser(prog="python -m benchmarks.evaluation.bias_budget", description=__doc__)
    parser.add_argument("--model-path", type=Path, default=Path("var/models/smollm2-135m-instruct"))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--draws", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model_path)
    prompts = load_prompts()
    chosen = prompts[:: max(1, len(prompts) // args.prompts)][: args.prompts]
    rows = []
    for prompt in chosen:
        ids = tokenizer(chat_prompt(tokenizer, prompt.text), add_special_tokens=False)["input_ids"]
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=args.tokens,
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.eos_token_id,
        )
        rows.append(torch.cat(out.logits, 0).double())
    logits = torch.cat(rows, 0)  # [positions, V] before any processor
    logp1 = torch.log_softmax(logits, -1)
    top1 = logp1.max(-1).values.exp()
    p = torch.softmax(logits / args.temperature, -1)
    gamma = 0.75**4
    gen = torch.Generator().manual_seed(1)
    result: dict[str, Any] = {
        "command": "python -m benchmarks.evaluation.bias_budget " + " ".join(argv or sys.argv[1:]),
        "positions": int(logits.shape[0]),
        "temperature": args.temperature,
        "buckets": [],
        "rules": [],
    }
    for delta in (1.0, 1.5, 2.0, 2.5, 3.0):
        a = delta / args.temperature
        cost = torch.zeros(logits.shape[0], dtype=torch.float64)
        signal = torch.zeros_like(cost)
        for _ in range(args.draws):
            boosted = (torch.rand(logits.shape, generator=gen) < gamma).double()
            q = p * torch.exp(a * boosted)
            q /= q.sum(-1, keepdim=True)
            cost += ((q - p) * (-logp1)).sum(-1) / args.draws
            signal += ((q - p) * boosted).sum(-1) / args.draws
        if delta in (1.0, 2.0):
            for lo, hi in itertools.pairwise(EDGES):
                inside = (top1 >= lo) & (top1 < hi)
                if int(inside.sum()):
                    c, s = float(cost[inside].mean()), float(signal[inside].mean())
                    result["buckets"].append(
                        {
                            "delta": delta,
                            "top1": [lo, min(hi, 1.0)],
                            "share": round(float(inside.double().mean()), 3),
                            "cost": round(c, 4),
                            "signal": round(s, 4),
                            "signal_per_cost": round(s / c, 2) if c > 0 else None,
                        }
                    )
        for threshold in (1.01, 0.9, 0.7, 0.5, 0.3):
            on = (top1 < threshold).double()
            c, s = float((cost * on).mean()), float((signal * on).mean())
            result["rules"].append(
                {
                    "delta": delta,
                    "min_entropy": round(-math.log(min(threshold, 1.0)), 3) + 0.0,  # -0.0 shows as 0
                    "biased_share": round(float(on.mean()), 3),
                    "cost": round(c, 4),
                    "ppl_factor": round(math.exp(c), 3),
                    "signal": round(s, 4),
                }
            )
    print("| δ | top-token probability | share of positions | cost (nats) | signal | signal / cost |")
    print("|---|---|---|---|---|---|")
    for b in result["buckets"]:
        lo, hi = b["top1"]
        cells = (f"{b['delta']:g}", f"{lo:.2f}–{hi:.2f}", f"{b['share']:.2f}", f"{b['cost']:.3f}")
        print("| " + " | ".join((*cells, f"{b['signal']:.3f}", str(b["signal_per_cost"]))) + " |")
    print()
    print("| δ | h (nats) | positions biased | cost (nats/token) | perplexity factor | signal per token |")
    print("|---|---|---|---|---|---|")
    for r in result["rules"]:
        print(
            f"| {r['delta']:g} | {r['min_entropy']:g} | {r['biased_share']:.2f} | {r['cost']:.3f} "
            f"| {r['ppl_factor']:.3f} | {r['signal']:.3f} |"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
