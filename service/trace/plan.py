"""The fan-out's plan: the candidate sets, message lengths, key versions, readings, decoders and
models a trace may test, and its one multiplicity.

A trace may test one text many times: against each candidate set (the whole registry; the users a
content search of the generation log led to), under each key version of each message length, in
each reading of the text (one per tokenizer of the served models), with each decoder (counting,
once per tokenization; likelihood, once per served model, with that model's scorer). Each test's
p-value is exact on its own; naming the best of them is valid at ``alpha`` only if every p-value
is multiplied by the number of tests that *could* run, fixed before any of them looks at the
watermark: ``FanoutPlan.multiplicity`` (an ``xmark_core.Multiplicity``; the decoders apply it with
the factors of their own reading, the salts and the candidate set's size or shares). The plan is
chosen from what needs no watermark key (the request, the served models, whether their scorers are
at hand, the text's length, and the retrieved candidates, which a content search chose), so it is
the same whatever the watermark says. This module is the only place that counts;
``trace.analysis`` hands the count to the decoders, which apply it once each.

The retrieved set's shares of the level (``TracePolicy.lead_shares``) and the copy holder
(``TracePolicy.copy_holder``) are chosen by the content search, which reads no key, so they are
fixed with the plan too.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from service.provenance.retrieval import Retrieved
from service.services.registry_cache import RegistrySnapshot
from service.trace.analysis import LengthGroup
from service.trace.policy import TracePolicy
from service.vocabulary import TraceDecoder
from xmark_core import Multiplicity


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
    def multiplicity(self) -> Multiplicity:
        """The tests of the trace: candidate sets x key readings (each version's encoders) x the
        readings' tests, what every p-value of the trace is corrected for."""
        handles = [handle for group in self.candidate_sets[0].groups for handle in group.versions]
        encoders: dict[int, int] = {}
        for handle in handles:
            encoders[handle.id] = encoders.get(handle.id, 0) + 1
        return Multiplicity(
            candidate_sets=len(self.candidate_sets),
            encoders=tuple(encoders.values()),
            reading_tests=sum(r.tests for r in self.reading_plans),
        )

    @property
    def tries(self) -> int:
        """The number of tests (``multiplicity.tries``)."""
        return self.multiplicity.tries


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


def plan_for(
    registry: Sequence[LengthGroup],
    retrieved: Retrieved | Sequence[int],
    decoders: tuple[TraceDecoder, ...],
    readings: tuple[ReadingPlan, ...] | None = None,
    *,
    policy: TracePolicy | None = None,
) -> FanoutPlan:
    """The registry, and the retrieved users when a content search found any that hold a message
    ID of a length the registry reads. The retrieved set reads every key version the registry
    reads (a length where no lead holds an ID has no candidate there), so the count is the same.
    Within each length, the retrieved set's leads share the level as ``policy.lead_shares`` says
    (the product's policy when None).
    ``retrieved``: the search's result (or just its users: no copy holder).
    ``readings``: the text's readings by the served models (None: one, by one model)."""
    policy = policy or TracePolicy()
    if not isinstance(retrieved, Retrieved):
        retrieved = Retrieved(tuple(retrieved))
    sets = [CandidateSet(CandidateScope.REGISTRY, tuple(registry))]
    if retrieved.users:
        holder = retrieved.copy_holder if retrieved.copy_holder in retrieved.users else None
        # with a copy holder only the holder may be named, so the holder alone is tested: its p-value
        # pays for one user, not every lead (the content search chose the holder: the plan is fixed)
        users = [holder] if holder is not None else list(retrieved.users)
        groups = tuple(LengthGroup(g.versions, _shared(g.snapshot.restricted(users), policy)) for g in registry)
        if any(len(g.snapshot) for g in groups):
            sets.append(CandidateSet(CandidateScope.RETRIEVED, groups, holder))
    return FanoutPlan(tuple(sets), decoders, readings, tuple(retrieved.users))


def _shared(snapshot: RegistrySnapshot, policy: TracePolicy) -> RegistrySnapshot:
    """``snapshot`` (the leads holding an ID of one length, best first) with each lead's share."""
    if len(snapshot) <= 1 or policy.top_lead_share is None:
        return snapshot
    return dataclasses.replace(snapshot, candidates=snapshot.candidates.with_shares(policy.lead_shares(len(snapshot))))
