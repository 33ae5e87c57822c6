"""/trace request and report."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from service.schemas.common import Page
from service.schemas.text import Text
from service.vocabulary import TraceDecoder, TraceVerdict


class TraceRequest(BaseModel):
    # any other field is refused by name (TracingService.trace), never dropped
    model_config = ConfigDict(extra="allow")

    text: Text = Field(min_length=1)
    model: Text | None = Field(default=None, max_length=200)
    include_tokens: bool = False
    # auto: counting first, the likelihood decoder when counting names nobody (see docs/api.md)
    decoder: TraceDecoder = TraceDecoder.AUTO
    # name a user only if the identity test rejects every other registered user at this level
    # (the likelihood decoder decides any name); stricter than the gateway's own level, if it has one
    identity_level: float | None = Field(default=None, gt=0.0, lt=1.0)


class BlockReport(BaseModel):
    """One message block: cTMM counts per shard, the decoded value (None when erased), evidence."""

    index: int
    counts: list[int]
    value: int | None
    margin: int
    confidence: float
    erased: bool
    # the likelihood decoder's score of each block value (nats), when it read the text
    scores: list[float] | None = None


class EndUserRef(BaseModel):
    """An account's end user a text is attributed to: its id and the identifier as the platform
    sent it (shown to admins and auditors only)."""

    id: int
    identifier: str


class AttributionReport(BaseModel):
    user_id: int  # the account (the API key's owner)
    name: str
    confidence: float
    p_value: float
    # the account's end user whose message ID the text carries (None: the account's own)
    end_user: EndUserRef | None = None


class CandidateReport(BaseModel):
    user_id: int  # the account
    name: str
    score: float
    p_value: float
    hamming: int
    end_user: EndUserRef | None = None  # the account's end user holding this ID (None: the account)


class TokenReport(BaseModel):
    """One token of the text: its text, id, block index (None = not scored) and shard per key;
    ``llr``: with the likelihood decoder, its evidence (nats) for the named or best candidate."""

    text: str
    id: int
    block: int | None
    shards: list[int] | None
    llr: float | None = None
    # the token's evidence for the named or best candidate (None: not scored, or no candidate)
    evidence: Literal["supports", "contradicts"] | None = None


class CorroborationMatch(BaseModel):
    """A logged completion the text resembles: auditor-visible metadata only, never its text."""

    user_id: int
    request_id: str
    created_at: str = Field(description="UTC, ISO 8601 with microseconds")
    similarity: float = Field(description="share of the text's content the completion holds, or the reverse (0-1)")
    # the account's end user it was generated for; absent for the account's own completions (and
    # from reports signed before end users), so their signed bytes are served unchanged
    end_user_id: int | None = None

    # no return annotation: pydantic would publish it (a bare object) as the schema in OpenAPI
    @model_serializer(mode="wrap")
    def _without_absent_fields(self, handler: SerializerFunctionWrapHandler):
        return _drop_absent(handler(self), self, ("end_user_id",))


class Corroboration(BaseModel):
    """The second witness: what the generation log holds that resembles the text.

    ``corroborated``: the named user's log holds a generation at least as similar as the gateway's
    match threshold, and no other user's is closer. ``not_found``: it does not (a naming then rests
    on the watermark only: a possible forgery, or a generation older than the sketches' retention;
    the ``note`` says when another user's logged generation matches the text instead),
    or nobody was named and nothing in the log resembles the text. ``leads``: nobody was named, but logged completions
    resemble the text (leads for an investigation, never a naming). ``disabled``: the gateway keeps
    no sketches (``XMARK_PROVENANCE=off``)."""

    status: Literal["corroborated", "not_found", "leads", "disabled"]
    matches: list[CorroborationMatch] = Field(default_factory=list)
    note: str | None = None


class TraceReport(BaseModel):
    # the signed report of this trace (GET /trace/{report_id}); None only from `xmark trace`
    report_id: str | None = None
    decoder: TraceDecoder = TraceDecoder.COUNTING  # the decoder that decided
    test: str = ""  # the test behind p_value
    temperature: float | None = None  # the likelihood decoder's assumed sampling temperature
    edit_rate: float | None = None  # the likelihood decoder's assumed share of edited tokens
    confidence: float = 0.0  # posterior of the best candidate among the registry
    margin: float | None = None  # score of the best candidate minus the runner-up's
    watermarked: bool
    p_value: float
    statistic: float
    scored_tokens: int
    key_version: str | None
    # the scheme of the key version's encoder whose reading decided ("gumbel": the distortion-free
    # encoder, "xmark": the biasing one; a per-request version is read under both)
    encoder: str | None = None
    # a biasing encoder's reading (either decoder): the paper's standard-deviation statistic (its
    # false-positive check: the mean of the cTMM rows' standard deviations) beside the calibrated
    # p_value; None for the distortion-free encoder's
    sigma: float | None = None
    decoded_message: str
    blocks: list[BlockReport]
    attribution: AttributionReport | None
    candidates: list[CandidateReport]
    tokens: list[TokenReport] | None = None
    # the identity test's level in force (None: not asked for) and its p-value for the best
    # candidate (None: not run, e.g. when the text shows no watermark or no one explains it)
    identity_level: float | None = None
    identity_p_value: float | None = None
    # which evidence named the user: the registry-wide watermark test ("watermark"), or the
    # watermark test of the users a content search of the generation log led to
    # ("watermark+retrieval"); None when nobody is named
    named_by: Literal["watermark", "watermark+retrieval"] | None = None
    corroboration: Corroboration | None = None
    # the served model the evidence points to: the model whose reading of the text decided (for a
    # counting test, the first of the models that share that tokenizer); None without a watermark
    model: str | None = None


class ReportParams(BaseModel):
    """The watermark parameters of the key version a verdict used."""

    b: int = Field(description="message bits")
    d: int = Field(description="bits per message block")
    k: int = Field(description="hash keys")
    delta: float = Field(description="logit bias of the boosted tokens")
    scheme: str
    # the entropy rule's threshold (nats); present only for key versions that encode with it, so
    # reports signed under other key versions are served unchanged
    min_entropy: float | None = Field(
        default=None, description="entropy rule: positions below this min-entropy (nats) were not biased"
    )
    # scheme gumbel's salts; present only for salted key versions (as min_entropy)
    salts: int | None = Field(default=None, description="salts the answers drew from (p-values count each)")

    # no return annotation: pydantic would publish it (a bare object) as the schema in OpenAPI
    @model_serializer(mode="wrap")
    def _without_absent_fields(self, handler: SerializerFunctionWrapHandler):
        return _drop_absent(handler(self), self, ("min_entropy", "salts"))


class DecoderSettings(BaseModel):
    """How the text was read: the decoder requested, the likelihood decoder's settings when it
    decided (else null), the significance level and the test behind the p-value."""

    decoder: TraceDecoder
    temperature: float | None
    top_k: int | None
    alpha: float
    test: str
    # absent from reports signed before the likelihood decoder read edits; kept absent there so
    # their signed bytes are served unchanged
    edit_rate: float | None = None
    # the identity test's level; present only in reports of traces that asked for it
    identity_level: float | None = None

    # no return annotation: pydantic would publish it (a bare object) as the schema in OpenAPI
    @model_serializer(mode="wrap")
    def _without_absent_fields(self, handler: SerializerFunctionWrapHandler):
        return _drop_absent(handler(self), self, ("edit_rate", "identity_level"))


def _drop_absent(data: dict[str, object], model: BaseModel, names: tuple[str, ...]) -> dict[str, object]:
    """``data`` without the null fields of ``names`` the signed payload did not hold."""
    for name in names:
        if data.get(name) is None and name not in model.model_fields_set:
            data.pop(name, None)
    return data


class SignedReport(BaseModel):
    """The fields a report's signature covers (all null fields included)."""

    report_id: str
    created_at: str = Field(description="UTC, ISO 8601 with microseconds")
    requester_id: int
    text_sha256: str | None = Field(description="hex SHA-256 of the text's UTF-8 bytes")
    scored_tokens: int
    key_version: str | None
    key_version_fingerprint: str | None
    params: ReportParams | None
    decoder: TraceDecoder = Field(description="the decoder that decided")
    decoder_settings: DecoderSettings | None
    gateway_version: str | None
    verdict: TraceVerdict
    p_value: float
    statistic: float
    attributed_user_id: int | None
    attributed_user_name: str | None
    # the account's end user the text is attributed to; present only where one is named
    attributed_end_user: EndUserRef | None = None
    # the identity test's p-value for the best candidate; present only where the test ran
    identity_p_value: float | None = None
    # absent from reports signed before the generation log was a witness
    named_by: str | None = None
    corroboration: Corroboration | None = None
    # absent from reports signed before the gateway served several models
    model: str | None = None

    # no return annotation: pydantic would publish it (a bare object) as the schema in OpenAPI
    @model_serializer(mode="wrap")
    def _without_absent_fields(self, handler: SerializerFunctionWrapHandler):
        return _drop_absent(
            handler(self), self, ("attributed_end_user", "identity_p_value", "named_by", "corroboration", "model")
        )


class ReportSignature(BaseModel):
    alg: Literal["Ed25519"] = "Ed25519"
    key_id: str = Field(description="short fingerprint of the public key (GET /.well-known/xmark-report-key)")
    value: str = Field(description="base64 Ed25519 signature of the report's canonical JSON")


class TraceReportDocument(BaseModel):
    """GET /trace/{report_id}. ``signature`` is null for traces recorded before reports were signed."""

    object: Literal["trace.report"] = "trace.report"
    report: SignedReport
    signature: ReportSignature | None


class ReportKey(BaseModel):
    """GET /.well-known/xmark-report-key: the public key that verifies trace reports."""

    alg: Literal["Ed25519"] = "Ed25519"
    key_id: str
    public_key: str = Field(description="base64 of the raw 32-byte Ed25519 public key")


class TraceLogEntry(BaseModel):
    report_id: str
    created_at: datetime
    requester_id: int
    requester_name: str
    verdict: TraceVerdict
    decoder: TraceDecoder
    p_value: float
    scored_tokens: int
    key_version: str | None
    attributed_user_id: int | None
    attributed_user_name: str | None
    attributed_end_user_id: int | None = None


class TraceLogPage(Page[TraceLogEntry]):
    pass
