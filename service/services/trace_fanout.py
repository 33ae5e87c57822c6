"""/trace's fan-out and its one multiplicity count.

A trace may test one text many times: against each candidate set (the whole registry; the users a
content search of the generation log led to), under each key version of each message length, in
each reading of the text (one per tokenizer of the served models), with each decoder (counting,
once per tokenization; likelihood, once per served model, with that model's scorer). Each test's
p-value is exact on its own; naming the best of them is valid at ``alpha`` only if every p-value
is multiplied by the number of tests that *could* run, fixed before any of them looks at the
watermark: ``FanoutPlan.tries``. The plan is chosen from what needs no watermark key (the request,
the served models, whether their scorers are at hand, the text's length, and the retrieved
candidates, which a content search chose), so it is the same whatever the watermark says. This
module is the only place that counts; ``trace_analysis`` applies the count it is given.

Order of the tests: the registry first, then the retrieved users; within each, every reading's
counting test (in the order of the models file), then every model's likelihood test; the first
test that names someone decides, and its reading's model is the one the report names. A candidate set's p-values
are also corrected for its own size (``xmark_core.attribute``), so the retrieved set's test pays
for its handful of users rather than the whole registry. Within the retrieved set the level is not
split equally: the content search's best lead gets ``TOP_LEAD_SHARE`` of it and every other lead
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
the posterior confidence a naming needs there (``DEFAULT_MIN_CONFIDENCE``): only the registry's
p-value, which pays for every registered user, may fall short. A registry user who explains the
watermark as well or better withdraws it. The rule only withdraws namings, so the count stays
valid.

One retrieved user is exempt from the registry's ranking: the copy holder, the only user whose
logged completions hold a near-copy of the text (where no user's do: an edited copy;
``retrieval.copy_holder``). The case the rule guards against needs a text that carries another
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
message ID rather than the named user's (``trace_analysis.lead_identity_p``). If it does not reject
every lead at ``LEAD_IDENTITY_LEVEL``, the naming is withdrawn (the report's note says why) and the
fan-out goes on. An attacked answer whose watermark fits a registry neighbour of its author's ID
better than the author's own, with the author among the leads, is withdrawn with probability at
least 1 - ``LEAD_IDENTITY_LEVEL`` when the counting decoder named (its identity test is exact for
the message a text carries, edits included; the likelihood decoder's is exact on unedited text:
``xmark_core.identity_p``). A text that does carry the named user's watermark (a
forgery, a generation past the retention) keeps its naming unless a lead's message ID is so close
to the named user's that the text cannot tell them apart. The rule only withdraws namings, so the
count stays valid.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from service.parties import party_key
from service.provenance.retrieval import Retrieved
from service.services.registry_cache import RegistrySnapshot
from service.services.trace_analysis import (
    LengthGroup,
    TraceOutcome,
    analyze_counting_by_length,
    analyze_likelihood_by_length,
)
from service.vocabulary import TraceDecoder
from xmark_core import DEFAULT_EDIT_RATE, DEFAULT_MIN_CONFIDENCE, ModelScores

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")

# a registry-wide naming of a user whose log holds nothing like the text stands only if its identity
# test rejects every lead at this level (see the module's docstring)
LEAD_IDENTITY_LEVEL = 0.01
# the retrieved set's test gives its first lead this share of the level, the others equal parts of
# the rest (see the module's docstring)
TOP_LEAD_SHARE = 0.5


class CandidateScope(enum.StrEnum):
    """Which registered users a test scores the text against."""

    REGISTRY = "registry"  # every registered message ID
    RETRIEVED = "retrieved"  # the users whose logged completions the text resembles


@dataclass(frozen=True)
class CandidateSet:
    """One candidate set of the fan-out: each message length's key versions and its candidates."""

    scope: CandidateScope
    groups: tuple[LengthGroup, ...]
    # the retrieved set only: the one user whose logged completions hold a near-copy of the text
    copy_holder: int | None = None


@dataclass(frozen=True)
class ReadingPlan:
    """The tests of one tokenization of the text: the models that tokenize it this way (the first
    names its counting test), the decoders, and the models whose scorer runs the likelihood test."""

    models: tuple[str, ...]
    decoders: tuple[TraceDecoder, ...]
    scorers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.models or not self.decoders:
            raise ValueError("a reading needs a model and a decoder")
        if TraceDecoder.LIKELIHOOD in self.decoders and not self.scorers:
            raise ValueError("a reading with the likelihood decoder needs a scorer")

    @property
    def tests(self) -> int:
        """Tests of this reading per candidate set and key version."""
        counting = 1 if TraceDecoder.COUNTING in self.decoders else 0
        likelihood = len(self.scorers) if TraceDecoder.LIKELIHOOD in self.decoders else 0
        return counting + likelihood


@dataclass(frozen=True)
class FanoutPlan:
    """The tests a trace may run: candidate sets × key versions (of every length) × the readings'
    tests (a counting test per tokenization, a likelihood test per model)."""

    candidate_sets: tuple[CandidateSet, ...]
    decoders: tuple[TraceDecoder, ...]
    # None: one reading, by the model "" (a plan of a single model's text, as evaluations build)
    readings: tuple[ReadingPlan, ...] | None = None
    # the users of the content search's leads, best first (the registry-wide namings' identity check)
    leads: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.candidate_sets or not self.decoders:
            raise ValueError("a plan needs at least one candidate set and one decoder")
        if self.readings is not None and not self.readings:
            raise ValueError("a plan needs at least one reading")
        counts = {self._versions(c) for c in self.candidate_sets}
        if len(counts) != 1 or 0 in counts:
            raise ValueError("every candidate set must read the same, non-empty, key versions")

    @staticmethod
    def _versions(candidates: CandidateSet) -> int:
        return sum(len(group.versions) for group in candidates.groups)

    @property
    def key_versions(self) -> int:
        return self._versions(self.candidate_sets[0])

    @property
    def reading_plans(self) -> tuple[ReadingPlan, ...]:
        if self.readings is not None:
            return self.readings
        scorers = ("",) if TraceDecoder.LIKELIHOOD in self.decoders else ()
        return (ReadingPlan(("",), self.decoders, scorers),)

    @property
    def copy_holder(self) -> int | None:
        """The retrieved set's copy holder (see the module's docstring), if any."""
        return next((c.copy_holder for c in self.candidate_sets if c.copy_holder is not None), None)

    @property
    def tries(self) -> int:
        """The number of tests, the factor every p-value of the trace is multiplied by."""
        return len(self.candidate_sets) * self.key_versions * sum(r.tests for r in self.reading_plans)


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
    """How the text is read, the same for every test."""

    ids: list[int]
    tokenizer: PreTrainedTokenizerBase
    alpha: float
    temperature: float
    edit_rate: float = DEFAULT_EDIT_RATE
    include_tokens: bool = False
    # with a level, only the likelihood decoder names (after its identity test); counting's
    # verdict still counts
    identity_level: float | None = None


Runner = Callable[[Callable[[], T]], Awaitable[T]]


async def on_thread(work: Callable[[], T]) -> T:
    """Run ``work`` on a worker thread (a ``Runner``)."""
    return await asyncio.to_thread(work)


ScoreSource = Callable[[], Awaitable[ModelScores | None]]


class TraceFanout:
    """Runs a plan's tests in order until one names someone."""

    def __init__(self, plan: FanoutPlan, reading: TextReading | Sequence[TextReading]) -> None:
        self.plan = plan
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
            alpha=r.alpha,
            include_tokens=r.include_tokens,
            tries=self.plan.tries,
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
            alpha=r.alpha,
            temperature=r.temperature,
            edit_rate=r.edit_rate,
            counting=counting,
            include_tokens=r.include_tokens,
            tries=self.plan.tries,
            identity_level=r.identity_level,
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
        # with an identity level, counting gives its verdict but never the name
        counting_names = self.reading.identity_level is None
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
                if not lead_identity_stands(outcome):  # (the holder is a lead: never here)
                    withdrawn.append(named)
                    return False
                return True
            user = outcome.attributed_user_id
            if user is None:
                return False
            if plan.copy_holder is not None:  # the gateway served this text to that user: no one else
                return user == plan.copy_holder
            ranked = registry.get((model, decoder))
            if ranked is not None and _ranks_first(ranked, user):
                return True
            refused.append(user)
            return False

        def done(outcome: TraceOutcome, scope: CandidateScope | None, model: str) -> FanoutOutcome:
            return FanoutOutcome(outcome, scope, plan.tries, model, _first(withdrawn), _first(refused))

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
    """Whether ``outcome`` (a test over the whole registry) ranks ``user_id`` first, confidently."""
    candidates = outcome.report.candidates
    return (
        user_id is not None
        and bool(candidates)
        and party_key(candidates[0].user_id, None if candidates[0].end_user is None else candidates[0].end_user.id)
        == user_id
        and outcome.confidence >= DEFAULT_MIN_CONFIDENCE
    )


def lead_identity_stands(outcome: TraceOutcome) -> bool:
    """Whether a registry-wide naming survives the leads' identity test (see the module's
    docstring): not run (the named user is a lead, no lead holds an ID of that length, or the
    decoder has none), or every lead rejected at ``LEAD_IDENTITY_LEVEL``."""
    p = outcome.lead_identity_p
    return p is None or p <= LEAD_IDENTITY_LEVEL


def _first(users: Sequence[int]) -> int | None:
    return users[0] if users else None


def _unnamed(outcome: TraceOutcome) -> TraceOutcome:
    """``outcome`` with its naming withdrawn (the report keeps its candidates)."""
    report = outcome.report.model_copy(update={"attribution": None})
    return TraceOutcome(report, outcome.key_version_id, None, strength=outcome.strength)


def decoders_for(requested: TraceDecoder, *, scorer_available: bool) -> tuple[TraceDecoder, ...]:
    """The decoders a request may run: ``auto`` runs the likelihood decoder too when a scorer can
    read the text (then both count as tests)."""
    if requested == TraceDecoder.COUNTING:
        return (TraceDecoder.COUNTING,)
    if requested == TraceDecoder.LIKELIHOOD:
        return (TraceDecoder.LIKELIHOOD,)
    if scorer_available:
        return (TraceDecoder.COUNTING, TraceDecoder.LIKELIHOOD)
    return (TraceDecoder.COUNTING,)


def lead_shares(count: int, top_share: float | None = TOP_LEAD_SHARE) -> list[float]:
    """Each of ``count`` leads' share of the level, best first: ``top_share`` for the first, equal
    parts of the rest for the others (one lead: all of it; ``top_share`` None: equal shares)."""
    if count <= 1 or top_share is None:
        return [1.0 / count] * count if count else []
    if not 0.0 < top_share < 1.0:
        raise ValueError(f"top_share must be in (0, 1) (got {top_share})")
    return [top_share] + [(1.0 - top_share) / (count - 1)] * (count - 1)


def plan_for(
    registry: Sequence[LengthGroup],
    retrieved: Retrieved | Sequence[int],
    decoders: tuple[TraceDecoder, ...],
    readings: tuple[ReadingPlan, ...] | None = None,
    *,
    top_lead_share: float | None = TOP_LEAD_SHARE,
) -> FanoutPlan:
    """The registry, and the retrieved users when a content search found any that hold a message
    ID of a length the registry reads. The retrieved set reads every key version the registry
    reads (a length where no lead holds an ID has no candidate there), so the count is the same.
    Within each length, the retrieved set's first lead (the content search's best) has
    ``top_lead_share`` of the level and the others equal parts of the rest (``lead_shares``;
    None: equal shares, the plain Bonferroni correction for the set's size).
    ``retrieved``: the search's result (or just its users: no copy holder).
    ``readings``: the text's readings by the served models (None: one, by one model)."""
    if not isinstance(retrieved, Retrieved):
        retrieved = Retrieved(tuple(retrieved))
    sets = [CandidateSet(CandidateScope.REGISTRY, tuple(registry))]
    if retrieved.users:
        holder = retrieved.copy_holder if retrieved.copy_holder in retrieved.users else None
        # with a copy holder only the holder may be named, so the holder alone is tested: its p-value
        # pays for one user, not every lead (the content search chose the holder: the plan is fixed)
        users = [holder] if holder is not None else list(retrieved.users)
        groups = tuple(LengthGroup(g.versions, _shared(g.snapshot.restricted(users), top_lead_share)) for g in registry)
        if any(len(g.snapshot) for g in groups):
            sets.append(CandidateSet(CandidateScope.RETRIEVED, groups, holder))
    return FanoutPlan(tuple(sets), decoders, readings, tuple(retrieved.users))


def _shared(snapshot: RegistrySnapshot, top_share: float | None) -> RegistrySnapshot:
    """``snapshot`` (the leads holding an ID of one length, best first) with each lead's share."""
    if len(snapshot) <= 1 or top_share is None:
        return snapshot
    return dataclasses.replace(
        snapshot, candidates=snapshot.candidates.with_shares(lead_shares(len(snapshot), top_share))
    )
