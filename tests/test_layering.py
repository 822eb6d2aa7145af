"""The package's import graph: one direction, no cycle, no import hidden in a function
(docs/design.md, Layers). Read from the source with ast, so a violation fails here before
it can hide behind import order."""

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "hf_zoffload"
# offload/ in dependency order, sub-packages' files dotted: a file may import only files
# listed before it.
OFFLOAD_ORDER = ["tiers", "support", "layout", "host", "threads", "copier", "updaters", "state",
                 "modes.exchange", "modes.collectives", "modes.partitioned",
                 "modes.mesh", "modes.tensor_parallel", "modes.fsdp2_offload",
                 "modes.resolve", "delayed",
                 "update", "schedules.base", "schedules.inverse", "schedules.synchronous",
                 "schedules.delayed_update", "schedules.overlapped", "params", "memory",
                 "fraction", "progress", "checkpoint", "hooks", "reorder", "build", "engine"]


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(imported hf_zoffload module, inside a function?) for each import in ``path``."""
    tree = ast.parse(path.read_text())
    here = _module(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nested = {id(n) for f in funcs for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
            # `from . import checkpoint` names a module; `from .x import y` the module x
            names = [n if (PKG.parent / (n.replace(".", "/") + ".py")).exists()
                     or (PKG.parent / n.replace(".", "/")).is_dir() else n.rsplit(".", 1)[0]
                     for n in names] if not node.module else names
        for n in names:
            if n == "hf_zoffload" or n.startswith("hf_zoffload."):
                yield n, id(node) in nested


def _graph():
    return {_module(p): list(_imports(p)) for p in PKG.rglob("*.py")}


# Allowed lazy imports, each for a reason other than a cycle (the cycle test counts them too):
# the `hf-zoffload` subcommands import what they run only when run, so `--help` and `env`
# start without torch/transformers; the compiled extension may be missing (a clear error).
LAZY = {("hf_zoffload.ops._native", "hf_zoffload.ops")}


def test_no_package_import_inside_a_function():
    hidden = [(m, dep) for m, deps in _graph().items() for dep, inner in deps
              if inner and not m.startswith("hf_zoffload.commands.") and (m, dep) not in LAZY]
    assert not hidden, f"imports hidden in functions: {hidden}"


def test_no_import_cycle():
    graph = {m: {d for d, _ in deps if d != m} for m, deps in _graph().items()}
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        if state.get(m) == "open":
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        state[m] = "open"
        for d in graph.get(m, ()):
            visit(d, path + [m])
        state[m] = "done"

    for m in graph:
        visit(m, [])


def _offload_files() -> list[str]:
    """offload/'s modules, dotted below it (``modes.exchange``); packages' __init__ aside."""
    return sorted(".".join(p.relative_to(PKG / "offload").with_suffix("").parts)
                  for p in (PKG / "offload").rglob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", OFFLOAD_ORDER)
def test_offload_imports_only_earlier_files(name):
    assert _offload_files() == sorted(OFFLOAD_ORDER), \
        "a new offload/ file: place it in OFFLOAD_ORDER"
    earlier = {f"hf_zoffload.offload.{n}" for n in OFFLOAD_ORDER[:OFFLOAD_ORDER.index(name)]}
    deps = {d for d, _ in _imports(PKG / "offload" / f"{name.replace('.', '/')}.py")
            if d.startswith("hf_zoffload.offload.")
            and d not in ("hf_zoffload.offload.modes", "hf_zoffload.offload.schedules")}
    assert deps <= earlier, f"offload/{name}.py imports {sorted(deps - earlier)}"


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """A hidden import and a cycle in a scratch package are both caught."""
    pkg = tmp_path / "hf_zoffload"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    with pytest.raises(AssertionError, match="hidden"):
        test_no_package_import_inside_a_function()
    with pytest.raises(AssertionError, match="cycle"):
        test_no_import_cycle()
