"""``AsyncLLM`` (the engine thread and its per-request queues) and the static-batching scheduler
option, in process on the shipped tiny model; the offline ``LLM`` is the oracle."""

from __future__ import annotations

import asyncio

import pytest

from fastinfer import LLM, SamplingParams
from fastinfer.engine.async_llm import AsyncLLM, EngineDeadError


def _run(coro, timeout=120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_generate_equals_llm_and_abort_frees_blocks(llm):
    prompts = ["Once upon a time", "import os", "def f(x):", "class A:"]
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    ref = [o.outputs[0].text for o in llm.generate(prompts, sp)]

    async def main():
        engine = AsyncLLM()
        try:
            async def one(i):
                seen = []
                async for out in engine.generate(prompts[i], sp, f"r{i}"):
                    seen.append(out)
                assert seen[-1].finished and all(not o.finished for o in seen[:-1])
                texts = [o.outputs[0].text for o in seen]
                assert all(texts[-1].startswith(t) for t in texts)  # cumulative
                return seen[-1].outputs[0].text

            texts = await asyncio.gather(*[one(i) for i in range(len(prompts))])
            with pytest.raises(ValueError, match="duplicate"):
                g1 = engine.generate("x", sp, "dup")
                await g1.__anext__()
                await engine.generate("x", sp, "dup").__anext__()
            await g1.aclose()

            # abort(): the stream ends without a finished output; aclose() of another aborts it too
            long = SamplingParams(max_tokens=800, ignore_eos=True)
            ga, gb = engine.generate("a", long, "A"), engine.generate("b", long, "B")
            await ga.__anext__()
            await gb.__anext__()
            engine.abort("A")
            rest = [o async for o in ga]
            assert all(not o.finished for o in rest)
            await gb.aclose()
            for _ in range(200):
                st = engine.stats()
                if st["num_free_blocks"] == st["num_kv_blocks"] and st["num_unfinished_requests"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert st["num_free_blocks"] == st["num_kv_blocks"]
            assert st["num_unfinished_requests"] == 0 and st["num_registered_requests"] == 0
            return texts
        finally:
            engine.shutdown()

    assert _run(main()) == ref


def test_shutdown_fails_open_streams():
    async def main():
        engine = AsyncLLM()
        g = engine.generate("a", SamplingParams(max_tokens=800, ignore_eos=True), "s")
        await g.__anext__()
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in g:
                pass
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.generate("a", SamplingParams(), "t").__anext__()

    _run(main())


def test_static_batching_admits_only_into_a_forming_batch(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    static = LLM(static_batching=True, max_num_seqs=2)
    sched = static.engine_core.scheduler
    static.add_request("first batch a", sp, "a")
    static.add_request("first batch b", sp, "b")
    static.add_request("waits for the next batch", sp, "c")
    outs = {}
    static.step()
    assert [s.request.request_id for s in sched.running] == ["a", "b"] and len(sched.waiting) == 1
    static.step()  # "a" and "b" decode; "c" would fit after either finishes, but the batch is closed
    static.add_request("arrives later", sp, "d")
    while sched.running:
        assert {s.request.request_id for s in sched.waiting} == {"c", "d"}
        for o in static.step():
            outs[o.request_id] = o
    for o in static.step():  # the next batch: c and d together
        outs[o.request_id] = o
    assert sorted(s.request.request_id for s in sched.running) == ["c", "d"]
    while static.has_unfinished_requests():
        for o in static.step():
            outs[o.request_id] = o
    # the same texts as continuous batching
    texts = {r: outs[r].outputs[0].text for r in "abcd"}
    ref = llm.generate(["first batch a", "first batch b", "waits for the next batch", "arrives later"], sp)
    assert [texts[r] for r in "abcd"] == [o.outputs[0].text for o in ref]
    # continuous batching admits "c" as soon as a slot frees
    cont = LLM(max_num_seqs=2)
    for i, p in enumerate(["x", "y y y"]):
        cont.add_request(p, SamplingParams(temperature=0.0, max_tokens=2 + 6 * i, ignore_eos=True), f"p{i}")
    cont.add_request("z", sp, "z")
    for _ in range(4):
        cont.step()
    assert "z" in [s.request.request_id for s in cont.engine_core.scheduler.running]
