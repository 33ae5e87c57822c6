"""ORM models (SQLAlchemy 2.0 typed declarative). The schema itself is owned by migrations/."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeEngine

from service.vocabulary import (
    AuditActorKind,
    EndUserSlot,
    EndUserStatus,
    KeyVersionStatus,
    Role,
    TraceDecoder,
    UserStatus,
)

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

USER_ROLES = tuple(role.value for role in Role)
USER_STATUSES = tuple(status.value for status in UserStatus)
END_USER_STATUSES = tuple(status.value for status in EndUserStatus)
END_USER_ROW_STATUSES = END_USER_STATUSES + tuple(slot.value for slot in EndUserSlot)
KEY_VERSION_STATUSES = tuple(status.value for status in KeyVersionStatus)
AUDIT_ACTOR_KINDS = tuple(kind.value for kind in AuditActorKind)


# Search structures the migrations keep outside the ORM, per dialect (0006): the SQLite postings
# table of the provenance sketches (kept by triggers) and the PostgreSQL GIN index on their terms.
MIGRATION_ONLY_OBJECTS = frozenset(
    {
        "provenance_postings",
        "ix_provenance_postings_generation_id",
        "ix_generations_sketch_terms",
        "ix_users_name_trgm",
        "ix_usage_daily_day_user_id",
    }
)


def include_object(obj: object, name: str | None, type_: str, reflected: bool, compare_to: object) -> bool:
    """Alembic's autogenerate filter: leave the migration-only search structures alone."""
    return name not in MIGRATION_ONLY_OBJECTS


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class IntArray(TypeDecorator[list[int]]):
    """A list of integers: int4[] on PostgreSQL, JSON text elsewhere (SQLite)."""

    impl = JSON(none_as_null=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.ARRAY(Integer()))
        return dialect.type_descriptor(JSON(none_as_null=True))  # None is SQL NULL, not JSON null

    def process_result_value(self, value: Any, dialect: Dialect) -> list[int] | None:
        if value is None or dialect.name == "postgresql":  # asyncpg gives a list of ints
            return value
        return [int(v) for v in value]


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class User(Base):
    __tablename__ = "users"
    __table_args__ = (
        CheckConstraint(_in("role", USER_ROLES), name="role"),
        CheckConstraint(_in("status", USER_STATUSES), name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default=UserStatus.ACTIVE.value, index=True)
    message_id: Mapped[str] = mapped_column(String(256), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow, index=True)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Admission limits of this user: NULL takes the gateway's default (Settings.user_*), 0 is unlimited.
    max_parallel_requests: Mapped[int | None] = mapped_column(Integer, nullable=True)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # This account's end-user limits (migration 0014): the caps on its end users (in all, new per
    # minute) and each end user's requests and tokens per minute. NULL takes the gateway's default
    # (Settings.end_users_*, Settings.end_user_*), 0 is unlimited.
    end_users_max: Mapped[int | None] = mapped_column(Integer, nullable=True)
    end_users_new_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    end_user_requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    end_user_tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)


class EndUser(Base):
    """An account's end user (migration 0013): the platform's own user, named by the identifier the
    platform sends (``safety_identifier``, ``user``, Anthropic's ``metadata.user_id``), stored as sent.
    It holds message IDs of its own (``message_ids.end_user_id``); deleting it is a tombstone. A
    row with no identifier is a slot (``EndUserSlot``, ``service.end_users.reserve``), not an end user."""

    __tablename__ = "end_users"
    __table_args__ = (
        CheckConstraint(_in("status", END_USER_ROW_STATUSES), name="status"),
        UniqueConstraint("user_id", "identifier", name="uq_end_users_user_id_identifier"),
        Index("ix_end_users_user_id_created_at", "user_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # the account (the API key's owner) whose end user this is
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="RESTRICT"))
    # NULL only in a row that is not an end user of its own (``EndUserSlot``: reserved, void, merged),
    # which no reader of end users sees
    identifier: Mapped[str | None] = mapped_column(String(256), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default=EndUserStatus.ACTIVE.value)
    # a merged row (``EndUserSlot.MERGED``, migration 0016): the end user its texts name
    merged_into: Mapped[int | None] = mapped_column(ForeignKey("end_users.id", ondelete="RESTRICT"), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # a minute's resolution: written when a process reads the end user and the last write is older
    last_seen_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # this end user's own rate limits (migration 0014): NULL takes the account's end-user limit
    # (users.end_user_*, else the gateway's default), 0 is unlimited
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)


class EndUserTally(Base):
    """How many end users an account has ever had, deleted ones and reserved slots included
    (migration 0015; slots: 0016): the row a first sight or a reservation of slots locks and counts
    on, so checking ``end_users_max`` costs one row however many end users the account has
    (counting them cost 40 ms at 10^6)."""

    __tablename__ = "end_user_tallies"

    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="RESTRICT"), primary_key=True)
    total: Mapped[int] = mapped_column(BigInteger)


class MessageId(Base):
    """A message ID of one message length (bits, block_bits), of a user or of an end user; never
    reused, never deleted.

    A user (and an end user) holds one per length in use (the lengths of the non-retired key
    versions and the configured one); ``users.message_id`` is the one of the length the user was
    created with. Exactly one of ``user_id`` (an account) and ``end_user_id`` (an end user) is set:
    accounts and end users share one ID space per length (the unique constraint on the ID).
    """

    __tablename__ = "message_ids"
    __table_args__ = (
        UniqueConstraint("bits", "block_bits", "message_id", name="uq_message_ids_bits_block_bits_message_id"),
        UniqueConstraint("user_id", "bits", "block_bits", name="uq_message_ids_user_id_bits_block_bits"),
        UniqueConstraint("end_user_id", "bits", "block_bits", name="uq_message_ids_end_user_id_bits_block_bits"),
        CheckConstraint("(user_id IS NULL) <> (end_user_id IS NULL)", name="one_owner"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="RESTRICT"), nullable=True)
    end_user_id: Mapped[int | None] = mapped_column(ForeignKey("end_users.id", ondelete="RESTRICT"), nullable=True)
    bits: Mapped[int] = mapped_column(Integer)
    block_bits: Mapped[int] = mapped_column(Integer)
    message_id: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="RESTRICT"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class KeyVersion(Base):
    __tablename__ = "key_versions"
    __table_args__ = (CheckConstraint(_in("status", KEY_VERSION_STATUSES), name="status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    bits: Mapped[int] = mapped_column(Integer)
    block_bits: Mapped[int] = mapped_column(Integer)
    num_keys: Mapped[int] = mapped_column(Integer)
    delta: Mapped[float] = mapped_column(Float)
    scheme: Mapped[str] = mapped_column(String(32))
    # the entropy rule's threshold in nats (0: every position biased); see WatermarkParams.min_entropy
    min_entropy: Mapped[float] = mapped_column(Float, server_default="0")
    # scheme gumbel: the salts its answers draw from (1: none); see WatermarkParams.salts
    salts: Mapped[int] = mapped_column(Integer, server_default="1")
    fingerprint: Mapped[str] = mapped_column(String(64))
    # a per-request version's biasing encoder (xmark_core.encoders): its scheme and parameters (its
    # message length in bits is the version's), and its own key's fingerprint; NULL for a version of
    # one scheme
    companion_scheme: Mapped[str | None] = mapped_column(String(32), nullable=True)
    companion_block_bits: Mapped[int | None] = mapped_column(Integer, nullable=True)
    companion_num_keys: Mapped[int | None] = mapped_column(Integer, nullable=True)
    companion_delta: Mapped[float | None] = mapped_column(Float, nullable=True)
    companion_min_entropy: Mapped[float | None] = mapped_column(Float, nullable=True)
    companion_fingerprint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    activated_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    retired_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Generation(Base):
    __tablename__ = "generations"
    __table_args__ = (
        Index("ix_generations_user_id_created_at", "user_id", "created_at"),
        # an end user's records by time (its usage); rows of no end user are left out (migration 0014)
        Index(
            "ix_generations_end_user_id_created_at",
            "end_user_id",
            "created_at",
            postgresql_where=text("end_user_id IS NOT NULL"),
            sqlite_where=text("end_user_id IS NOT NULL"),
        ),
        # one row per choice of a request, however often its write is retried or drained
        UniqueConstraint("request_id", "choice_index", name="uq_generations_request_id_choice_index"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64), index=True)
    choice_index: Mapped[int] = mapped_column(Integer, server_default="0")
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="RESTRICT"))
    # the account's end user it was generated for (NULL: for the account itself); migration 0013
    end_user_id: Mapped[int | None] = mapped_column(ForeignKey("end_users.id", ondelete="RESTRICT"), nullable=True)
    key_version_id: Mapped[int] = mapped_column(ForeignKey("key_versions.id", ondelete="RESTRICT"))
    # the scheme of the encoder that wrote it ("gumbel", "xmark", ...): a per-request key version's
    # primary or companion; NULL on records written before versions had two (the version's scheme)
    encoder: Mapped[str | None] = mapped_column(String(16), nullable=True)
    model: Mapped[str] = mapped_column(String(200))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    streamed: Mapped[bool] = mapped_column(Boolean, default=False)
    completion_sha256: Mapped[str] = mapped_column(String(64))
    completion_text: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # the keyed content sketch of the completion's text (service.provenance), NULL when off or purged
    sketch_terms: Mapped[list[int] | None] = mapped_column(IntArray(), nullable=True)
    sketch_minhash: Mapped[list[int] | None] = mapped_column(IntArray(), nullable=True)


class EmbeddingRecord(Base):
    """One ``POST /v1/embeddings`` request (migration 0011): who asked, which model, how many texts
    and tokens; never the texts. Embeddings are not generated text: they have no generations row.
    A trigger adds each row to its user's ``usage_daily`` embedding columns."""

    __tablename__ = "embedding_records"
    __table_args__ = (Index("ix_embedding_records_user_id_created_at", "user_id", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # one row per request, however often its write is retried
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="RESTRICT"))
    model: Mapped[str] = mapped_column(String(200))
    inputs: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class UsageDaily(Base):
    """Usage per user per UTC day, kept by the database itself as generation records are inserted
    (migration 0007's triggers), so the usage API reads one row per user and day instead of every
    record of the period. ``requests`` and ``prompt_tokens`` count a request once (its choice 0).
    ``embedding_requests`` and ``embedding_tokens`` count ``/v1/embeddings`` requests and their
    input tokens, from ``embedding_records`` (migration 0011's triggers)."""

    __tablename__ = "usage_daily"
    # and the index ix_usage_daily_day_user_id (day DESC, user_id), the usage API's order (migration only)

    # users are never deleted (a deletion is a tombstone); a row removed by hand takes its totals along
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), primary_key=True)
    day: Mapped[str] = mapped_column(String(10), primary_key=True)  # YYYY-MM-DD, UTC
    requests: Mapped[int] = mapped_column(BigInteger)
    completions: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    embedding_requests: Mapped[int] = mapped_column(BigInteger, server_default="0")
    embedding_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")


class UsageDayTotals(Base):
    """How many (user, day) rows ``usage_daily`` holds for each day (kept by a trigger on it), so a
    period's count reads one row per day."""

    __tablename__ = "usage_day_totals"

    day: Mapped[str] = mapped_column(String(10), primary_key=True)
    users: Mapped[int] = mapped_column(BigInteger)


class Trace(Base):
    __tablename__ = "traces"
    __table_args__ = (Index("ix_traces_created_at", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    requester_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="RESTRICT"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    verdict: Mapped[str] = mapped_column(String(32))
    p_value: Mapped[float] = mapped_column(Float)
    statistic: Mapped[float] = mapped_column(Float)
    scored_tokens: Mapped[int] = mapped_column(Integer)
    key_version_id: Mapped[int | None] = mapped_column(
        ForeignKey("key_versions.id", ondelete="RESTRICT"), nullable=True
    )
    attributed_user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="RESTRICT"), nullable=True)
    # the end user of that account the text was attributed to (migration 0013)
    attributed_end_user_id: Mapped[int | None] = mapped_column(
        ForeignKey("end_users.id", ondelete="RESTRICT"), nullable=True
    )
    # which decoder decided (TraceDecoder.COUNTING or .LIKELIHOOD)
    decoder: Mapped[str] = mapped_column(String(16), server_default=TraceDecoder.COUNTING.value)
    # the signed report (services/reports.py); NULL on traces recorded before reports were signed,
    # except report_id, which every trace has
    report_id: Mapped[str] = mapped_column(String(32), unique=True)
    text_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    key_version_fingerprint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    params: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON: b, d, k, delta
    decoder_settings: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON
    gateway_version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    report_payload: Mapped[str | None] = mapped_column(Text, nullable=True)  # the canonical JSON signed
    signature: Mapped[str | None] = mapped_column(String(128), nullable=True)  # base64 Ed25519
    signing_key_id: Mapped[str | None] = mapped_column(String(32), nullable=True)


class RegistryAuditEntry(Base):
    """One change to the registry (users, API keys, key versions, message IDs), appended in the
    unit of work of the change (migration 0012, ``services/audit.py``).

    ``seq`` numbers the entries 1, 2, 3, … without gaps; ``prev_hash`` is the previous entry's
    ``entry_hash`` (``GENESIS_HASH`` for the first); ``entry_hash`` is the SHA-256 of the canonical
    JSON of the entry's fields (all but itself and the signature), ``signature`` the Ed25519
    signature of the same bytes by the report signing key ``signing_key_id``. ``changes`` holds the
    changed fields before and after: never a key, a key's hash or a secret."""

    __tablename__ = "registry_audit"
    __table_args__ = (
        CheckConstraint(_in("actor_kind", AUDIT_ACTOR_KINDS), name="actor_kind"),
        Index("ix_registry_audit_target_type_target_id", "target_type", "target_id"),
    )

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    actor_kind: Mapped[str] = mapped_column(String(16))
    # the acting user (actor_kind api); no foreign key: the trail stands on its own
    actor_user_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    actor_name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    action: Mapped[str] = mapped_column(String(64), index=True)
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str] = mapped_column(String(64))
    changes: Mapped[dict[str, Any]] = mapped_column(JSON)  # {"before": {...} | null, "after": {...} | null}
    request_id: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the API request's X-Request-ID
    prev_hash: Mapped[str] = mapped_column(String(64))
    entry_hash: Mapped[str] = mapped_column(String(64))
    signing_key_id: Mapped[str] = mapped_column(String(32))
    signature: Mapped[str] = mapped_column(String(128))  # base64 Ed25519


class RegistryAuditHead(Base):
    """The audit trail's head: its one row holds the last entry's ``seq`` and ``entry_hash``. Each
    append updates it in the unit of work of the change, so appends take turns on its row lock
    (PostgreSQL; SQLite's single writer serializes them anyway) and the chain never forks; a
    verifier compares it with the last entry to see entries removed from the end."""

    __tablename__ = "registry_audit_head"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(BigInteger)
    entry_hash: Mapped[str] = mapped_column(String(64))
