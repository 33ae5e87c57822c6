"""The library's exceptions: one family under :class:`XMarkError`.

``except XMarkError`` catches every error the library raises about its own domain: parameters,
messages, secrets, the token ids given to the decoder, a vLLM worker's configuration and a
request's watermark arguments. Each class also derives from the builtin exception that site
raised before the family existed (``ValueError`` or ``RuntimeError``), so ``except ValueError``
keeps working, and vLLM still answers a rejected request with HTTP 400. Calling the API with
arguments of the wrong type, or with arguments out of their documented range (``alpha``, ``top``,
...), raises the plain builtin ``TypeError`` / ``ValueError``: those are bugs in the caller, not
conditions to handle.
"""

from __future__ import annotations

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "DecodeInputError",
    "MessageError",
    "MessageSpaceExhausted",
    "ParamsError",
    "RequestArgumentError",
    "SecretConfigError",
    "WorkerConfigError",
    "XMarkError",
]


class XMarkError(Exception):
    """Base class of the library's exceptions."""


class ArgumentError(XMarkError, ValueError):
    """An argument out of its documented range (a level, a count, a shape): a bug in the caller."""


class ArgumentTypeError(XMarkError, TypeError):
    """An argument of the wrong type: a bug in the caller."""


class ParamsError(XMarkError, ValueError):
    """Watermark parameters out of range, or two objects made for different parameters."""


class MessageError(XMarkError, ValueError):
    """A message that is not a valid b-bit message (length, alphabet, value or block values)."""


class MessageSpaceExhausted(XMarkError, RuntimeError):
    """Every b-bit message has been allocated; no new ID can be issued."""


class SecretConfigError(XMarkError, ValueError):
    """The configured secrets cannot be used; the message says why (never the secret)."""


class DecodeInputError(XMarkError, ValueError):
    """Token ids the decoder cannot score: out of range, not 1-D, or no text of 3 or more tokens."""


class WorkerConfigError(XMarkError, ValueError):
    """The vLLM worker's watermark configuration cannot be used (start-up error)."""


class RequestArgumentError(XMarkError, ValueError):
    """A request's XMark arguments are malformed (vLLM rejects the request with HTTP 400)."""
