"""The documentation stays true to the code: the generated op reference is current, the README
stays a newcomer's page, and nothing points at files outside the repository."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "tools" / "gen_op_reference.py"
README_MAX_LINES = 150


def _generator():
    spec = importlib.util.spec_from_file_location("gen_op_reference", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_op_reference_is_current():
    gen = _generator()
    current = (ROOT / "docs" / "ops.md").read_text(encoding="utf-8")
    assert current == gen.generate(), f"docs/ops.md is stale; regenerate with: {gen.REGENERATE}"


def test_op_reference_lists_every_registered_op():
    gen = _generator()
    schemas = gen.read_all_schemas()
    names = [gen.op_name(s) for s in schemas]
    # an outside check of the parser: the registered ops as torch sees them, where the extension is built
    torch = pytest.importorskip("torch")
    try:
        import fastinfer  # noqa: F401  (loads the extension)
    except ImportError:
        pytest.skip("fastinfer extension not built")
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fastinfer::")}
    assert sorted(names) == sorted(registered)
    reference = gen.generate()
    for schema in schemas:
        name = gen.op_name(schema)
        assert f"### `{name}`" in reference and schema in reference
        # torch's own rendering of the schema names the same arguments in the same order
        torch_args = [a.name for a in getattr(torch.ops.fastinfer, name).default._schema.arguments]
        parsed_args = [arg.split("=")[0].split()[-1] for arg in schema[schema.index("(") + 1 : schema.rindex(") ->")].split(", ") if arg]
        assert torch_args == parsed_args, name


def test_schema_parser_joins_adjacent_literals_and_skips_comments():
    gen = _generator()
    text = '// m.def("commented(Tensor x) -> Tensor");\n  m.def("a(Tensor x, "\n        "int n=0) -> Tensor");\n'
    assert gen.read_schemas(text) == ["a(Tensor x, int n=0) -> Tensor"]


def test_readme_is_a_short_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def _tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_no_file_refers_outside_the_repository():
    forbidden = ("shared/" + "DESIGN", "../" + "shared")  # split so that this file does not match itself
    offenders = []
    for path in _tracked_files():
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        offenders += [f"{path.relative_to(ROOT)}: {word}" for word in forbidden if word in text]
    assert not offenders
