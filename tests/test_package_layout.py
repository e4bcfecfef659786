"""The package's floor plan (docs/design.md §9), checked on the source tree: no import cycle
between hcache's modules, no module over 400 lines, no stateless mixins, every design reference
resolved by a heading of docs/design.md, and the first wave's module paths kept as aliases."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import hcache

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hcache"
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """Every hcache module that ``name`` imports, at module level or inside a function."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = ".".join(base[:len(base) - node.level + 1] + ([node.module]
                                                                      if node.module else []))
            else:
                stem = node.module or ""
            # "from pkg import sub" depends on the submodule when there is one.
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in MODULES else stem
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_modules():
    # A package's __init__ may import its own submodules; a submodule importing its package's
    # __init__ (or anything that leads back to it) would be a cycle.
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{name}: {lines} lines (one concept per module, <= {MAX_LINES})"


def test_no_mixin_classes():
    mixins = [f"{name}.{node.name}" for name, path in MODULES.items()
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.ClassDef) and "mixin" in node.name.lower()]
    assert not mixins


def _repository_texts():
    for pattern in ("hcache/**/*.py", "kernels/*.cu", "kernels/*.cuh",
                    "tests/*.py", "tests/*.h", "docs/*.md", "bench/*", "README.md"):
        for path in ROOT.glob(pattern):
            if path.is_file() and path.suffix in (".py", ".cu", ".cuh", ".h", ".md", ".sh"):
                yield path


def test_design_references_resolve():
    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## §(\d+)\b", design, flags=re.M))
    cited, stale = set(), []
    for path in _repository_texts():
        text = path.read_text()
        if path.name != "test_package_layout.py":
            stale += [f"{path.name}: {m}" for m in re.findall(r"SPEC §\d+|seeds? 00\d", text)]
        cited.update(re.findall(r"design\.md §(\d+)", text))
    assert not stale, f"references to documents outside the repository: {stale}"
    assert cited and cited <= sections, f"unresolved sections: {sorted(cited - sections)}"


@pytest.mark.parametrize("old, new", sorted(hcache._OLD_MODULE_PATHS.items()))
def test_first_wave_module_paths_are_aliases(old, new):
    assert importlib.import_module(f"hcache.{old}") is importlib.import_module(f"hcache.{new}")
    assert getattr(hcache, old) is importlib.import_module(f"hcache.{new}")


BOUNDARY = "hcache.runtime._cuda"


def _cupy_uses(path: Path) -> list[str]:
    """Imports of CuPy, and attribute chains through ``.cuda`` (``xp.cuda.Event``), in a
    module's source."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "cupy"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "cupy":
            found.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            found += [a.value for a in node.args if isinstance(a, ast.Constant)
                      and str(a.value).startswith("cupy")]
        elif isinstance(node, ast.Attribute) and node.attr == "cuda" \
                and isinstance(node.ctx, ast.Load):
            found.append(f"<expr>.cuda (line {node.lineno})")
    return found


@pytest.mark.parametrize("name", sorted(set(MODULES) - {BOUNDARY}))
def test_only_the_device_boundary_touches_cupy(name):
    """One device boundary (docs/design.md §2): every CuPy / CUDA call lives in hcache._cuda."""
    assert not _cupy_uses(MODULES[name]), f"{name} uses CuPy outside {BOUNDARY}"


def test_the_boundary_scan_finds_cupy(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("import cupy.cuda\nfrom cupy import ndarray\n"
                      "def f(xp):\n    return xp.cuda.Event()\n")
    assert len(_cupy_uses(sample)) == 3
    assert _cupy_uses(MODULES[BOUNDARY]), "the boundary itself is where CuPy is used"
