"""``fastinfer bench --spec-methods``: several speculative methods against no-spec in one run (CPU, seconds)."""

import json

import pytest

from fastinfer.engine.config import SPEC_METHODS
from fastinfer.entrypoints.bench_spec import SPEC_ENTRIES
from fastinfer.entrypoints.cli import main

TINY = ["--num-prompts", "2", "--batch", "2", "--output-len", "8", "--compare-repeats", "2", "--device", "cpu"]


def test_spec_methods_table_and_json(tmp_path, capsys):
    out = tmp_path / "results" / "spec.json"
    names = ["draft-tree", "medusa", "eagle-chain:3", "eagle3-tree"]
    assert main(["bench", "--spec-methods", ",".join(names), "--spec-json", str(out)] + TINY) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["label"] == "CPU" and res["repeats"] == 2 and res["num_prompts"] == 2
    ran = [m["name"] for m in res["methods"]]
    skipped = {s["name"]: s["reason"] for s in res["skipped"]}
    assert sorted(ran + list(skipped)) == sorted(names)
    assert {"draft-tree", "medusa", "eagle-chain:3"} <= set(ran)
    if "eagle3" not in SPEC_METHODS:  # the guard: an entry for a method the runner lacks is skipped, named
        assert "eagle3-tree" in skipped and "eagle3" in skipped["eagle3-tree"]
    for m in res["methods"]:
        assert m["greedy_outputs_identical"] == "2/2", m
        assert m["tokens_per_target_forward"] == pytest.approx(m["mean_accepted_length"] + 1, abs=1e-3)
        assert 1.0 <= m["tokens_per_target_forward"] <= 1 + (m["num_spec_tokens"] or 3)
        assert m["spec_verifications"] > 0 and len(m["elapsed_s_runs"]) == len(m["no_spec_elapsed_s_runs"]) == 2
        lo, hi = m["speedup_min_max"]
        assert 0 < lo <= m["speedup_median"] <= hi
        assert f"| {m['name']} | {m['spec_mode']} |" in printed
    by = {m["name"]: m for m in res["methods"]}
    assert by["draft-tree"]["spec_tree_topk"] == 2 and by["eagle-chain:3"]["num_spec_tokens"] == 3
    assert res["no_spec"]["output_tokens_per_s"] > 0 and "| no-spec |" in printed


def test_spec_methods_guards(tmp_path, capsys):
    # a spec model that is not there: its method's entries are skipped with the path, the others run
    missing, out = str(tmp_path / "no-such-head"), tmp_path / "spec.json"
    assert main(["bench", "--spec-methods", "eagle-tree,draft-chain", "--spec-method-model", f"eagle={missing}",
                 "--spec-json", str(out)] + TINY) == 0
    res = json.loads(out.read_text())
    assert [m["name"] for m in res["methods"]] == ["draft-chain"]
    assert res["skipped"] == [{"name": "eagle-tree", "reason": f"spec model {missing!r} not found "
                                                               "(pass --spec-method-model eagle=PATH)"}]
    assert "skipping eagle-tree" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown medusa2"):
        main(["bench", "--spec-methods", "medusa,medusa2"] + TINY)
    with pytest.raises(SystemExit, match="are ints"):
        main(["bench", "--spec-methods", "eagle-tree:8:x"] + TINY)
    with pytest.raises(SystemExit, match="METHOD=PATH"):
        main(["bench", "--spec-methods", "medusa", "--spec-method-model", "eagle"] + TINY)
    with pytest.raises(SystemExit, match="drop --preset"):
        main(["bench", "--spec-methods", "medusa", "--draft-model", "x"] + TINY)


def test_every_entry_names_a_method_and_asset():
    for name, (method, asset, kw) in SPEC_ENTRIES.items():
        assert name.split("-")[0] == method and asset.startswith("tiny-llama-") and kw["spec_mode"] in ("chain", "tree")


def test_dflash_entries(tmp_path, capsys):
    """No DFlash drafter ships: the entries are skipped with the path unless --spec-method-model names
    one; a random drafter for the shipped target runs (greedy outputs identical, its own draft size)."""
    from test_spec_dflash import _random_drafter, _save_dflash

    out = tmp_path / "spec.json"
    assert main(["bench", "--spec-methods", "dflash-chain", "--spec-json", str(out)] + TINY) == 0
    res = json.loads(out.read_text())
    assert res["methods"] == [] and "not found" in res["skipped"][0]["reason"]
    head = str(tmp_path / "dflash")
    _save_dflash(head, _random_drafter(1, 1, seed=0, hidden=256, heads=4, kv_heads=2), block_size=4, mask_token_id=3,
                 num_target_layers=5, hidden=256, heads=4, kv_heads=2, vocab=4096)
    assert main(["bench", "--spec-methods", "dflash-chain,dflash-tree:4", "--spec-method-model", f"dflash={head}",
                 "--spec-json", str(out)] + TINY) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert [m["name"] for m in res["methods"]] == ["dflash-chain", "dflash-tree:4"] and not res["skipped"]
    for m in res["methods"]:
        assert m["greedy_outputs_identical"] == "2/2", m
        assert m["spec_verifications"] > 0 and 1.0 <= m["tokens_per_target_forward"] <= 4
        assert f"| {m['name']} | {m['spec_mode']} |" in printed
    # a block of 4 drafts 3 positions (the chain); the default tree's first 4 paths reach depth 2
    assert [len(m["acceptance_rate_per_depth"]) for m in res["methods"]] == [3, 2]
