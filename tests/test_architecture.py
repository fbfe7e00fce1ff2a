"""The package's structure, enforced: the import graph of ``python/fastinfer`` points down the
layers (ops <- layers <- models <- quant <- engine <- entry points), has no cycle, never imports a
``_private`` name across packages, and production code never imports the fp64 test oracles
(``fastinfer.reference``). Engine modules stay short enough to read.
``distributed`` (tensor-parallel groups, collectives) sits at the bottom with the ops: torch only.

Inside the engine, the token side (core, scheduler, block manager, sequences, params, output
processor, the step messages, the speculative proposer and trees) imports no torch and nothing of
the tensor side (executor, workers, runner, drafters): it talks to the executor through
:mod:`fastinfer.engine.messages` only.

Parsed from the sources (``ast``), so function-level imports count too; imports under
``if TYPE_CHECKING:`` (annotations only, never executed) do not, except for cycles: an import
cycle hidden behind ``TYPE_CHECKING`` is still two modules that need each other. The engine's
package faces (``engine/__init__.py``, ``engine/speculative/__init__.py``) import nothing, so
``import fastinfer.engine.core`` leaves torch out.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Optional, Set, Tuple

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "fastinfer")

# top-level package -> layer; a package may import its own layer and the ones below
LAYERS = {
    "ops": 0, "reference": 0, "simt": 0, "_C": 0, "_sim": 0, "_optional": 0, "": 0,  # "": fastinfer/__init__.py
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


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_imports(source: str, mod: str, is_pkg: bool, known: Set[str],
                  type_checking: bool = False) -> List[Tuple[int, str, str, bool]]:
    """``(line, module, imported name or "", inside a function)`` for every import that runs:
    function bodies included, ``if TYPE_CHECKING:`` bodies only with ``type_checking`` (annotations,
    never executed). Modules of the package are ``fastinfer.<name>``; ``from . import x`` of a module
    x is x itself."""
    out: List[Tuple[int, str, str, bool]] = []

    def visit(node: ast.AST, in_func: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            for child in node.orelse:
                visit(child, in_func)
            return
        in_func = in_func or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, "", in_func) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = _resolve(mod, is_pkg, node.level, node.module or "")
                base = "fastinfer." + target if target else "fastinfer"
            else:
                base = node.module or ""
            for a in node.names:
                inner = base[len("fastinfer."):] if base.startswith("fastinfer.") else ("" if base == "fastinfer" else None)
                sub = None if inner is None else (f"{inner}.{a.name}" if inner else a.name)
                if sub is not None and sub in known:
                    out.append((node.lineno, "fastinfer." + sub, "", in_func))
                else:
                    out.append((node.lineno, base, a.name, in_func))
        for child in ast.iter_child_nodes(node):
            visit(child, in_func)

    visit(ast.parse(source), False)
    return out


def _imports(mods: Dict[str, str], type_checking: bool = False) -> List[Tuple[str, str, str, bool]]:
    """``(importer, imported module, imported name or "", inside a function)`` for every import of
    the package's own modules (names relative to fastinfer, "" = the root); ``type_checking``: the
    imports under ``if TYPE_CHECKING:`` too."""
    out = []
    for mod, path in mods.items():
        for _, name, imported, in_func in _walk_imports(open(path, encoding="utf-8").read(), mod,
                                                        path.endswith("__init__.py"), set(mods), type_checking):
            if name == "fastinfer" or name.startswith("fastinfer."):
                out.append((mod, name[len("fastinfer."):] if "." in name else "", imported, in_func))
    return out


def _top(mod: str) -> str:
    return mod.split(".")[0]


IMPORTS = _imports(_modules())
ALL_IMPORTS = _imports(_modules(), type_checking=True)  # annotations' imports too


def test_parser_sees_known_imports():
    """The checks below are only as good as the parser: it must see these."""
    edges = {(a, b, n) for a, b, n, _ in IMPORTS}
    assert ("engine.core", "engine.messages", "StepExecutor") in edges
    assert ("models.llama", "layers", "ColumnParallelLinear") in edges
    assert ("", "ops", "") in edges  # fastinfer/__init__.py: from . import ops
    assert ("", "engine.llm", "LLM") in edges  # the lazy fastinfer.LLM import
    assert ("engine.core", "engine.config", "EngineConfig") not in edges  # an annotation's import ...
    assert ("engine.core", "engine.config", "EngineConfig") in {(a, b, n) for a, b, n, _ in ALL_IMPORTS}  # ... seen

def test_imports_point_down_the_layers():
    bad = []
    for a, b, name, in_func in IMPORTS:
        if a == "" and _top(b) == "engine" and in_func:
            continue  # fastinfer.LLM: the engine loads on first use
        la, lb = LAYERS[_top(a)], LAYERS[_top(b)]
        if lb > la:
            bad.append(f"{a or 'fastinfer'} imports {b}{'.' + name if name else ''} (layer {lb} > {la})")
    assert not bad, "\n".join(bad)


def _cycle(imports) -> Optional[List[str]]:
    """The first import cycle of ``imports`` (a list of modules, the first repeated last), or None."""
    graph: Dict[str, Set[str]] = {}
    for a, b, _, in_func in imports:
        if a == "" and in_func:
            continue
        if a != b:
            graph.setdefault(a, set()).add(b)
    state: Dict[str, int] = {}
    path: List[str] = []

    def visit(m: str) -> Optional[List[str]]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if n.startswith(m + "."):
                continue  # a package importing its own submodules in __init__
            if state.get(n) == 1 and not m.startswith(n + "."):
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycles():
    """No cycle, counting the imports of annotations (``if TYPE_CHECKING:``) and function bodies."""
    found = _cycle(ALL_IMPORTS)
    assert found is None, "import cycle: " + " -> ".join(found)


def test_cycle_check_sees_annotation_imports():
    """A cycle closed only by an ``if TYPE_CHECKING:`` import is found; without it there is none."""
    edges = [("engine.config", "engine.speculative.registry", "SpecMethod", False)]
    assert _cycle(edges) is None
    annotation = ("engine.speculative.registry", "engine.config", "EngineConfig", False)
    assert _cycle(edges + [annotation]) == ["engine.config", "engine.speculative.registry", "engine.config"]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..config import EngineConfig\n"
    known = set(_modules())
    walk = [n for _, n, _, _ in _walk_imports(source, "engine.speculative.registry", False, known)]
    assert walk == ["typing"]
    walk = [n for _, n, _, _ in _walk_imports(source, "engine.speculative.registry", False, known, True)]
    assert walk == ["typing", "fastinfer.engine.config"]


ENGINE_FACES = ("engine", "engine.speculative")


def test_engine_package_faces_import_nothing():
    """The engine's package ``__init__`` files hold a docstring and import nothing of fastinfer,
    not even under ``TYPE_CHECKING``: importing one engine module loads that module's imports only."""
    mods = _modules()
    bad = [f"{a} imports {b}" for a, b, _, _ in ALL_IMPORTS if a in ENGINE_FACES]
    for face in ENGINE_FACES:
        tree = ast.parse(open(mods[face], encoding="utf-8").read())
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        bad += [f"{face}: line {n.lineno} is not a docstring" for n in body]
    assert not bad, "\n".join(bad)


def test_the_token_side_loads_without_torch():
    """``import fastinfer.engine.core`` runs the engine's package faces and the token side only: no torch.
    The package root is left out (``import fastinfer`` loads torch and the ops on purpose) by a bare
    ``fastinfer`` package of the same directory, so what is measured is the engine's own import graph."""
    import subprocess
    import sys

    code = ("import sys, types; pkg = types.ModuleType('fastinfer'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['fastinfer'] = pkg; import fastinfer.engine.core, fastinfer.engine.speculative.proposer; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'numpy')) "
            "or (m.startswith('fastinfer.') and not m.startswith('fastinfer.engine'))))")
    out = subprocess.run([sys.executable, "-c", code, PKG], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"], out.stdout


def test_importing_the_engine_core_loads_no_model_code():
    """With the real package root (torch and the ops): the core still loads no layers, models,
    quantisation, executor or tokenizer library."""
    import subprocess
    import sys

    heavy = ("fastinfer.layers", "fastinfer.models", "fastinfer.quant", "fastinfer.engine.executor",
             "fastinfer.engine.config", "fastinfer.engine.model_runner", "fastinfer.engine.speculative.drafter",
             "tokenizers", "transformers")
    code = (f"import sys; import fastinfer.engine.core; print(sorted(m for m in sys.modules if m.startswith({heavy!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"], out.stdout


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


# ---- the engine's seam: the token side ------------------------------------------------------------
TOKEN_SIDE = {"engine.core", "engine.scheduler", "engine.block_manager", "engine.sequence", "engine.params",
              "engine.output_processor", "engine.messages", "engine.speculative.proposer",
              "engine.speculative.trees", "engine.speculative.dflash_config"}
# what the token side may import besides itself: the detokenizer of the output processor (text)
TOKEN_SIDE_MAY_IMPORT = {"engine.tokenizer"}


def _runtime_imports(source: str, mod: str, is_pkg: bool, known: Set[str]) -> List[Tuple[int, str]]:
    """``(line, module)`` of every import that runs (:func:`_walk_imports`)."""
    return list(dict.fromkeys((line, name) for line, name, _, _ in _walk_imports(source, mod, is_pkg, known)))


def _token_side_violations(mod: str, source: str, is_pkg: bool, known: Set[str]) -> List[str]:
    bad = []
    for line, name in _runtime_imports(source, mod, is_pkg, known):
        inner = name[len("fastinfer."):] if name.startswith("fastinfer.") else None
        if name == "torch" or name.startswith("torch."):
            bad.append(f"{mod}:{line} imports {name}")
        elif name == "fastinfer" or (inner is not None and inner not in TOKEN_SIDE | TOKEN_SIDE_MAY_IMPORT):
            bad.append(f"{mod}:{line} imports {name} (not on the token side)")
    return bad


def test_token_side_imports_no_torch_and_no_tensor_side():
    mods = _modules()
    missing = sorted(TOKEN_SIDE - set(mods))
    assert not missing, f"token-side modules not found (renamed?): {missing}"
    bad = []
    for mod in sorted(TOKEN_SIDE):
        path = mods[mod]
        bad += _token_side_violations(mod, open(path, encoding="utf-8").read(), path.endswith("__init__.py"),
                                      set(mods))
    assert not bad, "\n".join(bad)


def test_token_side_check_names_the_offending_import():
    """The check above catches torch and the tensor side, at any depth, and skips annotations."""
    source = ("from typing import TYPE_CHECKING\n"
              "from .scheduler import Scheduler\n"
              "import torch.nn\n"
              "if TYPE_CHECKING:\n"
              "    from .config import EngineConfig\n"
              "else:\n"
              "    from .workers import TensorParallelRunner\n"
              "def build():\n"
              "    from .executor import Executor\n"
              "    from .speculative import drafter\n")
    known = set(_modules())
    assert _token_side_violations("engine.core", source, False, known) == [
        "engine.core:3 imports torch.nn",
        "engine.core:7 imports fastinfer.engine.workers (not on the token side)",
        "engine.core:9 imports fastinfer.engine.executor (not on the token side)",
        "engine.core:10 imports fastinfer.engine.speculative.drafter (not on the token side)",
    ]


def test_engine_core_drives_any_step_executor():
    """The core needs a StepExecutor, nothing more: a token-only stand-in (next token = last + 1)
    runs requests to their end, prefill chunks and decode rows included."""
    from types import SimpleNamespace

    from fastinfer.engine.core import EngineCore
    from fastinfer.engine.messages import ModelOutput, SampledToken, StepInput
    from fastinfer.engine.params import SamplingParams

    class CountingExecutor:
        max_model_len, num_kv_blocks, vocab_size, draft_tree = 64, 16, 100, None

        def __init__(self):
            self.steps = []

        def execute(self, step: StepInput) -> ModelOutput:
            self.steps.append(step)
            sched = step.scheduled
            rows = [s for s, n in sched.prefills if s.num_computed_tokens + n == s.num_tokens] + sched.decodes
            return ModelOutput(sampled=[SampledToken(s, (s.token_ids[-1] + 1) % self.vocab_size, None) for s in rows])

        def stats(self):
            return {}

    config = SimpleNamespace(block_size=4, max_num_seqs=4, max_num_batched_tokens=8, enable_prefix_caching=True,
                             speculative=None, static_batching=False)
    ex = CountingExecutor()
    core = EngineCore(config, ex, eos_token_ids=[99])
    assert core.add_request("a", list(range(10)), SamplingParams(max_tokens=5)) is None
    assert core.add_request("b", [97], SamplingParams(max_tokens=5)) is None
    assert core.add_request("c", [100], SamplingParams()) == "prompt token id 100 is outside the vocabulary [0, 100)"
    got = {}
    while core.has_unfinished_requests() and len(ex.steps) < 50:
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                got[o.request_id].append(o.finish_reason)
    assert got == {"a": [10, 11, 12, 13, 14, "length"], "b": [98, 99, "stop"]}
    assert any(s.scheduled.prefills and s.scheduled.prefills[0][1] < 10 for s in ex.steps)  # "a" came in chunks
