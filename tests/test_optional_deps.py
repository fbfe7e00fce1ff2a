"""The runtime needs only what pyproject.toml's ``dependencies`` lists: ``import fastinfer``, the
ops, ``LLM`` and the CLI work without the ``serve`` and ``gguf`` extras, and the features that need
them say which extra to install. Each case runs in a fresh interpreter whose imports of the extras'
packages fail as if they were not installed (a ``sys.meta_path`` finder placed first)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from test_gguf import SMOLLM, needs_smollm

EXTRAS_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "gguf", "starlette", "pydantic", "xgrammar")

BLOCK = textwrap.dedent(f"""
    import importlib.abc, sys
    class _NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {EXTRAS_PACKAGES!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, _NotInstalled())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=180, env=env)


def test_the_blocker_blocks():
    r = _run("import fastapi")
    assert r.returncode != 0 and "No module named 'fastapi'" in r.stderr


def test_ops_llm_and_cli_need_no_extra():
    r = _run("""
        import torch, fastinfer
        from fastinfer import LLM, SamplingParams
        x = torch.randn(3, 64)
        w = torch.rand(64) + 0.5
        out = torch.ops.fastinfer.rms_norm(x, w, 1e-6)
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
        llm = LLM()
        res = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(res[0].outputs[0].token_ids) == 4
        from fastinfer.entrypoints.cli import build_parser
        build_parser().format_help()
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    assert "fastapi" not in r.stderr


def test_structured_output_names_its_extra():
    """Without xgrammar a constrained request finishes with an error naming the extra; the others run."""
    r = _run("""
        from fastinfer import LLM, SamplingParams, StructuredOutputs
        llm = LLM()
        outs = llm.generate(["Hi", "Hi"], [SamplingParams(max_tokens=2, structured=StructuredOutputs(regex="a+")),
                                           SamplingParams(max_tokens=2)])
        print(outs[0].error)
        assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 2
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "structured output needs the 'xgrammar' package: pip install 'fastinfer[structured]'" in r.stdout


def test_serve_names_its_extra():
    r = _run("import fastinfer.entrypoints.openai")
    assert r.returncode != 0
    assert "fastinfer serve needs the 'fastapi' package: pip install 'fastinfer[serve]'" in r.stderr, r.stderr[-2000:]


@needs_smollm
def test_gguf_names_its_extra():
    r = _run(f"""
        from fastinfer.models import load_config
        load_config({SMOLLM!r})
    """)
    assert r.returncode != 0
    assert "loading a GGUF checkpoint needs the 'gguf' package: pip install 'fastinfer[gguf]'" in r.stderr, \
        r.stderr[-2000:]
