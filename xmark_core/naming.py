"""The naming rule every decoder applies, written once.

A decoder ranks the registered messages against a text and names the best one only when all of
these hold, in this order:

1. **evidence**: its p-value, corrected for the candidates and the other tests run on the text, is
   below ``alpha`` (the text is unlikely to be unwatermarked, or written for someone else);
2. **margin**: its log-likelihood ratio exceeds the runner-up's (an exact tie names nobody; a lone
   candidate's margin is its own ratio, which must be positive unless ``lone_candidate_margin`` is
   off: then a lone candidate's p-value alone decides);
3. **confidence**: its posterior among all candidates is at least ``min_confidence`` (in a dense
   registry neighbouring IDs differ in a block or two, and a short text can fit a neighbour almost
   as well as its author);
4. **identity** (where the decoder runs one): its identity test against every other candidate is
   at most the identity level, so that a wrong registered user is named with probability at most
   that level.

:class:`NamingRule` holds the levels and checks them; the decoders (``attribute``,
``attribute_likelihood``, ``attribute_gumbel_likelihood``) compute the statistics and ask it.

Rule 1's correction is :class:`Multiplicity`'s: one object carries every factor a p-value of the
text is multiplied by (the other tests run on the text, the candidate set's size or the candidate's
share of the level, the salts a distortion-free reading chose among), and each decoder applies it
once (``detect`` and the three decoders above call :meth:`Multiplicity.naming_factors` or
:meth:`Multiplicity.detection_factor`, nothing else multiplies a p-value).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import ArgumentError, ArgumentTypeError, ParamsError

if TYPE_CHECKING:
    from .attribution import CandidateSet
    from .params import WatermarkParams

# the level of every test unless a caller sets it (``detect``, the decoders, ``NamingRule``)
DEFAULT_ALPHA = 1e-3

# the posterior the best candidate needs among all candidates (rule 3)
DEFAULT_MIN_CONFIDENCE = 0.99


@dataclass(frozen=True)
class NamingRule:
    """The levels of the naming rule; ``identity_level`` None: the identity test runs only where
    the decoder always runs it (the ``gumbel`` scheme's, at ``alpha``)."""

    alpha: float = DEFAULT_ALPHA
    min_confidence: float = DEFAULT_MIN_CONFIDENCE
    identity_level: float | None = None
    lone_candidate_margin: bool = True

    def __post_init__(self) -> None:
        if self.identity_level is not None and not 0.0 < self.identity_level < 1.0:
            raise ArgumentError(f"identity_level must be in (0, 1) (got {self.identity_level})")
        if not 0.0 < self.alpha < 1.0:
            raise ArgumentError(f"alpha must be in (0, 1) (got {self.alpha})")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ArgumentError(f"min_confidence must be in [0, 1] (got {self.min_confidence})")

    def evidence_names(self, p_value: float, margin: float, confidence: float, *, lone: bool = False) -> bool:
        """Rules 1-3: the best candidate may be named, pending the identity test (``lone``: it is
        the only candidate)."""
        margin_holds = margin > 0 or (lone and not self.lone_candidate_margin)
        return p_value < self.alpha and margin_holds and confidence >= self.min_confidence

    def identity_bound(self, *, always: bool) -> float | None:
        """Rule 4's level: ``identity_level``; where the decoder always runs its identity test
        (``always``), ``alpha`` or ``identity_level`` where that is stricter. None: no test."""
        if not always:
            return self.identity_level
        return self.alpha if self.identity_level is None else min(self.alpha, self.identity_level)


@dataclass(frozen=True)
class Multiplicity:
    """Every test a p-value of one text is one of, the whole correction (Bonferroni) in one object.

    The tests a trace runs on the text (fixed before any of them reads the watermark):
    ``candidate_sets`` (the whole registry; the candidates a content search chose) x the key
    readings (``encoders``: one entry per key version, the encoders it is read under) x
    ``reading_tests`` (the decoders' tests of one key reading: a counting test per tokenization, a
    likelihood test per scoring model). Two more factors belong to the reading and the candidates
    and are applied with these: the salts a distortion-free reading chose among (``params.salts``)
    and the candidate set's size, or one over a candidate's share of the level
    (``CandidateSet.multiplicity``). The default: one test (a single decoder's own call)."""

    candidate_sets: int = 1
    encoders: tuple[int, ...] = (1,)
    reading_tests: int = 1

    def __post_init__(self) -> None:
        counts = (self.candidate_sets, self.reading_tests, *self.encoders)
        if not self.encoders or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
            raise ArgumentError("candidate_sets, reading_tests and every key version's encoders must be integers >= 1")

    @classmethod
    def of_tries(cls, tries: int) -> Multiplicity:
        """``tries`` tests of the text, whatever they are (one factor, no breakdown)."""
        return cls(reading_tests=tries)

    @property
    def key_readings(self) -> int:
        """The key versions times the encoders each is read under."""
        return sum(self.encoders)

    @property
    def tries(self) -> int:
        """The tests run on the text: candidate sets x key readings x each reading's tests."""
        return self.candidate_sets * self.key_readings * self.reading_tests

    def salt_factor(self, params: WatermarkParams) -> float:
        """The salts a reading under ``params`` chose among (1 for the biasing schemes)."""
        return float(params.salts)

    def candidate_factors(self, candidates: CandidateSet, order: np.ndarray | Sequence[int]) -> np.ndarray:
        """[len(order)]: the candidate set's size, or one over each ranked candidate's share."""
        return candidates.multiplicity(order)

    def detection_factor(self, params: WatermarkParams) -> float:
        """The factor of a detection p-value (no candidate chosen): tries x salts."""
        return float(self.tries) * self.salt_factor(params)

    def naming_factors(
        self, candidates: CandidateSet, order: np.ndarray | Sequence[int], params: WatermarkParams
    ) -> np.ndarray:
        """[len(order)]: the factor of each ranked candidate's p-value: tries x salts x the
        candidate set's size or the candidate's share."""
        return self.candidate_factors(candidates, order) * self.detection_factor(params)

    def check_readings(self, versions: int) -> None:
        """A trace that reads ``versions`` key readings of one length must count at least those."""
        if self.tries < versions:
            raise ParamsError(f"the multiplicity ({self.tries} tests) is less than the {versions} key readings read")


def corrected(raw: np.ndarray, factors: np.ndarray) -> np.ndarray:
    """The p-values ``raw`` times their ``factors``, capped at 1."""
    out: np.ndarray = np.minimum(1.0, np.asarray(raw, dtype=np.float64) * factors)
    return out


def rule_of(rule: NamingRule | None, alpha: float, min_confidence: float, identity_level: float | None) -> NamingRule:
    """A decoder's rule: ``rule``, or one of the levels given as arguments (not both)."""
    if rule is None:
        return NamingRule(alpha, min_confidence, identity_level)
    if (alpha, min_confidence, identity_level) != (DEFAULT_ALPHA, DEFAULT_MIN_CONFIDENCE, None):
        raise ArgumentError("give the naming levels in rule or as arguments, not both")
    return rule


def check_ranking(top: int, multiplicity: Multiplicity | None) -> Multiplicity:
    """The arguments every decoder's ranking takes: the candidates reported and the tests run
    (None: the decoder's own test alone)."""
    if top < 1:
        raise ArgumentError("top must be >= 1")
    if multiplicity is None:
        return Multiplicity()
    if not isinstance(multiplicity, Multiplicity):
        raise ArgumentTypeError(f"multiplicity must be a Multiplicity (got {type(multiplicity).__name__})")
    return multiplicity
