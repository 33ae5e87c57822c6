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
"""

from __future__ import annotations

from dataclasses import dataclass

from .detect import DEFAULT_ALPHA

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
            raise ValueError(f"identity_level must be in (0, 1) (got {self.identity_level})")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1) (got {self.alpha})")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1] (got {self.min_confidence})")

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


def rule_of(rule: NamingRule | None, alpha: float, min_confidence: float, identity_level: float | None) -> NamingRule:
    """A decoder's rule: ``rule``, or one of the levels given as arguments (not both)."""
    if rule is None:
        return NamingRule(alpha, min_confidence, identity_level)
    if (alpha, min_confidence, identity_level) != (DEFAULT_ALPHA, DEFAULT_MIN_CONFIDENCE, None):
        raise ValueError("give the naming levels in rule or as arguments, not both")
    return rule


def check_ranking(top: int, tries: int) -> None:
    """The arguments every decoder's ranking takes: the candidates reported and the tests run."""
    if top < 1 or tries < 1:
        raise ValueError("top and tries must be >= 1")
