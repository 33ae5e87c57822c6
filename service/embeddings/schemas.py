"""``POST /v1/embeddings``: the request and response bodies (OpenAI's)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

# what OpenAI's API accepts as ``input``; the gateway takes the texts and refuses token ids by name
# (the service checks the value, so every refusal is a 400 naming ``input``)
_INPUT_SCHEMA = {
    "anyOf": [
        {"type": "string", "title": "one text"},
        {"type": "array", "items": {"type": "string"}, "title": "several texts"},
        {"type": "array", "items": {"type": "integer"}, "title": "token ids (refused)"},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}, "title": "token ids (refused)"},
    ],
    "description": "A text or a list of texts to embed (each non-empty). Token-id arrays are refused.",
}

# the request fields of OpenAI's embeddings API; anything else is refused by name
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request. Unknown fields are kept to be refused by name (400)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(description="An embedding model's name or alias (GET /v1/models)")
    input: Annotated[Any, WithJsonSchema(_INPUT_SCHEMA)]
    encoding_format: Literal["float", "base64"] = Field(
        default="float",
        description="float: lists of numbers; base64: each vector's little-endian float32 bytes, base64-encoded "
        "(what the official openai client asks for by default)",
    )
    dimensions: int | None = Field(
        default=None, ge=1, description="Only the model's own length, or on vLLM workers what their model honours"
    )
    user: str | None = Field(default=None, description="Accepted for compatibility; no effect")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="The vector: numbers, or base64 (encoding_format)")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
