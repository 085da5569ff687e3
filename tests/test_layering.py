"""Dependencies point one way: retrieval <- indexes <- attention <- app <- eval <- eval.bench, with the
CLI and UI as shells over app and eval, the benchmark scripts of eval/bench imported by nothing outside it
but the tests, and no two ldqa modules depend on each other (no import cycle, of any length, within a
package or across packages). Checked by reading every module's imports with `ast`
(function-level imports included), so a lazy import cannot slip an upward dependency or a cycle in."""

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
    """The package's modules, less the bundled sample's helpers."""
    return sorted(p for p in (ROOT / package).rglob("*.py") if "sample" not in p.parts)


# installed package -> its folder under ROOT (pyproject.toml's package-dir)
PACKAGE_DIRS = {"ldqa": "ldqa", "ldqa.app": "app", "ldqa.retrieval": "retrieval", "ldqa.indexes": "indexes",
                "ldqa.attention": "attention", "ldqa.kernels": "kernels", "ldqa.eval": "eval"}


def module_files(root: Path = ROOT, dirs: dict | None = None) -> dict[str, Path]:
    """Dotted ldqa module name -> its file, for every .py of the packages (a package's __init__.py is the
    package's own name)."""
    out = {}
    for package, folder in (PACKAGE_DIRS if dirs is None else dirs).items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((package, *parts))] = path
    return out


def import_graph(files: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {ldqa module it imports: line of the first such import}, from every import statement of
    its file (function-level ones included). `from P import name` counts as an import of the module P.name
    when that is a module, else of P; `import a.b.c` as an import of the longest of a.b.c, a.b, a that is
    a module; relative imports are resolved against the importing module's package."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                parts = target.split(".")
                found = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in files),
                             None)
                if found is not None and found != name:
                    edges.setdefault(found, node.lineno)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle [m1, m2, ..., m1] per group of modules that import each other (a strongly connected
    component of `graph`, Tarjan's algorithm), starting at the group's first module by name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:  # a shortest way from the group's first module back to it, inside the group
        start = min(group)
        paths = {start: [start]}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(graph[v]):
                if w == start:
                    cycles.append(paths[v] + [start])
                    queue = []
                    break
                if w in group and w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return sorted(cycles)


def test_no_import_cycles():
    graph = import_graph(module_files())
    cycles = import_cycles(graph)
    assert not cycles, "ldqa modules that import each other (module:line of each import):\n" + "\n".join(
        " -> ".join(f"{a} ({module_files()[a].relative_to(ROOT)}:{graph[a][b]})" for a, b in zip(c, c[1:]))
        + f" -> {c[-1]}" for c in cycles)


def test_the_cycle_finder_sees_lazy_relative_and_long_cycles(tmp_path):
    """The rule must be able to fail: a cycle through a function-level import, a relative import and three
    modules of two packages is found and named; modules that only import downwards are not."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "__init__.py").write_text("")
    (tmp_path / "a" / "one.py").write_text("from .two import X\n")
    (tmp_path / "a" / "two.py").write_text("def f():\n    from ldqa.b import three\n")
    (tmp_path / "b" / "three.py").write_text("import ldqa.a.one\n")
    (tmp_path / "b" / "low.py").write_text("")
    (tmp_path / "b" / "high.py").write_text("from ldqa.b import low\nfrom ldqa.a import two\n")
    graph = import_graph(module_files(tmp_path, {"ldqa.a": "a", "ldqa.b": "b"}))
    assert graph["ldqa.a.two"] == {"ldqa.b.three": 2} and graph["ldqa.b.high"] == {"ldqa.b.low": 1, "ldqa.a.two": 2}
    assert import_cycles(graph) == [["ldqa.a.one", "ldqa.a.two", "ldqa.b.three", "ldqa.a.one"]]


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


BENCH = "ldqa.eval.bench"  # the benchmark and diagnostic scripts: only themselves and the tests import them


def bench_imports(files: dict[str, Path]) -> list[str]:
    """`module (file:line) imports target` for every import of BENCH or a module under it by a module
    outside it, from `import_graph` (so function-level and relative imports count)."""
    def inside(module: str) -> bool:
        return module == BENCH or module.startswith(BENCH + ".")

    graph = import_graph(files)
    return [f"{name} ({files[name].name}:{line}) imports {target}" for name, edges in sorted(graph.items())
            if not inside(name) for target, line in edges.items() if inside(target)]


def test_the_product_never_imports_the_benchmarks():
    assert any(m.startswith(BENCH + ".") for m in module_files()), "no benchmark scripts found"
    bad = bench_imports(module_files())
    assert not bad, "product modules that import the benchmark scripts:\n" + "\n".join(bad)


def test_the_bench_rule_sees_lazy_and_relative_imports(tmp_path):
    """The rule must be able to fail: a function-level import and a relative one from outside eval/bench are
    found; the scripts importing each other and the product are not."""
    (tmp_path / "eval" / "bench").mkdir(parents=True)
    (tmp_path / "eval" / "__init__.py").write_text("")
    (tmp_path / "eval" / "metrics.py").write_text("")
    (tmp_path / "eval" / "harness.py").write_text("def f():\n    from ldqa.eval.bench import run_x\n")
    (tmp_path / "eval" / "report.py").write_text("from .bench.run_x import main\n")
    (tmp_path / "eval" / "bench" / "__init__.py").write_text("")
    (tmp_path / "eval" / "bench" / "run_x.py").write_text("from ldqa.eval import metrics\nfrom . import run_y\n")
    (tmp_path / "eval" / "bench" / "run_y.py").write_text("from ..harness import f\n")
    files = module_files(tmp_path, {"ldqa.eval": "eval"})
    assert bench_imports(files) == ["ldqa.eval.harness (harness.py:2) imports ldqa.eval.bench.run_x",
                                    "ldqa.eval.report (report.py:1) imports ldqa.eval.bench.run_x"]


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
