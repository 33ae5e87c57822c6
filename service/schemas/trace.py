"""/trace request and report."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TraceRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str = Field(min_length=1)
    model: str | None = Field(default=None, max_length=200)
    include_tokens: bool = False


class BlockReport(BaseModel):
    """One message block: cTMM counts per shard, the decoded value (None when erased), evidence."""

    index: int
    counts: list[int]
    value: int | None
    margin: int
    confidence: float
    erased: bool


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
    """One token of the text: its text, id, block index (None = not scored) and shard per key."""

    text: str
    id: int
    block: int | None
    shards: list[int] | None


class TraceReport(BaseModel):
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
