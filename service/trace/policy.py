"""Who /trace names: every naming rule, in the order a trace applies it, and every threshold in one
frozen object that the settings fill.

A trace names a registered user only when each rule below lets it; a rule either withdraws a
naming or narrows the candidates, never adds one, so the multiplicity the fan-out counts
(``plan.FanoutPlan.multiplicity``) stays valid whatever the rules decide. The HTTP route, ``xmark trace``
and every evaluation trace with a :class:`TracePolicy` (``TracePolicy.from_settings`` for the
product); a variant an evaluation measures is a field of the policy, never a patch of the code.

:data:`RULES` lists the rules with their thresholds, settings and reasons; docs/service.md's table
of the naming policy is :func:`policy_table` and a test keeps the two equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from service.config import Settings
from xmark_core import DEFAULT_MIN_CONFIDENCE, NamingRule

if TYPE_CHECKING:
    from service.provenance.retrieval import Lead


def _setting(name: str) -> Any:
    """A configurable threshold's default: the setting's own (one source for both)."""
    return Settings.model_fields[name].default


@dataclass(frozen=True)
class CopyBar:
    """What makes a lead a copy of the text: its term similarity and its shingle similarity."""

    similarity: float
    shingles: float

    def holds(self, lead: Lead) -> bool:
        return lead.similarity >= self.similarity and lead.shingle_similarity >= self.shingles


@dataclass(frozen=True)
class TracePolicy:
    """Every threshold of a trace. The defaults are the product's; ``from_settings`` reads the
    configurable ones (``XMARK_TRACE_*``, ``XMARK_PROVENANCE_*``)."""

    # rule 1, evidence: a corrected p-value below this names (XMARK_TRACE_ALPHA)
    alpha: float = _setting("trace_alpha")
    # rule 2, margin: a lone candidate's log-likelihood ratio must be positive (False: its p-value
    # alone decides; the provenance ceiling's variant, not the product's)
    lone_candidate_margin: bool = True
    # rule 3, confidence: the best candidate's posterior among the candidates it is named from
    min_confidence: float = DEFAULT_MIN_CONFIDENCE
    # rule 4, identity: the identity test's level (XMARK_TRACE_IDENTITY_LEVEL; None: only the
    # ``gumbel`` scheme's own test, at alpha); a request may make it stricter, never looser
    identity_level: float | None = None
    # rule 5, leads: the logged completions at least this similar lead to their users, at most
    # ``max_leads`` of them, best first (XMARK_PROVENANCE_LEAD_SIMILARITY, XMARK_PROVENANCE_LEADS)
    lead_similarity: float = _setting("provenance_lead_similarity")
    max_leads: int = _setting("provenance_leads")
    # rule 6, lead shares: the best lead's share of the retrieved set's level; the others share the
    # rest (None: equal shares, the plain correction for the set's size)
    top_lead_share: float | None = 0.5
    # rule 7, copy holder: the one user whose log holds a near-copy (else an edited copy) of the text.
    # A near-copy: a logged completion that holds at least this share of the suspect text's content
    # (``similarity``) and whose word 3-gram shingles agree with the text's in at least this share of
    # the MinHash positions (an estimate of their Jaccard similarity; 32 of 128). The first half of a
    # logged answer scores about 1.0 and 0.5. Answers to one prompt share topic but little wording
    # (four answers at temperature 0.7: 4-gram Jaccard 0.065, docs/results/QUALITY.md), and the model's
    # own rewrites keep a median 6-19 % of the original's 3-grams (docs/results/PROVENANCE.md).
    # An edited copy, looked for only when no user's log holds a near-copy: the completion with a fifth
    near_copy: CopyBar = CopyBar(0.9, 0.25)
    # of its tokens replaced scores about 0.75 and 0.28 (median; 10th percentile 0.2), a rewrite that
    # keeps a third of the 3-grams about 0.8 and 0.2-0.4. In the provenance evaluation's log (10^5
    # generations, other users answering the same prompts) the best other-user lead of its 400 model
    # rewrites with at least 0.6 of the content reached 0.14 (one of 400 above 0.125). Near-copies come
    # first so that a same-prompt answer close enough to be an edited copy never hides the user whose
    # log holds the text itself.
    edited_copy: CopyBar = CopyBar(0.6, 0.15)
    # corroboration (reported, never naming): the named user's logged completion at least this like
    # the text, and none of another user's closer (XMARK_PROVENANCE_MATCH_SIMILARITY)
    match_similarity: float = _setting("provenance_match_similarity")
    # rule 10, lead identity: a registry-wide naming of a user whose log holds nothing like the text
    # stands only if its identity test rejects every lead at this level
    lead_identity_level: float = 0.01
    # how the likelihood decoder reads a text (XMARK_TRACE_TEMPERATURE, XMARK_TRACE_EDIT_RATE,
    # XMARK_TRACE_TOP_K, XMARK_TRACE_LIKELIHOOD_MAX_TOKENS)
    temperature: float = _setting("trace_temperature")
    edit_rate: float = _setting("trace_edit_rate")
    top_k: int = _setting("trace_top_k")
    likelihood_max_tokens: int = _setting("trace_likelihood_max_tokens")

    def __post_init__(self) -> None:
        for name in ("alpha", "lead_identity_level", "top_lead_share"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value < 1.0:
                raise ValueError(f"{name} must be in (0, 1) (got {value})")
        if self.max_leads < 0:
            raise ValueError(f"max_leads must be >= 0 (got {self.max_leads})")
        self.naming_rule()  # its own checks (confidence, identity level)

    @classmethod
    def from_settings(cls, settings: Settings) -> TracePolicy:
        """The product's policy under ``settings``."""
        return cls(
            alpha=settings.trace_alpha,
            identity_level=settings.trace_identity_level,
            lead_similarity=settings.provenance_lead_similarity,
            max_leads=settings.provenance_leads,
            match_similarity=settings.provenance_match_similarity,
            temperature=settings.trace_temperature,
            edit_rate=settings.trace_edit_rate,
            top_k=settings.trace_top_k,
            likelihood_max_tokens=settings.trace_likelihood_max_tokens,
        )

    def with_identity_level(self, level: float | None) -> TracePolicy:
        return replace(self, identity_level=level)

    def naming_rule(self) -> NamingRule:
        """Rules 1-4, as every decoder of ``xmark_core`` applies them."""
        return NamingRule(
            alpha=self.alpha,
            min_confidence=self.min_confidence,
            identity_level=self.identity_level,
            lone_candidate_margin=self.lone_candidate_margin,
        )

    # rule 5
    def lead_users(self, leads: Sequence[Lead]) -> list[int]:
        """The distinct users of the leads at least ``lead_similarity``, best first, at most ``max_leads``."""
        users: list[int] = []
        for lead in leads:
            if lead.similarity >= self.lead_similarity and lead.holder not in users:
                users.append(lead.holder)
                if len(users) >= self.max_leads:
                    break
        return users

    # rule 6
    def lead_shares(self, count: int) -> list[float]:
        """Each of ``count`` leads' share of the retrieved set's level, best first: ``top_lead_share``
        for the first, equal parts of the rest for the others (one lead: all of it; None: equal shares)."""
        if count <= 1 or self.top_lead_share is None:
            return [1.0 / count] * count if count else []
        rest = (1.0 - self.top_lead_share) / (count - 1)
        return [self.top_lead_share] + [rest] * (count - 1)

    # rule 7
    def copy_holder(self, leads: Iterable[Lead]) -> int | None:
        """The one user whose leads include a near-copy of the text or, when no lead is one, an
        edited copy; None when no lead is either, or when two users' leads are."""
        leads = list(leads)
        for bar in (self.near_copy, self.edited_copy):
            holders = {lead.holder for lead in leads if bar.holds(lead)}
            if holders:
                return next(iter(holders)) if len(holders) == 1 else None
        return None

    # rule 8
    def registry_backs(self, ranked_first: bool, confidence: float) -> bool:
        """Whether the whole registry's test backs a naming in the retrieved set: it ranks the same
        user first with the confidence a naming needs."""
        return ranked_first and confidence >= self.min_confidence

    # rule 10
    def lead_identity_stands(self, p_value: float | None) -> bool:
        """Whether a registry-wide naming of a user outside the leads stands: no lead to test
        (None), or every lead rejected at ``lead_identity_level``."""
        return p_value is None or p_value <= self.lead_identity_level


@dataclass(frozen=True)
class Rule:
    """One row of the naming policy."""

    order: int
    name: str
    rule: str
    thresholds: tuple[str, ...]  # TracePolicy fields
    setting: str
    why: str


RULES: tuple[Rule, ...] = (
    Rule(1, "evidence", "the best candidate's p-value, corrected for every test of the trace, is below alpha",
         ("alpha",), "XMARK_TRACE_ALPHA",
         "a text nobody watermarked, or written for someone else, names anyone with probability at most alpha"),
    Rule(2, "margin", "the best candidate's log-likelihood ratio exceeds the runner-up's (a lone candidate's must "
         "be positive)", ("lone_candidate_margin",), "",
         "an exact tie names nobody"),
    Rule(3, "confidence", "the best candidate's posterior among the candidates is at least min_confidence",
         ("min_confidence",), "",
         "neighbouring IDs of a dense registry differ in a block or two; a short text can fit one almost as well"),
    Rule(4, "identity", "the identity test against every other candidate is at most identity_level",
         ("identity_level",), "XMARK_TRACE_IDENTITY_LEVEL",
         "bounds naming a wrong registered user at that level, whatever the model's calibration"),
    Rule(5, "leads", "the users of logged completions at least lead_similarity like the text, at most max_leads, "
         "form a second candidate set", ("lead_similarity", "max_leads"),
         "XMARK_PROVENANCE_LEAD_SIMILARITY, XMARK_PROVENANCE_LEADS",
         "a rewritten answer keeps its content: its author's log is found without the key"),
    Rule(6, "lead shares", "the best lead gets top_lead_share of the retrieved set's level, the others equal parts",
         ("top_lead_share",), "",
         "the author is the best lead of most rewrites: its p-value pays x2, not x(number of leads)"),
    Rule(7, "copy holder", "the one user whose log holds a near-copy (else an edited copy) of the text is the "
         "retrieved set alone", ("near_copy", "edited_copy"), "",
         "the gateway served this text to that user; nobody else is named"),
    Rule(8, "registry backs", "a retrieved naming (of anyone but the copy holder) stands only if the registry's test "
         "ranks that user first with min_confidence", ("min_confidence",), "",
         "a text carrying another user's watermark can make a lead whose ID shares blocks pass"),
    Rule(9, "holder only", "with a copy holder, no one else is named", (), "",
         "an edited text's watermark can fit a registry neighbour of the holder's ID"),
    Rule(10, "lead identity", "a registry-wide naming of a user outside the leads stands only if its identity test "
         "rejects every lead at lead_identity_level", ("lead_identity_level",), "",
         "an attacked answer can fit a neighbour of its author's ID better than the author's own"),
)  # fmt: skip


def policy_table(policy: TracePolicy | None = None) -> str:
    """The naming policy as the Markdown table of docs/service.md (the product's defaults)."""
    policy = policy or TracePolicy()
    values = {f.name: getattr(policy, f.name) for f in fields(policy)}

    def shown(name: str) -> str:
        value = values[name]
        if isinstance(value, CopyBar):
            return f"{name} {value.similarity:g}/{value.shingles:g}"
        if isinstance(value, float):
            return f"{name} {value:g}"
        return f"{name} {value}"

    lines = ["| # | rule | applies | threshold | setting | why |", "|---|---|---|---|---|---|"]
    for rule in RULES:
        thresholds = ", ".join(shown(n) for n in rule.thresholds) or "-"
        lines.append(
            f"| {rule.order} | {rule.name} | {rule.rule} | {thresholds} | {rule.setting or '-'} | {rule.why} |"
        )
    return "\n".join(lines) + "\n"
