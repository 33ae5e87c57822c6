"""From cached completions to every number of the report (decoding only: no model calls here)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from xmark_core import CandidateSet, DecodeResult, Message, WatermarkKey, WatermarkParams, attribute, decode, detect

from . import attacks
from .config import UNWATERMARKED, EvalConfig, GenSpec
from .metrics import bit_accuracy, detection_score, mean, roc_auc, roc_curve, stderr, tpr_at_fpr
from .population import evaluation_key, null_keys, registry, user_messages
from .store import GenerationStore

Texts = list[list[int]]


@dataclass(frozen=True)
class Variant:
    """A method as the tables name it: a generation setting plus the decoder's counting rule."""

    label: str
    spec: GenSpec
    constrained: bool


def method_label(spec: GenSpec, constrained: bool) -> str:
    if spec.scheme == "mpac":
        return "MPAC"
    if spec.scheme == "loso":
        return "LoSo"
    if spec.scheme == "xmark":
        return f"XMark (k={spec.num_keys})" if constrained else f"XMark- (k={spec.num_keys})"
    return "Unwatermarked"


def variants(spec: GenSpec) -> list[Variant]:
    if not spec.watermarked:
        return []
    out = [Variant(method_label(spec, True), spec, True)]
    if spec.scheme == "xmark" and spec.num_keys > 1:
        out.append(Variant(method_label(spec, False), spec, False))
    return out


class Corpus:
    """Per-user token-id views of the cached completions: generated ids, re-tokenized text, prefixes."""

    def __init__(self, store: GenerationStore, tokenizer: PreTrainedTokenizerBase, users: int) -> None:
        self.store = store
        self.tokenizer = tokenizer
        self.users = users
        self._retok: dict[tuple[str, int, int, int], list[int]] = {}

    def complete_users(self, spec: GenSpec) -> list[int]:
        return [u for u in range(self.users) if (spec.name, u, 0) in self.store and (spec.name, u, 1) in self.store]

    def ids(self, spec: GenSpec, user: int, length: int) -> Texts:
        out = []
        for slot in (0, 1):
            row = self.store.get(spec.name, user, slot)
            assert row is not None
            out.append(row.token_ids[:length])
        return out

    def retok(self, spec: GenSpec, user: int, length: int) -> Texts:
        """The prefix decoded to text and tokenized again, as a suspect text pasted into /trace."""
        out = []
        for slot in (0, 1):
            cache_key = (spec.name, user, slot, length)
            if cache_key not in self._retok:
                row = self.store.get(spec.name, user, slot)
                assert row is not None
                text = self.tokenizer.decode(row.token_ids[:length], skip_special_tokens=True)
                self._retok[cache_key] = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(self._retok[cache_key])
        return out

    def text(self, spec: GenSpec, user: int, slot: int, length: int) -> str:
        row = self.store.get(spec.name, user, slot)
        assert row is not None
        return self.tokenizer.decode(row.token_ids[:length], skip_special_tokens=True)

    def ppl(self, spec: GenSpec, user: int, length: int) -> list[float]:
        """Perplexity of each of the user's two completions (prefix of `length` tokens)."""
        out = []
        for slot in (0, 1):
            row = self.store.get(spec.name, user, slot)
            assert row is not None
            out.append(math.exp(float(np.mean(row.nll[:length]))))
        return out


def _decodable(texts: Texts) -> bool:
    return any(len(t) >= 3 for t in texts)


class Analysis:
    """Computes the result sections. Keys are built once per parameter set and reused."""

    def __init__(self, config: EvalConfig, corpus: Corpus, vocab_size: int, special_ids: int) -> None:
        self.config = config
        self.corpus = corpus
        self.vocab_size = vocab_size
        self.special_ids = special_ids
        self.specs = config.specs()
        self._keys: dict[WatermarkParams, WatermarkKey] = {}
        self._null: dict[WatermarkParams, list[WatermarkKey]] = {}
        self._messages: dict[int, list[Message]] = {}
        self._negatives: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
        self._registries: dict[int, CandidateSet] = {}

    # -- building blocks -------------------------------------------------------------------------
    def key(self, params: WatermarkParams) -> WatermarkKey:
        if params not in self._keys:
            self._keys[params] = evaluation_key(params, self.config.seed)
        return self._keys[params]

    def null_keys(self, params: WatermarkParams) -> list[WatermarkKey]:
        if params not in self._null:
            self._null[params] = null_keys(params, self.config.seed, self.config.null_keys)
        return self._null[params]

    def messages(self, bits: int) -> list[Message]:
        if bits not in self._messages:
            self._messages[bits] = user_messages(bits, self.config.users, self.config.seed)
        return self._messages[bits]

    def unwatermarked(self, temperature: float) -> GenSpec | None:
        for spec in self.specs:
            if not spec.watermarked and spec.temperature == temperature:
                return spec
        return None

    def _decode(
        self, texts: Texts, params: WatermarkParams, constrained: bool, key: WatermarkKey | None = None
    ) -> DecodeResult:
        return decode(texts, key or self.key(params), constrained=constrained)

    def negatives(self, params: WatermarkParams, constrained: bool, length: int) -> list[tuple[float, float]]:
        """(detection score, sigma) of unwatermarked users' texts under the run's key and the null keys."""
        cache_key = (params, constrained, length)
        if cache_key in self._negatives:
            return self._negatives[cache_key]
        base = self.unwatermarked(self.config.main_temperature)
        out: list[tuple[float, float]] = []
        if base is not None:
            keys = [self.key(params), *self.null_keys(params)]
            for user in self.corpus.complete_users(base):
                texts = self.corpus.ids(base, user, length)
                for key in keys:
                    found = detect(self._decode(texts, params, constrained, key), alpha=self.config.alpha)
                    out.append((detection_score(found.p_value), found.sigma))
        self._negatives[cache_key] = out
        return out

    def registry(self, params: WatermarkParams) -> CandidateSet:
        if params.bits not in self._registries:
            self._registries[params.bits] = registry(
                params.bits, self.config.users, self.config.registry_size, self.config.seed, params
            )
        return self._registries[params.bits]

    # -- sections --------------------------------------------------------------------------------
    def quality(self) -> list[dict[str, Any]]:
        """BA (generated ids and re-tokenized text), exact-message rate and perplexity per setting and T."""
        cells: list[dict[str, Any]] = []
        ppl_base: dict[tuple[float, int], float | None] = {}
        for spec in self.specs:
            if spec.watermarked:
                continue
            users = self.corpus.complete_users(spec)
            main = WatermarkParams(bits=self.config.main_bits, num_keys=2, delta=self.config.main_delta)
            truth = self.messages(self.config.main_bits)
            for t in self.config.t_grid:
                length = t // 2
                ppl = [p for u in users for p in self.corpus.ppl(spec, u, length)]
                ba = [
                    bit_accuracy(self._decode(self.corpus.ids(spec, u, length), main, True).bits, truth[u].bits)
                    for u in users
                ]
                ppl_base[(spec.temperature, t)] = mean(ppl)
                cells.append(
                    _cell(
                        spec,
                        "Unwatermarked",
                        True,
                        t,
                        len(users),
                        ba=mean(ba),
                        ba_se=stderr(ba),
                        ppl=mean(ppl),
                        ppl_se=stderr(ppl),
                    )
                )
        for spec in self.specs:
            users = self.corpus.complete_users(spec)
            if not spec.watermarked or not users:
                continue
            params = spec.params()
            truth = self.messages(spec.bits)
            for variant in variants(spec):
                for t in self.config.t_grid:
                    length = t // 2
                    ba, ba_rt, ex, ex_rt = [], [], [], []
                    for u in users:
                        bits = self._decode(self.corpus.ids(spec, u, length), params, variant.constrained).bits
                        retok = self.corpus.retok(spec, u, length)
                        bits_rt = (
                            self._decode(retok, params, variant.constrained).bits
                            if _decodable(retok)
                            else "?" * spec.bits
                        )
                        ba.append(bit_accuracy(bits, truth[u].bits))
                        ba_rt.append(bit_accuracy(bits_rt, truth[u].bits))
                        ex.append(float(bits == truth[u].bits))
                        ex_rt.append(float(bits_rt == truth[u].bits))
                    ppl = [p for u in users for p in self.corpus.ppl(spec, u, length)]
                    base = ppl_base.get((spec.temperature, t))
                    cells.append(
                        _cell(
                            spec,
                            variant.label,
                            variant.constrained,
                            t,
                            len(users),
                            ba=mean(ba),
                            ba_se=stderr(ba),
                            ba_retok=mean(ba_rt),
                            exact=mean(ex),
                            exact_retok=mean(ex_rt),
                            ppl=mean(ppl),
                            ppl_se=stderr(ppl),
                            ppl_increase=(mean(ppl) - base) if base is not None and ppl else None,
                        )
                    )
        return cells

    def detection(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """False-positive test per method, b in fpr_bits, T: AUC, TPR at 1% / 0.1% FPR, empirical FPR
        at alpha, sigma rule."""
        cfg = self.config
        rows: list[dict[str, Any]] = []
        curves: list[dict[str, Any]] = []
        for spec in self.specs:
            if not (
                spec.watermarked
                and spec.bits in cfg.fpr_bits
                and spec.delta == cfg.main_delta
                and spec.temperature == cfg.main_temperature
            ):
                continue
            if spec.scheme == "xmark" and spec.num_keys != 2:
                continue
            users = self.corpus.complete_users(spec)
            if not users:
                continue
            params = spec.params()
            for variant in variants(spec):
                for t in cfg.t_grid:
                    length = t // 2
                    negatives = self.negatives(params, variant.constrained, length)
                    if not negatives:
                        continue
                    pos = []
                    for u in users:
                        found = detect(
                            self._decode(self.corpus.ids(spec, u, length), params, variant.constrained), alpha=cfg.alpha
                        )
                        pos.append((detection_score(found.p_value), found.sigma))
                    ps, pz = [p[0] for p in pos], [p[1] for p in pos]
                    ns, nz = [n[0] for n in negatives], [n[1] for n in negatives]
                    row = _cell(spec, variant.label, variant.constrained, t, len(users))
                    row.update(
                        n_negatives=len(negatives),
                        auc=roc_auc(ps, ns),
                        auc_sigma=roc_auc(pz, nz),
                        tpr_at_1pct=tpr_at_fpr(ps, ns, 0.01),
                        tpr_at_01pct=tpr_at_fpr(ps, ns, 0.001),
                        sigma_rule_fpr=float(np.mean(np.asarray(nz) > cfg.sigma_threshold)),
                        sigma_rule_tpr=float(np.mean(np.asarray(pz) > cfg.sigma_threshold)),
                    )
                    for alpha in cfg.alphas:
                        cut = -math.log10(alpha)
                        row[f"fpr_at_alpha_{alpha:g}"] = float(np.mean(np.asarray(ns) > cut))
                        row[f"tpr_at_alpha_{alpha:g}"] = float(np.mean(np.asarray(ps) > cut))
                    rows.append(row)
                    if t in (min(cfg.t_grid), max(cfg.t_grid)):
                        fpr, tpr = roc_curve(ps, ns)
                        curves.append({"method": variant.label, "bits": spec.bits, "T": t, "fpr": fpr, "tpr": tpr})
        return rows, curves

    def attribution(self) -> list[dict[str, Any]]:
        """Right user ranked first / named (p < alpha) among registry_size users; false attribution on
        unwatermarked text."""
        cfg = self.config
        rows: list[dict[str, Any]] = []
        for bits in cfg.attribution_bits:
            for spec in self.specs:
                if not (
                    spec.watermarked
                    and spec.bits == bits
                    and spec.delta == cfg.main_delta
                    and spec.temperature == cfg.main_temperature
                ):
                    continue
                users = self.corpus.complete_users(spec)
                if not users:
                    continue
                params = spec.params()
                candidates = self.registry(params)
                for variant in variants(spec):
                    for t in cfg.t_grid:
                        length = t // 2
                        first, named, wrong, first_rt, named_rt = [], [], [], [], []
                        for u in users:
                            found = attribute(
                                self._decode(self.corpus.ids(spec, u, length), params, variant.constrained),
                                candidates,
                                alpha=cfg.alpha,
                            )
                            first.append(float(bool(found.candidates) and found.candidates[0].id == u))
                            named.append(float(found.best is not None and found.best.id == u))
                            wrong.append(float(found.best is not None and found.best.id != u))
                            retok = self.corpus.retok(spec, u, length)
                            if _decodable(retok):
                                found = attribute(
                                    self._decode(retok, params, variant.constrained), candidates, alpha=cfg.alpha
                                )
                                first_rt.append(float(bool(found.candidates) and found.candidates[0].id == u))
                                named_rt.append(float(found.best is not None and found.best.id == u))
                            else:
                                first_rt.append(0.0)
                                named_rt.append(0.0)
                        false_named = self._false_attribution(params, variant.constrained, length, candidates)
                        row = _cell(spec, variant.label, variant.constrained, t, len(users))
                        row.update(
                            registry_size=len(candidates),
                            top1=mean(first),
                            named=mean(named),
                            named_wrong=mean(wrong),
                            top1_retok=mean(first_rt),
                            named_retok=mean(named_rt),
                            false_attribution=false_named[0],
                            n_null=false_named[1],
                        )
                        rows.append(row)
        return rows

    def _false_attribution(
        self, params: WatermarkParams, constrained: bool, length: int, candidates: CandidateSet
    ) -> tuple[float | None, int]:
        base = self.unwatermarked(self.config.main_temperature)
        if base is None:
            return None, 0
        hits = []
        for user in self.corpus.complete_users(base):
            texts = self.corpus.ids(base, user, length)
            for key in [self.key(params), *self.null_keys(params)]:
                found = attribute(self._decode(texts, params, constrained, key), candidates, alpha=self.config.alpha)
                hits.append(float(found.best is not None))
        return mean(hits), len(hits)

    def robustness(self) -> list[dict[str, Any]]:
        """BA and detection rate (p < alpha) after copy-paste, word deletion and token substitution."""
        cfg = self.config
        base = self.unwatermarked(cfg.main_temperature)
        rows: list[dict[str, Any]] = []
        for spec in self.specs:
            if not (
                spec.watermarked
                and spec.scheme in cfg.robustness_methods
                and spec.bits == cfg.main_bits
                and spec.delta == cfg.main_delta
                and spec.temperature == cfg.main_temperature
            ):
                continue
            if spec.scheme == "xmark" and spec.num_keys != 2:
                continue
            users = self.corpus.complete_users(spec)
            if base is not None:
                have_base = set(self.corpus.complete_users(base))
                users_cp = [u for u in users if u in have_base]
            else:
                users_cp = []
            params = spec.params()
            truth = self.messages(spec.bits)
            for variant in variants(spec):
                for t in sorted({min(cfg.t_grid), max(cfg.t_grid)}):
                    length = t // 2
                    edits: list[tuple[str, float, list[int], Callable[[int, int, random.Random], list[int]]]] = []
                    for f in cfg.copy_paste_fractions:
                        edits.append(("copy_paste", f, users_cp, self._copy_paste_edit(spec, base, length, f)))
                    for r in cfg.edit_rates:
                        edits.append(("word_deletion", r, users, self._deletion_edit(spec, length, r)))
                        edits.append(("token_substitution", r, users, self._substitution_edit(spec, length, r)))
                    for attack, level, attacked_users, edit in edits:
                        ba, det = [], []
                        for u in attacked_users:
                            texts = [
                                edit(
                                    u,
                                    slot,
                                    random.Random(f"xmark-eval/{cfg.seed}/{attack}/{level}/{spec.name}/{u}/{slot}"),
                                )
                                for slot in (0, 1)
                            ]
                            if not _decodable(texts):
                                ba.append(0.0)
                                det.append(0.0)
                                continue
                            result = self._decode(texts, params, variant.constrained)
                            ba.append(bit_accuracy(result.bits, truth[u].bits))
                            det.append(float(detect(result, alpha=cfg.alpha).is_watermarked))
                        row = _cell(spec, variant.label, variant.constrained, t, len(attacked_users))
                        row.update(attack=attack, level=level, ba=mean(ba), ba_se=stderr(ba), detected=mean(det))
                        rows.append(row)
        return rows

    def _copy_paste_edit(
        self, spec: GenSpec, base: GenSpec | None, length: int, fraction: float
    ) -> Callable[[int, int, random.Random], list[int]]:
        def edit(user: int, slot: int, rng: random.Random) -> list[int]:
            assert base is not None
            own = self.corpus.ids(spec, user, length)[slot]
            source = self.corpus.ids(base, user, length)[slot]
            return attacks.copy_paste(own, source, fraction, rng)

        return edit

    def _deletion_edit(self, spec: GenSpec, length: int, rate: float) -> Callable[[int, int, random.Random], list[int]]:
        def edit(user: int, slot: int, rng: random.Random) -> list[int]:
            text = attacks.delete_words(self.corpus.text(spec, user, slot, length), rate, rng)
            return self.corpus.tokenizer.encode(text, add_special_tokens=False)

        return edit

    def _substitution_edit(
        self, spec: GenSpec, length: int, rate: float
    ) -> Callable[[int, int, random.Random], list[int]]:
        def edit(user: int, slot: int, rng: random.Random) -> list[int]:
            own = self.corpus.ids(spec, user, length)[slot]
            return attacks.substitute_tokens(own, rate, self.special_ids, self.vocab_size, rng)

        return edit


def _cell(spec: GenSpec, method: str, constrained: bool, t: int, users: int, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "setting": spec.name,
        "method": method,
        "scheme": spec.scheme if spec.watermarked else UNWATERMARKED,
        "bits": spec.bits if spec.watermarked else None,
        "num_keys": spec.num_keys if spec.watermarked else None,
        "delta": spec.delta if spec.watermarked else None,
        "temperature": spec.temperature,
        "decoder": "cTMM" if constrained else "TMM",
        "T": t,
        "n_users": users,
    }
    row.update(values)
    return row
