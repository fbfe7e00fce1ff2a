"""Tensor parallelism on this CPU: 2 ranks (rank 0 here + one spawned worker), gloo over 127.0.0.1.

TP=2 must equal TP=1: float32 logits of a prefill (every row) and a decode step within 1e-5
relative norm, and identical greedy tokens, on random Llama (GQA 4/2), Mistral (sliding window,
one KV head: replicated on both ranks), Qwen2 (qkv bias, tied embeddings) checkpoints written by
transformers, on the shipped model, with fp8 and int4 quantisation (on load, GPTQ act-order, and
compressed-tensors checkpoints written by that package), with speculative decoding and forced
preemption, and through ``torchrun`` (2 processes). Each rank must hold only its shard.
Faults: a killed worker and a hung one give a clear error on rank 0 within 10 s; shutdown leaves no
process, port or shared-memory segment behind; two engines run side by side on one host.

Every engine is shut down at teardown even when a test fails; collectives have deadlines, so a
hung worker fails a test instead of hanging it. ``-m cuda`` tests (NCCL) skip with fewer than 2
GPUs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("transformers")

import fastinfer  # noqa: E402
from fastinfer import LLM, SamplingParams  # noqa: E402
from fastinfer.engine.model_runner import Chunk, ForwardPlan  # noqa: E402
from fastinfer.engine.workers import TensorParallelError  # noqa: E402
from model_helpers import plan_logits as _plan_logits  # noqa: E402
from model_helpers import make_hf_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "python", "fastinfer", "assets")
TP = 2
REL_TOL = 1e-5
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

CASES = {
    "llama": ("llama", dict(tie_word_embeddings=False)),  # GQA 4/2
    "mistral": ("mistral", dict(sliding_window=24, num_key_value_heads=1)),  # window < prompt; KV head replicated
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=40,
                            max_window_layers=1)),  # qkv bias, tied
}


def _pythonpath() -> str:
    """PYTHONPATH for a child process: the directory of the fastinfer this test imported (the
    installed wheel in a clean clone, python/ in a development tree), then the caller's."""
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(fastinfer.__file__)))
    return os.pathsep.join([pkg_root, os.environ.get("PYTHONPATH", "")])


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # rank 0; each worker gets cores // 2


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            kind, over = CASES[name]
            path = tmp_path_factory.mktemp(name)
            make_hf_model(kind, seed=len(cache) + 3, **over).save_pretrained(path)
            cache[name] = str(path)
        return cache[name]

    return get


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _port_free(port: int) -> bool:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _check_equal(tp1, tp2, prompts, vocab):
    a, b = _plan_logits(tp1, prompts[0]), _plan_logits(tp2, prompts[0])
    assert a.shape == b.shape == (len(prompts[0]) + 1, vocab)
    assert _rel(b, a) < REL_TOL, _rel(b, a)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    ref = [o.outputs[0].token_ids for o in tp1.generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in tp2.generate(prompts, GREEDY)]
    assert got == ref
    return _rel(b, a)


def _prompts(vocab, n=3, length=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length - 7 * i,), generator=g).tolist() for i in range(n)]


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_tp2_equals_tp1_random_models(ckpts, engines, name):
    path = ckpts(name)
    tp1 = engines(path, num_kv_blocks=32)
    tp2 = engines(path, num_kv_blocks=32, tensor_parallel_size=TP)
    c = tp1.model.config
    m = tp2.model  # rank 0's shard
    hkv_local = max(1, c.num_key_value_heads // TP)
    assert m.layers[0].qkv_proj.weight.shape[0] == (c.num_attention_heads // TP + 2 * hkv_local) * c.head_dim
    assert m.layers[0].o_proj.weight.shape[1] == c.num_attention_heads * c.head_dim // TP
    assert m.layers[0].down_proj.weight.shape[1] == c.intermediate_size // TP
    assert m.embed_tokens.weight.shape[0] == 384 // TP  # 300 padded to a multiple of 64 * 2
    assert tp2.executor.kv_caches[0][0].shape[2] == hkv_local
    prompts = _prompts(c.vocab_size)
    _check_equal(tp1, tp2, prompts, c.vocab_size)
    again = [prompts[0] + [7, 8, 9]]  # a prefix-cache hit: the table starts with cached blocks
    assert ([o.outputs[0].token_ids for o in tp2.generate(again, GREEDY)]
            == [o.outputs[0].token_ids for o in tp1.generate(again, GREEDY)])
    assert tp2.stats()["prefix_cache_hits"] > 0


def test_tp2_equals_tp1_shipped_model_spec_decoding_and_preemption(engines):
    """The shipped model: logits; then, with the shipped draft (tree mode: rank 0 drafts, every rank
    verifies) and a KV pool small enough to force preemption, identical greedy completions."""
    tp1 = engines(num_kv_blocks=64)
    tp2 = engines(num_kv_blocks=64, tensor_parallel_size=TP)
    _check_equal(tp1, tp2, [list(range(5, 60))], 4096)
    tp2.shutdown()
    kw = dict(draft_model=os.path.join(ASSETS, "tiny-llama-draft"), spec_mode="tree", num_spec_tokens=6,
              num_kv_blocks=10, max_num_seqs=8)
    prompts = ["def fibonacci(n):", "import os\nimport sys", "class Stack:", "for i in range(10):",
               "while True:", "x = [", "print(", "return None"]
    sp = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, speculative=(i % 3 != 2))
          for i in range(len(prompts))]
    a = engines(**kw)
    b = engines(tensor_parallel_size=TP, **kw)
    ref = [o.outputs[0].token_ids for o in a.generate(prompts, sp)]
    got = [o.outputs[0].token_ids for o in b.generate(prompts, sp)]
    assert got == ref
    st = b.stats()
    assert st["num_preemptions"] > 0 and st["spec_num_accepted_tokens"] > 0, st
    assert st["num_preemptions"] == a.stats()["num_preemptions"]


@pytest.mark.parametrize("quant", ["fp8", "int4", "int8", "nvfp4", "mxfp4"])
def test_tp2_equals_tp1_quantised(ckpts, engines, quant):
    path = ckpts("llama")
    qc = {"group_size": 64} if quant == "int4" else None
    tp1 = engines(path, num_kv_blocks=32, quantization=quant, quantization_config=qc)
    tp2 = engines(path, num_kv_blocks=32, quantization=quant, quantization_config=qc, tensor_parallel_size=TP)
    method = "Fp4" if quant in ("nvfp4", "mxfp4") else quant.capitalize()
    assert type(tp2.model.layers[0].down_proj.method).__name__ == f"{method}LinearMethod"
    _check_equal(tp1, tp2, _prompts(300, n=2), 300)


@pytest.mark.parametrize("scheme", ["FP8_BLOCK", "W4A16_ASYM", "FP8_DYNAMIC", "W8A8", "W8A8-asym-activations",
                                    "NVFP4A16"])
def test_tp2_equals_tp1_compressed_tensors(engines, tmp_path, scheme):
    """Checkpoints written by the compressed-tensors package (128 x 128 fp8 blocks, int4 groups of
    128 with zero points, fp8 per channel with dynamic per-token activations, int8 per channel with
    dynamic per-token symmetric or asymmetric activations: a row-parallel shard quantises with the
    whole row's scale and zero point; NVFP4 e2m1 with e4m3 scales per 16 on fp4_gemm), MHA 4/4 so
    every rank's K/V rows are whole 128-row blocks."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    from ct_helpers import compress

    if scheme == "W8A8-asym-activations":
        groups = {"group_0": QuantizationScheme(
            targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True),
            input_activations=QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True,
                                               symmetric=False))}
    else:
        groups = {"group_0": preset_name_to_scheme(scheme, ["Linear"])}
    model = make_hf_model("llama", seed=11, num_key_value_heads=4, tie_word_embeddings=False)
    path, _, _ = compress(model, groups, ["lm_head"], str(tmp_path / scheme), None, dequantised=False)
    tp1 = engines(path, num_kv_blocks=32)
    tp2 = engines(path, num_kv_blocks=32, tensor_parallel_size=TP)
    assert tp2.model.layers[0].down_proj.in_features == 128
    if scheme == "NVFP4A16":  # whole 64 x 16 tiles on each rank: fp4_gemm, not the dequantised fallback
        methods = [type(m.method).__name__ for m in tp2.model.layers[0].modules() if hasattr(m, "method")]
        assert methods and set(methods) == {"Fp4LinearMethod"}, methods
    _check_equal(tp1, tp2, _prompts(300, n=2), 300)


def _gptq_checkpoint(float_path: str, dst: str, act_order_on) -> str:
    """A GPTQ v1 (4-bit, group 64) checkpoint of ``float_path``; the projections named in
    ``act_order_on`` get a random act-order ``g_idx``."""
    from safetensors.torch import load_file, save_file

    from fastinfer import reference as ref

    src = load_file(os.path.join(float_path, "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    out = {}
    for name, w in src.items():
        proj = name[: -len(".weight")]
        if not name.endswith("_proj.weight"):
            out[name] = w
            continue
        n, k = w.shape
        groups = torch.arange(k) // 64
        if proj.rsplit(".", 1)[-1] in act_order_on:
            groups = groups[torch.randperm(k, generator=gen)]
        order = torch.argsort(groups, stable=True)
        q_sorted, sc, z = ref.quantize_int4(w[:, order], 64, symmetric=False)
        q = torch.empty_like(q_sorted)
        q[:, order] = q_sorted
        out[proj + ".qweight"], out[proj + ".qzeros"] = ref.gptq_pack(q, z)
        out[proj + ".scales"] = sc.to(torch.float16)
        out[proj + ".g_idx"] = groups.to(torch.int32)
    os.makedirs(dst, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(float_path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": bool(act_order_on),
                                  "sym": False, "checkpoint_format": "gptq"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_tp2_equals_tp1_gptq_act_order_columns_and_refuses_it_on_rows(ckpts, engines, tmp_path):
    """GPTQ act-order on column-parallel projections (q/k/v, gate/up: the permutation is over the
    unsplit input) shards; on a row-parallel one (down_proj) it is refused, naming the layer."""
    path = _gptq_checkpoint(ckpts("llama"), str(tmp_path / "cols"), ("q_proj", "k_proj", "v_proj", "gate_proj",
                                                                     "up_proj"))
    tp1 = engines(path, num_kv_blocks=32)
    tp2 = engines(path, num_kv_blocks=32, tensor_parallel_size=TP)
    assert tp2.model.layers[0].qkv_proj.perm0 is not None
    _check_equal(tp1, tp2, _prompts(300, n=2), 300)
    rows = _gptq_checkpoint(ckpts("llama"), str(tmp_path / "rows"), ("down_proj",))
    with pytest.raises(ValueError, match=r"mlp\.down_proj: act-order int4 weights .*tensor_parallel_size=2"):
        LLM(rows, num_kv_blocks=8, tensor_parallel_size=TP)


def test_int4_group_size_that_does_not_divide_the_shard_is_refused(ckpts):
    """o_proj has 256 input features, 128 per rank: group size 256 cannot split (TP=1 pads it)."""
    before = _children()
    with pytest.raises(ValueError, match=r"o_proj.*group size 256.*128 input features.*tensor_parallel_size=2"):
        LLM(ckpts("llama"), num_kv_blocks=8, quantization="int4", quantization_config={"group_size": 256},
            tensor_parallel_size=TP)
    _wait_gone(_children() - before)


def _children():
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children()}


def _wait_gone(pids, within=10.0):
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), pids


# ------------------------------------------------------------------------------------------------
def test_faults_two_engines_killed_and_hung_workers(ckpts, engines, monkeypatch):
    """Two engines side by side; killing A's worker fails A within 10 s with a clear error and B
    keeps working; a hung (stopped) worker of B fails B within 10 s (3 s collective deadline);
    shutdown leaves no process, port or /dev/shm entry."""
    monkeypatch.setenv("FASTINFER_TP_TIMEOUT", "3")
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    path = ckpts("llama")
    a = engines(path, num_kv_blocks=16, tensor_parallel_size=TP)
    b = engines(path, num_kv_blocks=16, tensor_parallel_size=TP)
    ports = [e.executor.runner._state["store"].port for e in (a, b)]
    assert ports[0] != ports[1]
    pids = a.executor.runner.worker_pids + b.executor.runner.worker_pids
    assert len(set(pids)) == 2
    prompt = _prompts(300, n=1)
    ref = a.generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert b.generate(prompt, GREEDY)[0].outputs[0].token_ids == ref

    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"worker rank 1 \(pid \d+\) died \(killed by SIGKILL\)"):
        a.generate(prompt, GREEDY)
    assert time.monotonic() - t0 < 10
    with pytest.raises(TensorParallelError, match="has stopped"):
        a.generate(prompt, GREEDY)
    assert b.generate(prompt, GREEDY)[0].outputs[0].token_ids == ref  # the other engine is untouched

    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"worker rank 1 \(pid \d+\) is alive but did not answer"):
        b.generate(prompt, GREEDY)
    assert time.monotonic() - t0 < 10
    for e in (a, b):
        e.shutdown()
        e.shutdown()  # idempotent
    _wait_gone(pids)
    assert all(_port_free(p) for p in ports)
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) <= shm_before


def test_workers_exit_when_rank0_is_killed(tmp_path):
    """Rank 0 killed outright (no shutdown runs): its worker notices (reset connection / parent
    watch) and exits within seconds."""
    code = ("import os, sys, time, torch; torch.set_num_threads(1)\n"
            "from fastinfer import LLM\n"
            "if __name__ == '__main__':\n"
            "    llm = LLM(num_kv_blocks=16, tensor_parallel_size=2)\n"
            "    print(llm.executor.runner.worker_pids[0], flush=True)\n"
            "    time.sleep(120)\n")
    script = tmp_path / "rank0.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert line.strip().isdigit(), line
        worker = int(line)
        assert _alive(worker)
    finally:
        p.kill()
        p.wait(10)
    _wait_gone([worker], within=10.0)


def test_step_messages_send_only_what_changed(ckpts, engines):
    """A decode step crossing no block boundary sends (seq id, token, position) per sequence: a few
    dozen bytes, one 4 KiB frame; a prefill sends its tokens and tables."""
    llm = engines(ckpts("llama"), num_kv_blocks=32, tensor_parallel_size=TP)
    ch, comm = llm.executor.runner.ctrl, llm.executor.runner.tp.comm
    llm.add_request(list(range(3, 23)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    llm.add_request(list(range(30, 50)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    sizes, counts = [], []
    while llm.has_unfinished_requests():
        before = (ch.bytes_sent, comm.num_collectives, comm.bytes_all_reduced, comm.bytes_gathered)
        llm.step()
        sizes.append(ch.bytes_sent - before[0])
        counts.append((comm.num_collectives - before[1], comm.bytes_all_reduced - before[2],
                       comm.bytes_gathered - before[3]))
    assert sizes[0] > 80  # the two prompts and their block tables
    assert max(sizes[1:]) < 120, sizes  # decode steps: two (id, token, position) triples
    # bench/tp.py's formula for a decode step of 2 rows (float32): 1 + 2 x 2 layers all-reduces of
    # 2 x 128 x 4 bytes, one gather of 2 rows x 384 / 2 x 4 bytes (vocabulary 300 padded to 384)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from tp import computed
    finally:
        sys.path.pop(0)
    want = computed(dict(hidden_size=128, num_hidden_layers=2, vocab_size=300), TP, 2, act_bytes=4)
    assert want == dict(all_reduces=5, all_reduce_bytes=5 * 1024, gathers=1, gather_bytes=1536)
    assert set(counts[1:]) == {(6, 5 * 1024, 1536)}, counts


def test_safetensors_reader_reads_a_ranks_slice():
    """A rank reads only its rows / columns of a memory-mapped tensor (safetensors slices), the same
    values as cutting the whole tensor."""
    from fastinfer.layers import SafetensorsReader

    r = SafetensorsReader(os.path.join(ASSETS, "tiny-llama"))
    name = "model.layers.0.mlp.down_proj.weight"  # [256, 704]
    whole = r.get(name)
    assert torch.equal(r.get(name, (256, 704), rows=(128, 128)), whole[128:])
    assert torch.equal(r.get_float(name, cols=(352, 352)), whole[:, 352:])
    assert torch.equal(r.get(name, rows=(64, 64), cols=(0, 352)), whole[64:128, :352])
    with pytest.raises(ValueError, match="expected"):
        r.get(name, (704, 256), rows=(0, 1))


def test_plan_codec_block_table_deltas():
    """The worker's mirror follows appends, trims (speculative), replacements (preemption, then a
    new table) and forgets finished sequences; unchanged tables are not sent."""
    import pickle

    from fastinfer.engine.worker import PlanDecoder, PlanEncoder

    enc, dec = PlanEncoder(), PlanDecoder()
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    steps = [
        ForwardPlan(chunks=[Chunk(7, [1, 2, 3], 0)], tables={7: [4, 5]}),
        ForwardPlan(decodes=[(7, 9, 3)], tables={7: [4, 5]}),  # unchanged: nothing sent
        ForwardPlan(decodes=[(7, 9, 32)], tables={7: [4, 5, 6]}),  # append
        ForwardPlan(trees=[Chunk(7, [9, 10, 11], 33, "all", [33, 34, 34], mask)], tables={7: [4, 5]}),  # trim
        ForwardPlan(chunks=[Chunk(7, [1] * 20, 0)], tables={7: [8, 2]}, moves=([1], [2])),  # re-prefill
        ForwardPlan(decodes=[(8, 1, 0)], tables={8: [3]}, finished=[7]),
    ]
    sizes = []
    for plan in steps:
        msg = pickle.loads(pickle.dumps(enc.encode(plan, plan.moves)))
        sizes.append(len(msg[3]))
        got = dec.decode(msg)
        assert got.tables == plan.tables and got.decodes == plan.decodes
        for a, b in zip(got.chunks + got.trees, plan.chunks + plan.trees):
            assert (a.seq_id, a.tokens, a.start, a.logits, a.positions) == (b.seq_id, b.tokens, b.start, b.logits,
                                                                            b.positions)
            assert (a.mask is None and b.mask is None) or torch.equal(a.mask, b.mask)
        assert list(map(list, got.moves)) == list(map(list, plan.moves))
    assert sizes == [1, 0, 1, 1, 1, 1]
    assert 7 not in dec.tables and 7 not in enc.sent


# ------------------------------------------------------------------------------------------------
def test_torchrun_two_processes(tmp_path):
    """``torchrun --nproc-per-node 2 -m fastinfer generate``: rank 0 drives, rank 1 becomes the
    worker; the tokens are the in-process TP=1 engine's."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to the interpreter")
    prompt = "def fibonacci(n):"
    env = dict(os.environ, PYTHONPATH=_pythonpath(), OMP_NUM_THREADS="1", FASTINFER_TP_THREADS="1")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "-m", "fastinfer",
           "generate", "--prompt", prompt, "--max-tokens", "10", "--json", "--ignore-eos",
           "--dtype", "float32"]  # the in-process engine's (dtype auto depends on the CPU)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout[out.stdout.index("["):])[0]["outputs"][0]["token_ids"]
    ref = LLM(num_kv_blocks=64).generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert got == ref[0].outputs[0].token_ids


# ------------------------------------------------------------------------------------------------
def _two_gpus():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.cuda
@pytest.mark.parametrize("eager", [True, False])
def test_nccl_tp2_equals_tp1(ckpts, engines, eager):
    """NCCL, one GPU per rank, with and without decode CUDA graphs (bf16: tokens must agree, logits
    within bf16 rounding)."""
    if not _two_gpus():
        pytest.skip("needs 2 GPUs")
    path = ckpts("llama")
    tp1 = engines(path, device="cuda", num_kv_blocks=64, enforce_eager=eager)
    tp2 = engines(path, device="cuda", num_kv_blocks=64, enforce_eager=eager, tensor_parallel_size=TP)
    prompts = _prompts(300)
    a, b = _plan_logits(tp1, prompts[0]), _plan_logits(tp2, prompts[0])
    assert _rel(b, a) < 2e-2
    ref = [o.outputs[0].token_ids for o in tp1.generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in tp2.generate(prompts, GREEDY)]
    agree = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g)) / sum(len(r) for r in ref)
    assert agree > 0.9, (ref, got)
