"""/trace request and report."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from service.schemas.text import Text
from service.vocabulary import TraceDecoder


class TraceRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: Text = Field(min_length=1)
    model: Text | None = Field(default=None, max_length=200)
    include_tokens: bool = False
    # auto: counting first, the likelihood decoder when counting names nobody (see docs/api.md)
    decoder: TraceDecoder = TraceDecoder.AUTO


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


class AttributionReport(BaseModel):
    user_id: int
    name: str
    confidence: float
    p_value: float


class CandidateReport(BaseModel):
    user_id: int
    name: str
    score: float
    p_value: float
    hamming: int


class TokenReport(BaseModel):
    """One token of the text: its text, id, block index (None = not scored) and shard per key;
    ``llr``: with the likelihood decoder, its evidence (nats) for the named or best candidate."""

    text: str
    id: int
    block: int | None
    shards: list[int] | None
    llr: float | None = None


class TraceReport(BaseModel):
    decoder: TraceDecoder = TraceDecoder.COUNTING  # the decoder that decided
    test: str = ""  # the test behind p_value
    temperature: float | None = None  # the likelihood decoder's assumed sampling temperature
    confidence: float = 0.0  # posterior of the best candidate among the registry
    margin: float | None = None  # score of the best candidate minus the runner-up's
    watermarked: bool
    p_value: float
    statistic: float
    scored_tokens: int
    key_version: str | None
    decoded_message: str
    blocks: list[BlockReport]
    attribution: AttributionReport | None
    candidates: list[CandidateReport]
    tokens: list[TokenReport] | None = None
