"""Package hygiene: light import, no service dependency, public names, typing marker."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import xmark_core

PACKAGE = Path(xmark_core.__file__).resolve().parent
HEAVY = ("torch", "transformers", "fastapi", "sqlalchemy", "service", "pydantic_settings", "vllm")


def _imports(path: Path) -> set[str]:
    """Top-level names of every absolute import in a module."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_import_is_light_in_a_fresh_interpreter() -> None:
    code = (
        "import sys, json, xmark_core\n"
        "import xmark_core.decoder, xmark_core.detect, xmark_core.attribution, xmark_core.message\n"
        "import xmark_core.errors, xmark_core.vllm_common\n"  # the gateway imports the argument names
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    root = PACKAGE.parent
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        timeout=120,  # 5x margin and more: the interpreter and these imports took 0.7 s here
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_core_never_imports_the_service_or_web_stack() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) >= 8
    for path in modules:
        found = _imports(path)
        assert not found & {
            "service",
            "fastapi",
            "sqlalchemy",
            "starlette",
            "pydantic_settings",
            "uvicorn",
            "alembic",
        }, path
        if "transformers" in found:
            assert path.name == "hf.py", f"{path} imports transformers outside the adapter"
        if "vllm" in found:
            assert path.name.startswith("vllm_"), f"{path} imports vllm outside the vLLM adapters"


# A vLLM worker has no Settings: its logits processor reads the watermark secrets from the
# environment once at start-up, in this one module and nowhere else in the library.
WORKER_ENVIRONMENT_READER = "vllm_common.py"


def test_core_does_not_read_the_environment() -> None:
    """House rule: xmark_core is a pure library; the one Settings class reads the environment."""
    offenders = [
        path.name
        for path in sorted(PACKAGE.rglob("*.py"))
        if any(word in path.read_text() for word in ("os.environ", "getenv(", "environ.get("))
    ]
    assert offenders in ([], [WORKER_ENVIRONMENT_READER])
    if offenders:
        text = (PACKAGE / WORKER_ENVIRONMENT_READER).read_text()
        assert text.count("os.environ") == 1 and "getenv(" not in text and "environ.get(" not in text


def test_all_names_resolve() -> None:
    assert len(xmark_core.__all__) == len(set(xmark_core.__all__))
    for name in xmark_core.__all__:
        assert getattr(xmark_core, name) is not None, name
    from xmark_core.encoder import TorchWatermarker, apply_watermark

    assert xmark_core.TorchWatermarker is TorchWatermarker and xmark_core.apply_watermark is apply_watermark


def test_py_typed_marker_is_shipped() -> None:
    assert (PACKAGE / "py.typed").is_file()
