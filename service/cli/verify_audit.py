"""``xmark verify-audit``: check the registry's audit trail in the database, offline.

It reads ``registry_audit`` in sequence order from the configured database (or ``--database-url``),
recomputes each entry's hash, checks its signature with the gateway's public key (given, read from
the gateway's ``/.well-known/xmark-report-key``, or derived from the configured signing secret),
follows the chain (numbers without gaps, each ``prev_hash`` the previous entry's hash) and compares
the head row with the last entry. Exit status 0 with a one-line summary when the trail is intact; 1
naming the first bad entry and why (altered, removed, truncated at the end).

The trail is read while the gateway keeps appending: entries committed after the scan began are
checked too, and the head is read again until it agrees with the scan (each append commits its
entry and the head together).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence

from service.cli.verify_report import VerifyError, fetch_public_key
from service.config import Settings, load_secrets
from service.db import MAINTENANCE_TIMEOUT_S, create_engine, create_sessionmaker, session_scope
from service.repositories.audit import AuditRepository
from service.services.audit import ChainBreak, ChainVerifier, stored_entry
from service.services.reports import ReportSigner, ReportVerificationError, decode_public_key

PAGE = 1000
# the head is read again at most this often while entries keep arriving during the scan
MAX_HEAD_ROUNDS = 20
_ANCHOR = re.compile(r"^(\d{1,19}):([0-9a-f]{64})$")


def public_keys(settings: Settings, given: Sequence[str] | None, server: str | None) -> list[bytes]:
    """The raw public keys to check signatures with: the given ones, the server's, or the one of
    the configured signing secret."""
    try:
        if given:
            return [decode_public_key(value) for value in given]
    except ReportVerificationError as exc:
        raise VerifyError(f"--public-key: {exc}") from None
    if server is not None:
        return [fetch_public_key(server)]
    return [ReportSigner.from_secret(load_secrets(settings).report_signing).public_key]


def parse_anchor(value: str | None) -> tuple[int, str] | None:
    """``SEQ:HASH`` (a head exported earlier) as (seq, hash)."""
    if value is None:
        return None
    match = _ANCHOR.match(value.strip().lower())
    if match is None:
        raise VerifyError("--anchor must be SEQ:HASH, a sequence number and a 64-digit hex hash")
    return int(match.group(1)), match.group(2)


async def check_trail(
    settings: Settings, keys: Sequence[bytes], anchor: tuple[int, str] | None = None
) -> tuple[ChainVerifier, ChainBreak | None, tuple[int, str] | None]:
    """Scan the trail of ``settings.database_url``: the verifier (what it checked), the first
    break (None: intact) and the head read last."""
    verifier = ChainVerifier(keys, anchor=anchor)
    engine = create_engine(settings, timeout_s=MAINTENANCE_TIMEOUT_S)
    try:
        async with session_scope(create_sessionmaker(engine)) as session:
            repo = AuditRepository(session)

            async def scan() -> ChainBreak | None:
                """Check every entry after the last one checked."""
                while True:
                    rows = await repo.chain(after_seq=verifier.last_seq, limit=PAGE)
                    for row in rows:
                        problem = verifier.add(stored_entry(row))
                        if problem is not None:
                            return problem
                    session.expunge_all()  # a page at a time in memory
                    if len(rows) < PAGE:
                        return None

            problem = await scan()
            head = None
            rounds = 0
            while problem is None and rounds < MAX_HEAD_ROUNDS:
                rounds += 1
                head = await repo.head()
                if head is None or head[0] <= verifier.last_seq:
                    break
                # entries up to the head were committed with it: read them, or find them gone
                checked = verifier.last_seq
                problem = await scan()
                if verifier.last_seq == checked:
                    break
            if problem is None:
                problem = verifier.close(head)
            return verifier, problem, head
    finally:
        await engine.dispose()


def verify_audit(
    settings: Settings,
    *,
    public_keys_b64: Sequence[str] | None,
    server: str | None,
    anchor: str | None,
    out: Callable[[str], None] = print,
) -> int:
    """Check the trail; 0 and a summary when intact (VerifyError naming the first break otherwise)."""
    keys = public_keys(settings, public_keys_b64, server)
    verifier, problem, head = asyncio.run(check_trail(settings, keys, parse_anchor(anchor)))
    if problem is not None:
        raise VerifyError(f"audit trail BROKEN at {problem} ({verifier.count} entries before it verified)")
    assert head is not None  # close() reports a missing head
    signed = ", ".join(sorted(verifier.key_ids)) or "–"
    if verifier.count == 0:
        out(f"audit trail intact: no entries yet (head {head[0]} {head[1]})")
    else:
        out(f"audit trail intact: {verifier.count} entries, head {head[0]} {head[1]}, signed by key {signed}")
    return 0
