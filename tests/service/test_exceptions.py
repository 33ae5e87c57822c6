"""One exception tree for the gateway's package: every exception class the ``service`` package
defines derives from ``service.exceptions.ServiceError`` (save the two kinds its docstring names)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import service
from service.db.write_gate import SQLiteWriteUnavailable
from service.errors import GatewayError, NotFoundError
from service.exceptions import ServiceError
from service.security import ApiKeyFormatError, parse_api_key

# must be an SQLAlchemy OperationalError: the database-fault path (``is_database_fault``) answers it
# 503 as it answers the database's own
OUTSIDE = {SQLiteWriteUnavailable}


def _exception_classes() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module_info in pkgutil.walk_packages(service.__path__, prefix="service."):
        if module_info.name.endswith(".__main__"):  # runs the CLI when imported
            continue
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")  # a module's own control flow, never raised out of it
            ):
                found[f"{value.__module__}.{name}"] = value
    return list(found.values())


def test_every_exception_of_the_package_is_a_service_error() -> None:
    classes = _exception_classes()
    assert len(classes) > 20 and GatewayError in classes and NotFoundError in classes
    outside = [c.__qualname__ for c in classes if not issubclass(c, ServiceError) and c not in OUTSIDE]
    assert not outside, outside


def test_a_class_that_replaced_a_builtin_keeps_it() -> None:
    try:
        parse_api_key("not a key")
    except ServiceError as caught:
        assert isinstance(caught, ApiKeyFormatError) and isinstance(caught, ValueError)
    else:
        raise AssertionError("a malformed key was accepted")
