"""The package's structure, enforced: the import graph of ``python/fastinfer`` points down the
layers (ops <- layers <- models <- quant <- engine <- entry points), has no cycle, never imports a
``_private`` name across packages, and production code never imports the fp64 test oracles
(``fastinfer.reference``). Engine modules stay short enough to read.
``distributed`` (tensor-parallel groups, collectives) sits at the bottom with the ops: torch only.

Parsed from the sources (``ast``), so function-level imports count too.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set, Tuple

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "fastinfer")

# top-level package -> layer; a package may import its own layer and the ones below
LAYERS = {
    "ops": 0, "reference": 0, "simt": 0, "_C": 0, "_sim": 0, "": 0,  # "": fastinfer/__init__.py
    "distributed": 0,  # process groups and collectives: torch only
    "layers": 1,
    "models": 2,
    "quant": 3,
    "engine": 4,
    "entrypoints": 5, "__main__": 5,
}
# allowed to read the oracles: entry points that show errors against them (make demo)
MAY_IMPORT_REFERENCE = {"entrypoints.demo", "reference"}
MAX_ENGINE_LINES = 350


def _modules() -> Dict[str, str]:
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, PKG)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith("__init__") else rel] = path
    return out


def _resolve(mod: str, is_pkg: bool, level: int, target: str) -> str:
    """Absolute module name (within fastinfer, "" = the root) of a relative import."""
    parts = mod.split(".") if mod else []
    base = parts if is_pkg else parts[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(mods: Dict[str, str]) -> List[Tuple[str, str, str, bool]]:
    """``(importer, imported module, imported name or "", inside a function)`` for every import."""
    out = []
    for mod, path in mods.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        is_pkg = path.endswith("__init__.py")
        funcs = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
        for node in ast.walk(tree):
            in_func = id(node) in funcs
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "fastinfer" or a.name.startswith("fastinfer."):
                        out.append((mod, a.name[len("fastinfer."):] if "." in a.name else "", "", in_func))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    target = _resolve(mod, is_pkg, node.level, node.module or "")
                elif node.module and (node.module == "fastinfer" or node.module.startswith("fastinfer.")):
                    target = node.module[len("fastinfer."):] if "." in node.module else ""
                else:
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}" if target else a.name
                    if sub in mods:  # "from . import ops": the module itself
                        out.append((mod, sub, "", in_func))
                    else:
                        out.append((mod, target, a.name, in_func))
    return out


def _top(mod: str) -> str:
    return mod.split(".")[0]


IMPORTS = _imports(_modules())


def test_parser_sees_known_imports():
    """The checks below are only as good as the parser: it must see these."""
    edges = {(a, b, n) for a, b, n, _ in IMPORTS}
    assert ("engine.core", "engine.executor", "Executor") in edges
    assert ("models.llama", "layers", "ColumnParallelLinear") in edges
    assert ("", "ops", "") in edges  # fastinfer/__init__.py: from . import ops
    assert any(a == "" and b == "engine" and f for a, b, _, f in IMPORTS)  # the lazy LLM import


def test_imports_point_down_the_layers():
    bad = []
    for a, b, name, in_func in IMPORTS:
        if a == "" and b == "engine" and in_func:
            continue  # fastinfer.LLM: the engine loads on first use
        la, lb = LAYERS[_top(a)], LAYERS[_top(b)]
        if lb > la:
            bad.append(f"{a or 'fastinfer'} imports {b}{'.' + name if name else ''} (layer {lb} > {la})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph: Dict[str, Set[str]] = {}
    for a, b, _, in_func in IMPORTS:
        if a == "" and in_func:
            continue
        if a != b:
            graph.setdefault(a, set()).add(b)
    state: Dict[str, int] = {}
    path: List[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if n.startswith(m + "."):
                continue  # a package importing its own submodules in __init__
            if state.get(n) == 1 and not m.startswith(n + "."):
                pytest.fail("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_private_names_across_packages():
    bad = [f"{a} imports {b}.{n}" for a, b, n, _ in IMPORTS
           if n.startswith("_") and _top(a) != _top(b) and n not in ("_C", "_sim")]
    bad += [f"{a} imports {b}" for a, b, _, _ in IMPORTS
            if _top(a) != _top(b) and any(p.startswith("_") and p not in ("_C", "_sim", "__main__")
                                          for p in b.split(".")[1:])]
    assert not bad, "\n".join(bad)


def test_production_code_does_not_import_the_oracles():
    bad = [f"{a} imports {b}" for a, b, _, _ in IMPORTS
           if _top(b) == "reference" and a not in MAY_IMPORT_REFERENCE and _top(a) != "reference"]
    assert not bad, "\n".join(bad)


def test_engine_modules_stay_short():
    long = []
    for mod, path in _modules().items():
        if _top(mod) != "engine":
            continue
        lines = open(path, encoding="utf-8").read().splitlines()
        doc = ast.get_docstring(ast.parse("\n".join(lines))) or ""
        if len(lines) > MAX_ENGINE_LINES and "longer than" not in doc.lower():
            long.append(f"{mod}: {len(lines)} lines and no reason at its top")
    assert not long, "\n".join(long)


def test_import_fastinfer_stays_light():
    """``import fastinfer`` loads the ops, not the runner; ``fastinfer.LLM`` loads it on first use."""
    import subprocess
    import sys

    code = ("import sys, fastinfer; light = not any(m.startswith(('fastinfer.engine', 'fastinfer.models', "
            "'fastinfer.quant', 'transformers')) for m in sys.modules); fastinfer.LLM; "
            "print(light, 'fastinfer.engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"], out.stdout
