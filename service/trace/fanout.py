"""/trace's fan-out: the plan's tests (``trace.plan``) run in order until one names someone, and
the rules that withdraw a naming (``trace.policy``, rules 8-10).


Order of the tests: the registry first, then the retrieved users; within each, every reading's
counting test (in the order of the models file), then every model's likelihood test; the first
test that names someone decides, and its reading's model is the one the report names. A candidate set's p-values
are also corrected for its own size (``xmark_core.attribute``), so the retrieved set's test pays
for its handful of users rather than the whole registry. Within the retrieved set the level is not
split equally: the content search's best lead gets ``TracePolicy.top_lead_share`` of it and every other lead
an equal part of the rest (a weighted Bonferroni correction, ``xmark_core.CandidateSet.with_shares``).
A rewritten answer's author is the best lead far more often than any other (the provenance
evaluation: 85–95 % of paraphrases and summaries), so the author's p-value is multiplied by 2
rather than by the number of leads (20 by default), and a wrong lead is still named with
probability at most ``alpha``: the shares sum to 1 and the search that ranks the leads reads
content only, never the key.

The retrieved set's test is exact for a text no one watermarked, but a text that carries another
user's watermark can make a retrieved user whose message ID shares blocks with that user's pass
it (a forged text, or an answer whose own generation the log does not hold). So a naming in the
retrieved set stands only if the same decoder over the whole registry ranks that user first with
the posterior confidence a naming needs there (``TracePolicy.min_confidence``): only the registry's
p-value, which pays for every registered user, may fall short. A registry user who explains the
watermark as well or better withdraws it. The rule only withdraws namings, so the count stays
valid.

One retrieved user is exempt from the registry's ranking: the copy holder, the only user whose
logged completions hold a near-copy of the text (where no user's do: an edited copy;
``TracePolicy.copy_holder``). The case the rule guards against needs a text that carries another
user's watermark; a near-copy in the holder's log says the gateway served this text to the holder,
so the holder's own test suffices: with a holder the retrieved set is the holder alone (only the
holder may be named, below), its p-value corrected for every test of the plan. The content search
chose the holder without the key, so the plan is fixed before any test and the count is unchanged.
In a registry of 10^6 the author's nearest registered IDs differ in a block or two, and a
150-token text rarely gives the registry-wide posterior the confidence a naming needs. Where two
users' logs hold near-copies there is no holder and the rule applies to both.

With a holder, no one else is named: a registry-wide naming of anyone else does not stand (the
fan-out goes on to the retrieved users' test, which may name the holder), nor does another lead's. The watermark of an
edited or short text can fit a registry neighbour of the author's ID better than the author's
own; the provenance evaluation saw it name the wrong user at 10^6 for a text held verbatim in the
author's log. The rule only withdraws namings, so the count stays valid.

Without a holder the same mistake is checked by the watermark itself. When the user a
registry-wide test names is not among the leads (their log holds nothing like the text), that
test's own identity test is run against the leads: the p-value that the text carries a lead's
message ID rather than the named user's (``analysis.lead_identity_p``). If it does not reject
every lead at ``TracePolicy.lead_identity_level``, the naming is withdrawn (the report's note says why) and the
fan-out goes on. An attacked answer whose watermark fits a registry neighbour of its author's ID
better than the author's own, with the author among the leads, is withdrawn with probability at
least 1 - ``TracePolicy.lead_identity_level`` when the counting decoder named (its identity test is exact for
the message a text carries, edits included; the likelihood decoder's is exact on unedited text:
``xmark_core.identity_p``). A text that does carry the named user's watermark (a
forgery, a generation past the retention) keeps its naming unless a lead's message ID is so close
to the named user's that the text cannot tell them apart. The rule only withdraws namings, so the
count stays valid.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from service.parties import party_key
from service.trace.analysis import TraceOutcome, analyze_counting_by_length, analyze_likelihood_by_length
from service.trace.plan import CandidateScope, CandidateSet, FanoutPlan
from service.trace.policy import TracePolicy
from service.vocabulary import TraceDecoder
from xmark_core import ModelScores

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")


@dataclass(frozen=True)
class FanoutOutcome:
    outcome: TraceOutcome
    # the candidate set whose test named the user (None: nobody was named)
    named_in: CandidateScope | None
    tries: int
    # the model of the reading whose test decided ("" for a plan without readings)
    model: str | None = None
    # the user of the first registry-wide naming the leads' identity test withdrew, if any
    withdrawn: int | None = None
    # the user of the first retrieved-set naming the registry's ranking did not back, if any
    refused: int | None = None


@dataclass(frozen=True)
class TextReading:
    """One tokenization of the text (the thresholds and the likelihood reading's parameters are the
    policy's, the same for every test)."""

    ids: list[int]
    tokenizer: PreTrainedTokenizerBase
    include_tokens: bool = False


Runner = Callable[[Callable[[], T]], Awaitable[T]]


async def on_thread(work: Callable[[], T]) -> T:
    """Run ``work`` on a worker thread (a ``Runner``)."""
    return await asyncio.to_thread(work)


ScoreSource = Callable[[], Awaitable[ModelScores | None]]


class TraceFanout:
    """Runs a plan's tests in order until one names someone."""

    def __init__(
        self, plan: FanoutPlan, reading: TextReading | Sequence[TextReading], policy: TracePolicy | None = None
    ) -> None:
        self.plan = plan
        # with an identity level, only the likelihood decoder names (after its identity test);
        # counting's verdict still counts
        self.policy = policy or TracePolicy()
        self.readings = (reading,) if isinstance(reading, TextReading) else tuple(reading)
        if len(self.readings) != len(plan.reading_plans):
            raise ValueError("one text reading per planned reading")
        self.reading = self.readings[0]

    def counting(self, candidates: CandidateSet, reading: TextReading | None = None) -> TraceOutcome:
        r = self.reading if reading is None else reading
        return analyze_counting_by_length(
            r.ids,
            r.tokenizer,
            candidates.groups,
            policy=self.policy,
            include_tokens=r.include_tokens,
            multiplicity=self.plan.multiplicity,
            leads=self._leads(candidates),
        )

    def likelihood(
        self,
        candidates: CandidateSet,
        scores: ModelScores,
        counting: TraceOutcome | None = None,
        reading: TextReading | None = None,
    ) -> TraceOutcome:
        r = self.reading if reading is None else reading
        return analyze_likelihood_by_length(
            r.ids,
            scores,
            r.tokenizer,
            candidates.groups,
            policy=self.policy,
            counting=counting,
            include_tokens=r.include_tokens,
            multiplicity=self.plan.multiplicity,
            leads=self._leads(candidates),
        )

    def _leads(self, candidates: CandidateSet) -> tuple[int, ...]:
        """The leads a registry-wide naming is checked against (none for the retrieved set's test)."""
        return self.plan.leads if candidates.scope == CandidateScope.REGISTRY else ()

    async def run(
        self,
        score: ScoreSource | Mapping[str, ScoreSource],
        *,
        run_counting: Runner[TraceOutcome],
        run_likelihood: Runner[TraceOutcome] = on_thread,
    ) -> FanoutOutcome:
        """Every planned test in order until one names someone.

        ``score``: the model's scores of the text (awaited once, on the model's first likelihood
        test; None when the scorer cannot read it: the counting decoder's outcome stands); for a
        plan of several readings, one source per scoring model. ``run_*`` run the analyses (inline
        or on a worker thread). Without a naming, the registry outcome with the smallest p-value
        over the readings is reported (each reading's last test).
        """
        plan = self.plan
        tries = plan.multiplicity.tries
        # with an identity level, counting gives its verdict but never the name
        counting_names = self.policy.identity_level is None
        scored: dict[str, ModelScores | None] = {}
        reported: list[tuple[TraceOutcome, str]] = []
        # each (model, decoder)'s outcome over the whole registry: a retrieved user's naming must agree with it
        registry: dict[tuple[str, TraceDecoder], TraceOutcome] = {}
        withdrawn: list[int] = []
        refused: list[int] = []

        async def scores_of(model: str) -> ModelScores | None:
            if model not in scored:
                source = score if callable(score) else score[model]
                scored[model] = await source()
            return scored[model]

        def stands(outcome: TraceOutcome, model: str, decoder: TraceDecoder, candidates: CandidateSet) -> bool:
            """Records a registry outcome; whether ``outcome``'s naming stands."""
            if candidates.scope == CandidateScope.REGISTRY:
                registry[(model, decoder)] = outcome
                named = outcome.attributed_user_id
                if named is None or plan.copy_holder not in (None, named):
                    return False
                if not self.policy.lead_identity_stands(outcome.lead_identity_p):  # (the holder is a lead: never here)
                    withdrawn.append(named)
                    return False
                return True
            user = outcome.attributed_user_id
            if user is None:
                return False
            if plan.copy_holder is not None:  # the gateway served this text to that user: no one else
                return user == plan.copy_holder
            ranked = registry.get((model, decoder))
            if ranked is not None and self.policy.registry_backs(_ranks_first(ranked, user), ranked.confidence):
                return True
            refused.append(user)
            return False

        def done(outcome: TraceOutcome, scope: CandidateScope | None, model: str) -> FanoutOutcome:
            return FanoutOutcome(outcome, scope, tries, model, _first(withdrawn), _first(refused))

        for candidates in plan.candidate_sets:
            readings = list(zip(plan.reading_plans, self.readings, strict=True))
            # every reading's counting test first (cheap), then the likelihood tests (a forward
            # pass each): a text one model's counting test names costs no other model's pass
            counted: list[TraceOutcome | None] = []
            for reading_plan, reading in readings:
                first = None
                if TraceDecoder.COUNTING in reading_plan.decoders:
                    model = reading_plan.models[0]
                    first = await run_counting(functools.partial(self.counting, candidates, reading))
                    if stands(first, model, TraceDecoder.COUNTING, candidates) and counting_names:
                        return done(first, candidates.scope, model)
                counted.append(first)
            for (reading_plan, reading), first in zip(readings, counted, strict=True):
                outcome, last_model = first, reading_plan.models[0]
                if TraceDecoder.LIKELIHOOD in reading_plan.decoders:
                    for model in reading_plan.scorers:
                        scores = await scores_of(model)
                        if scores is None:
                            continue
                        work = functools.partial(self.likelihood, candidates, scores, first, reading)
                        outcome = await run_likelihood(work)
                        last_model = model
                        if stands(outcome, model, TraceDecoder.LIKELIHOOD, candidates):
                            return done(outcome, candidates.scope, model)
                if candidates.scope == CandidateScope.REGISTRY and outcome is not None:
                    reported.append((outcome, last_model))
        if not reported:
            raise RuntimeError("the plan ran no test (a likelihood-only plan whose scorer gave nothing)")
        best, model = min(reported, key=lambda pair: pair[0].report.p_value)
        return done(_unnamed(best) if best.named else best, None, model)

    def run_now(self, scores: ModelScores | None) -> FanoutOutcome:
        """``run`` with the scores at hand, every analysis inline (offline evaluations; not from
        within a running event loop)."""

        async def given() -> ModelScores | None:
            return scores

        return asyncio.run(self.run(given, run_counting=_inline, run_likelihood=_inline))


async def _inline(work: Callable[[], T]) -> T:
    return work()


def _ranks_first(outcome: TraceOutcome, user_id: int | None) -> bool:
    """Whether ``outcome`` (a test over the whole registry) ranks ``user_id`` first."""
    candidates = outcome.report.candidates
    return (
        user_id is not None
        and bool(candidates)
        and party_key(candidates[0].user_id, None if candidates[0].end_user is None else candidates[0].end_user.id)
        == user_id
    )


def _first(users: Sequence[int]) -> int | None:
    return users[0] if users else None


def _unnamed(outcome: TraceOutcome) -> TraceOutcome:
    """``outcome`` with its naming withdrawn (the report keeps its candidates)."""
    report = outcome.report.model_copy(update={"attribution": None})
    return TraceOutcome(report, outcome.key_version_id, None, strength=outcome.strength)
