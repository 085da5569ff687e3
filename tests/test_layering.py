"""Dependencies point one way: retrieval <- indexes <- attention <- app <- eval, with the CLI
and UI as shells over app and eval. Checked by reading every module's imports with `ast` (function-level
imports included), so a lazy import cannot slip an upward dependency in."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> the ldqa packages it must never import
FORBIDDEN = {
    "retrieval": {"indexes", "attention", "kernels", "app", "eval"},
    "indexes": {"attention", "kernels", "app", "eval"},
    "kernels": {"retrieval", "indexes", "attention", "app", "eval"},
    "attention": {"app", "eval"},
    "app": {"eval"},
}
SHELLS = {"app/cli.py", "app/ui.py"}  # the shells may use eval (the CLI's eval command, the UI's Evaluate tab)


def ldqa_imports(path: Path, pkg: tuple[str, ...] | None = None) -> list[tuple[int, str]]:
    """(line, top-level ldqa package) of every `import ldqa.X...` / `from ldqa.X... import` in `path`,
    and relative imports resolved against the file's package (`pkg`, default: its folder under ROOT)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    pkg = path.parent.relative_to(ROOT).parts if pkg is None else pkg
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y / from ..x import y
                base = list(pkg[: len(pkg) - node.level + 1])
                names = [".".join(["ldqa", *base, *([node.module] if node.module else [])])]
            else:
                names = [node.module or ""]
        else:
            continue
        for n in names:
            parts = n.split(".")
            if parts[0] == "ldqa" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def _modules(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "sample" not in p.parts)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
    bad = []
    for path in _modules(package):
        rel = str(path.relative_to(ROOT))
        if rel in SHELLS:
            continue
        bad += [f"{rel}:{line} imports ldqa.{target}" for line, target in ldqa_imports(path)
                if target in FORBIDDEN[package]]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The rule must be able to fail: a function-level import and a relative one are both found."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n\ndef f():\n    from ldqa.app.api import LongDocQA\n    from ..eval import metrics\n"
                     "    import ldqa.indexes.store\n")
    assert ldqa_imports(probe, ("attention",)) == [(4, "app"), (5, "eval"), (6, "indexes")]


def test_top_level_kernels_name_goes_to_the_installed_distribution():
    """Run from the repository root (python -m puts it on sys.path), the folder `kernels/` is importable as a
    top-level `kernels`, which shadows the Hugging Face distribution of that name that transformers >= 5.25
    imports; the folder's __init__ hands the name over to the installed distribution when there is one, and
    transformers' kernel integration imports either way."""
    import importlib.metadata
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = ("import kernels, transformers.integrations.hub_kernels, ldqa.kernels.dispatch; "
            "print(kernels.__file__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    found = Path(r.stdout.strip().splitlines()[-1]).resolve()
    try:
        importlib.metadata.version("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    assert (root / "kernels" not in found.parents) == installed, (found, installed)
