"""Layers point down: a package imports nothing from the layers above it.

The backends serve the services, the repositories serve the services, the services serve the
routers; an import the other way (a backend reading a service's constant) ties the lower layer to
the upper one's module and its import closure. Checked on the source (every ``import`` and
``from ... import``, at any depth of the module, including those under ``TYPE_CHECKING``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parents[2] / "service"

# package -> the packages above it, which it must not import
# (/trace's package, service.trace, sits beside the routers: it may use the services below it)
ABOVE = {
    "service.backends": ("service.services", "service.routers", "service.repositories", "service.trace"),
    "service.repositories": ("service.services", "service.routers", "service.backends", "service.trace"),
    "service.services": ("service.routers", "service.trace"),
}
# /trace's modules: its package, the content search and the sketches' reading side
TRACE_MODULES = (
    "service.trace",
    "service.provenance.search",
    "service.provenance.retrieval",
    "service.repositories.provenance",
)


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_a_package_imports_nothing_from_the_layers_above_it(package: str) -> None:
    folder = SERVICE / package.removeprefix("service.")
    modules = sorted(folder.rglob("*.py"))
    assert modules, f"no modules under {folder}"
    upward = [
        f"{path.relative_to(SERVICE.parent)}:{line} imports {name}"
        for path in modules
        for line, name in _imports(path)
        if any(name == above or name.startswith(above + ".") for above in ABOVE[package])
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("module", ["service.services.generation", "service.routers.chat"])
def test_the_chat_path_imports_no_trace_module(module: str) -> None:
    """The chat path (its router and its service) sketches its records with the sketching code
    alone: importing it loads none of /trace's modules (checked in a fresh interpreter)."""
    import subprocess
    import sys

    probe = (
        f"import sys, {module}; "
        f"print('\\n'.join(m for m in sys.modules if m == {TRACE_MODULES!r}[0] or m.startswith({TRACE_MODULES!r})))"
    )
    # a bound on the child, not a timing check: the import took 3 s here
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == [], f"{module} imports {done.stdout.split()}"


def _service_classes() -> list[tuple[str, ast.ClassDef]]:
    """Every class named ``*Service`` in the package, with its module's path."""
    found = []
    for path in sorted(SERVICE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Service"):
                found.append((str(path.relative_to(SERVICE)), node))
    return found


def test_services_receive_their_repositories_rather_than_building_them() -> None:
    """No ``*Service`` class constructs a ``*Repository`` (its caller hands it a
    ``service.repositories.unit.Repositories``), and each takes the repositories, not a session."""
    classes = _service_classes()
    assert {"UserService", "ApiKeyService", "TracingService", "EndUserService"} <= {c.name for _, c in classes}
    built = []
    for path, cls in classes:
        for node in ast.walk(cls):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith("Repository"):
                built.append(f"{path}: {cls.name} builds {node.func.id}")
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                for arg in node.args.args + node.args.kwonlyargs:
                    if isinstance(arg.annotation, ast.Name) and arg.annotation.id == "AsyncSession":
                        built.append(f"{path}: {cls.name} takes a session ({arg.arg})")
    assert not built, built
