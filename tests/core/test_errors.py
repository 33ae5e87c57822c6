"""One error family: every domain error of the library is an XMarkError and still its old builtin."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Callable
from pathlib import Path

import pytest

import xmark_core
from xmark_core import (
    ArgumentError,
    ArgumentTypeError,
    CandidateSet,
    DecodeInputError,
    Message,
    MessageAllocator,
    MessageError,
    MessageSpaceExhausted,
    ParamsError,
    RequestArgumentError,
    SecretConfigError,
    WatermarkKey,
    WatermarkParams,
    WorkerConfigError,
    XMarkError,
    attribute,
    decode,
    errors,
    vllm_common,
)
from xmark_core.secrets import parse_secret_entries

from .synthetic import SECRET

PARAMS = WatermarkParams()


def _key() -> WatermarkKey:
    return WatermarkKey.from_secret(SECRET, PARAMS)


def _attribute_with_other_params() -> object:
    other = WatermarkParams(bits=24)
    candidates = CandidateSet(["0" * 24], [1], other)
    return attribute(decode(list(range(40)), _key()), candidates)


def _exhaust() -> object:
    params = WatermarkParams(bits=2, block_bits=2)
    return MessageAllocator(["00", "01", "10", "11"], params).allocate()


def _keyring() -> vllm_common.WorkerKeyring:
    return vllm_common.WorkerKeyring.from_variables({vllm_common.ENV_SECRETS: f"v1:{SECRET}"})


CASES: list[tuple[str, Callable[[], object], type[XMarkError], type[Exception]]] = [
    ("params out of range", lambda: WatermarkParams(bits=15), ParamsError, ValueError),
    ("params of another scheme", lambda: WatermarkParams(scheme="mpac", num_keys=2), ParamsError, ValueError),
    ("candidates of other params", _attribute_with_other_params, ParamsError, ValueError),
    ("message length", lambda: Message.from_bits("0" * 15, PARAMS), MessageError, ValueError),
    ("message value", lambda: Message.from_int(1 << 16, PARAMS), MessageError, ValueError),
    ("message space exhausted", _exhaust, MessageSpaceExhausted, RuntimeError),
    ("placeholder", lambda: parse_secret_entries("v1:changeme-changeme", source="s"), SecretConfigError, ValueError),
    ("short secret", lambda: WatermarkKey.from_secret("short", PARAMS), SecretConfigError, ValueError),
    ("text too short", lambda: decode([1, 2], _key()), DecodeInputError, ValueError),
    ("token id out of range", lambda: decode([1, 2, -3], _key()), DecodeInputError, ValueError),
    ("worker without secrets", lambda: vllm_common.WorkerKeyring.from_variables({}), WorkerConfigError, ValueError),
    (
        "malformed request arguments",
        lambda: vllm_common.parse_request({vllm_common.XARG_MESSAGE: "0" * 16}, _keyring()),
        RequestArgumentError,
        ValueError,
    ),
]


@pytest.mark.parametrize(("call", "error", "builtin"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_domain_errors_are_xmark_errors_and_keep_their_builtin(
    call: Callable[[], object], error: type[XMarkError], builtin: type[Exception]
) -> None:
    with pytest.raises(XMarkError) as caught:
        call()
    assert type(caught.value) is error
    assert isinstance(caught.value, builtin)  # ``except ValueError`` callers keep working


def test_every_error_class_is_exported_and_derives_from_xmark_error() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, XMarkError), name
        assert getattr(xmark_core, name) is cls, name
    # the historic homes still name the same classes
    assert vllm_common.WorkerConfigError is WorkerConfigError
    assert xmark_core.message.MessageSpaceExhausted is MessageSpaceExhausted
    assert xmark_core.secrets.SecretConfigError is SecretConfigError


def test_misuse_is_of_the_family_and_keeps_its_builtin() -> None:
    """A wrong type or an argument out of its range is a bug in the caller, still of the family."""
    with pytest.raises(ArgumentTypeError) as wrong_type:
        WatermarkParams(bits="16")  # type: ignore[arg-type]  # a wrong type on purpose
    assert isinstance(wrong_type.value, TypeError)
    with pytest.raises(ArgumentError) as out_of_range:
        xmark_core.detect(decode([1, 2, 3, 4], _key()), alpha=1.5)
    assert isinstance(out_of_range.value, ValueError)


def test_no_builtin_exception_is_raised_anywhere_in_the_library() -> None:
    """Every ``raise`` in xmark_core names a class of the family (or re-raises): none raises a
    builtin such as ``ValueError`` across the package's boundary. (A module ``__getattr__`` raises
    ``AttributeError``: Python's protocol for a missing name.)"""
    builtin = {name for name in dir(builtins) if isinstance(getattr(builtins, name), type)}
    found = []
    for path in sorted(Path(xmark_core.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        protocol = {
            id(node)
            for function in ast.walk(tree)
            if isinstance(function, ast.FunctionDef) and function.name == "__getattr__"
            for node in ast.walk(function)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None or id(node) in protocol:
                continue
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id in builtin:
                found.append(f"{path.name}:{node.lineno} raises {target.id}")
    assert not found, found
