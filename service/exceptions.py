"""The root of the gateway's exceptions: every error the ``service`` package raises about its own
domain derives from :class:`ServiceError`, so a caller outside the package (the CLI's entry point,
an evaluation, an embedding application) catches the package's failures with one ``except``.

The families under it: ``service.errors.GatewayError`` (what a client is answered, with its
status and envelope), start-up and configuration errors (``ConfigurationError``,
``KeyringError``, ``ModelStoreError``), the offline tools' (``CliError``, ``VerifyError``,
``ReportVerificationError``, ``ConfigDocsError``) and the write path's ``RecordNotDurable``. A class
that replaced a builtin also derives from it (``ApiKeyFormatError`` is a ``ValueError``,
``ModelStoreError`` a ``RuntimeError``). The library below keeps its own tree
(``xmark_core.XMarkError``). ``tests/service/test_exceptions.py`` checks that every exception class
of the package is in the tree.

Not here: pydantic validators raise ``ValueError``, which pydantic turns into its
``ValidationError`` (pydantic's protocol, answered 400 by the error handlers), and the programming
errors of a wrongly built internal object (``TypeError``, ``ValueError`` from a constructor's own
checks) that no caller is meant to catch.
"""

from __future__ import annotations

__all__ = ["ServiceError"]


class ServiceError(Exception):
    """Base of every exception of the gateway's own domain."""
