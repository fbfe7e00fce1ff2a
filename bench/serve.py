"""Load generator for ``fastinfer serve`` (any OpenAI-compatible /v1/completions server).

Replays a bounded number of requests (token-id prompts, ``ignore_eos`` so every request generates
exactly the tokens it asks for) over async HTTP (aiohttp, SSE streams), with Poisson arrivals at a
given rate or all at once (``--request-rate inf``), and reports request / output-token throughput and
TTFT, TPOT (per request: (e2e - ttft) / (output tokens - 1)), ITL (gaps between stream chunks) and
end-to-end latency: mean, p50, p90, p99, in ms.

    python bench/serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 8 --json out.json
    python bench/serve.py --compare --json bench/results/serve-$(hostname).json     # launches the servers

Workloads: ``mixed`` (input lengths uniform in [--input-min, --input-max], output lengths long-tailed
in [--output-min, --output-max]: most short, a few long) and ``shared-prefix`` (one long system
prompt of --prefix-len tokens + a short unique suffix per request: the agent workload).

``--compare`` starts ``fastinfer serve`` itself (the same engine options each time, ``--server-args``
added) and runs, in one go: (1) continuous vs static batching (``--static-batching``: a new batch is
admitted only when the previous one finished) on the mixed workload, all requests at once; the
throughput ratio is the figure; (2) the mixed workload at two Poisson rates (``--rates``) on the
continuous server: TTFT / TPOT percentiles; (3) the shared-prefix workload with prefix caching on vs
off (``--no-enable-prefix-caching``): TTFT. The two servers of a comparison run side by side and their
loads alternate ``--repeats`` times (fresh requests each time): the figures are median ratios. For
batching also the engine steps (forward passes) each mode needed for the same tokens: the
throughput ratio where a step's time does not grow with the batch (a GPU below its compute bound),
and deterministic, unlike a shared CPU's wall clock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class Req:
    prompt: List[int]
    max_tokens: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: List[float] = field(default_factory=list)


# ---- workloads ----------------------------------------------------------------------------------
def mixed_workload(n: int, vocab: int, input_min: int, input_max: int, output_min: int, output_max: int,
                   seed: int) -> List[Req]:
    """Inputs uniform; outputs long-tailed (log-uniform): most requests short, a few long."""
    r = random.Random(seed)
    reqs = []
    for _ in range(n):
        p = r.randint(input_min, input_max)
        o = int(round(math.exp(r.uniform(math.log(output_min), math.log(output_max)))))
        reqs.append(Req([r.randrange(10, vocab) for _ in range(p)], o))
    return reqs


def shared_prefix_workload(n: int, vocab: int, prefix_len: int, suffix_len: int, output_len: int,
                           seed: int) -> List[Req]:
    r = random.Random(seed)
    prefix = [r.randrange(10, vocab) for _ in range(prefix_len)]
    return [Req(prefix + [r.randrange(10, vocab) for _ in range(suffix_len)], output_len) for _ in range(n)]


# ---- the client ---------------------------------------------------------------------------------
async def one_request(session, url: str, model: str, req: Req, headers: Dict[str, str]) -> Result:
    import aiohttp

    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    t0 = time.perf_counter()
    last = t0
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for data in resp.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[6:]
                    if payload == b"[DONE]":
                        continue
                    msg = json.loads(payload)
                    if "error" in msg:
                        res.error = msg["error"].get("message", "error")
                        return res
                    now = time.perf_counter()
                    if msg.get("choices"):
                        if res.ttft == 0.0:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                    if msg.get("usage"):
                        res.output_tokens = msg["usage"]["completion_tokens"]
                        res.prompt_tokens = msg["usage"]["prompt_tokens"]
        res.e2e = time.perf_counter() - t0
        res.ok = res.ttft > 0.0
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(base_url: str, model: str, reqs: List[Req], rate: float, seed: int = 0,
                   max_concurrency: Optional[int] = None, timeout: float = 600.0,
                   api_key: Optional[str] = None) -> Dict:
    """Send ``reqs`` (Poisson arrivals at ``rate`` per second; inf: all at once) and summarise."""
    import aiohttp

    r = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    conn = aiohttp.TCPConnector(limit=max_concurrency or len(reqs) or 1)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async def go(req: Req) -> Result:
            if sem is None:
                return await one_request(session, url, model, req, headers)
            async with sem:
                return await one_request(session, url, model, req, headers)

        tasks = []
        t0 = time.perf_counter()
        for req in reqs:
            tasks.append(asyncio.ensure_future(go(req)))
            if rate != float("inf"):
                await asyncio.sleep(r.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return summarize(results, duration, rate, reqs)


def _pcts(xs: List[float]) -> Dict[str, float]:
    if not xs:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    s = sorted(xs)

    def q(p: float) -> float:  # linear interpolation, numpy's default
        k = (len(s) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return (s[lo] + (s[hi] - s[lo]) * (k - lo)) * 1e3

    return {"mean": sum(s) / len(s) * 1e3, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(results: List[Result], duration: float, rate: float, reqs: List[Req]) -> Dict:
    ok = [x for x in results if x.ok]
    out_tokens = sum(x.output_tokens for x in ok)
    tpot = [(x.e2e - x.ttft) / (x.output_tokens - 1) for x in ok if x.output_tokens > 1]
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({x.error for x in results if not x.ok})[:5],
        "request_rate": rate if rate != float("inf") else "inf", "duration_s": duration,
        "requested_output_tokens": sum(q.max_tokens for q in reqs),
        "prompt_tokens": sum(x.prompt_tokens for x in ok), "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "ttft_ms": _pcts([x.ttft for x in ok]), "tpot_ms": _pcts(tpot),
        "itl_ms": _pcts([g for x in ok for g in x.itl]), "e2e_ms": _pcts([x.e2e for x in ok]),
    }


# ---- servers for --compare ----------------------------------------------------------------------
class Server:
    """``fastinfer serve`` on a free loopback port; stopped (process group) on exit."""

    def __init__(self, args: List[str], startup_timeout: float = 300.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "fastinfer.entrypoints.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server not healthy in time")
            time.sleep(0.2)

    def model(self) -> Dict:
        with urllib.request.urlopen(self.base_url + "/v1/models", timeout=10) as r:
            return json.loads(r.read())["data"][0]

    def engine_steps(self) -> float:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("fastinfer:engine_steps_total"):
                    return float(line.rsplit(" ", 1)[1])
        return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def compare(a) -> Dict:
    """The three comparisons. The servers of a comparison run side by side (an idle one costs
    nothing) and their loads alternate, ``--repeats`` times with a fresh workload each time (no
    prefix-cache hits across repetitions): on a shared machine the pairs see the same conditions.
    The figures are the medians of the per-repetition ratios."""
    base = a.server_args.split() if a.server_args else []
    if a.model:
        base = [a.model] + base
    inf = float("inf")
    out: Dict = {"config": {k: v for k, v in vars(a).items()}, "label": "CPU"}

    def mixed(k: int) -> List[Req]:
        return mixed_workload(a.num_prompts, a.vocab, a.input_min, a.input_max, a.output_min, a.output_max,
                              a.seed + 1000 * k)

    def shared(k: int) -> List[Req]:  # the same system prompt, fresh suffixes
        reqs = shared_prefix_workload(a.prefix_prompts, a.vocab, a.prefix_len, a.suffix_len, a.prefix_output, a.seed)
        sfx = random.Random(a.seed + 1000 * k + 1)
        for q in reqs:
            q.prompt[a.prefix_len:] = [sfx.randrange(10, a.vocab) for _ in range(a.suffix_len)]
        return reqs

    def load(server: Server, reqs: List[Req], rate: float) -> Dict:
        name = server.model()["id"]
        steps = server.engine_steps()
        res = asyncio.run(run_load(server.base_url, name, reqs, rate, seed=a.seed, timeout=a.timeout))
        res["engine_steps"] = server.engine_steps() - steps
        return res

    def median(xs: List[float]) -> float:
        s = sorted(xs)
        return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2

    # (1) continuous vs static batching, all at once; (2) two arrival rates on the continuous server
    with Server(base) as cont, Server(base + ["--static-batching"]) as stat:
        for s in (cont, stat):
            load(s, mixed(99)[:4], inf)  # warm-up
        reps = []
        for r in range(a.repeats):
            c, st = load(cont, mixed(r), inf), load(stat, mixed(r), inf)
            reps.append({"continuous": c, "static": st,
                         "ratio": c["output_throughput"] / st["output_throughput"],
                         "steps_ratio": st["engine_steps"] / c["engine_steps"]})
        for i, rate in enumerate(a.rates):
            out[f"continuous_rate_{rate:g}"] = load(cont, mixed(50 + i), rate)
    out["batching_repeats"] = reps
    out["continuous_over_static_throughput"] = median([x["ratio"] for x in reps])
    # the same tokens in fewer forward passes: the throughput ratio where a step's time does not grow
    # with the batch (a GPU below its compute bound); deterministic, unlike the CPU wall clock
    out["static_over_continuous_engine_steps"] = median([x["steps_ratio"] for x in reps])
    mid = min(reps, key=lambda x: abs(x["ratio"] - out["continuous_over_static_throughput"]))
    out["continuous"], out["static"] = mid["continuous"], mid["static"]
    # (3) shared long system prompt: prefix caching on vs off
    with Server(base) as on, Server(base + ["--no-enable-prefix-caching"]) as off:
        for s in (on, off):
            load(s, shared(99)[:1], inf)  # warm-up; with caching, the system prompt enters the cache
        reps = []
        for r in range(a.repeats):
            x, y = load(on, shared(r), a.prefix_rate), load(off, shared(r), a.prefix_rate)
            reps.append({"prefix_cache_on": x, "prefix_cache_off": y,
                         "ratio": y["ttft_ms"]["p50"] / x["ttft_ms"]["p50"]})
    out["prefix_repeats"] = reps
    out["prefix_cache_ttft_p50_off_over_on"] = median([x["ratio"] for x in reps])
    mid = min(reps, key=lambda x: abs(x["ratio"] - out["prefix_cache_ttft_p50_off_over_on"]))
    out["prefix_cache_on"], out["prefix_cache_off"] = mid["prefix_cache_on"], mid["prefix_cache_off"]
    return out


def _line(name: str, r: Dict) -> str:
    t, p, i, e = r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["e2e_ms"]
    return (f"{name:24s} {r['completed']:3d}/{r['num_requests']:<3d} {r['output_throughput']:7.1f} tok/s  "
            f"TTFT p50/p90/p99 {t['p50']:7.1f}/{t['p90']:7.1f}/{t['p99']:7.1f}  TPOT p50/p99 {p['p50']:6.1f}/"
            f"{p['p99']:6.1f}  ITL p50/p99 {i['p50']:6.1f}/{i['p99']:6.1f}  "
            f"E2E p50/p99 {e['p50']:7.1f}/{e['p99']:7.1f}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=None, help="server to load (default: none; --compare launches its own)")
    ap.add_argument("--model", default=None, help="model name to send / to serve with --compare (default: the "
                                                  "server's first model / the shipped model)")
    ap.add_argument("--api-key", default=None, help="Bearer token for the server (default: none)")
    ap.add_argument("--compare", action="store_true", help="launch servers and run the three comparisons")
    ap.add_argument("--server-args", default="--max-num-seqs 8",
                    help="extra `fastinfer serve` options for --compare (default: '--max-num-seqs 8')")
    ap.add_argument("--workload", choices=["mixed", "shared-prefix"], default="mixed",
                    help="without --compare: which workload (default: mixed)")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests of the mixed workload (default: 64)")
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="without --compare: Poisson arrivals per second; inf = all at once (default: inf)")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[4.0, 16.0],
                    help="--compare: the two arrival rates, req/s (default: 4,16)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    ap.add_argument("--input-min", type=int, default=16, help="mixed: shortest prompt, tokens (default: 16)")
    ap.add_argument("--input-max", type=int, default=128, help="mixed: longest prompt, tokens (default: 128)")
    ap.add_argument("--output-min", type=int, default=4, help="mixed: shortest output, tokens (default: 4)")
    ap.add_argument("--output-max", type=int, default=96, help="mixed: longest output, tokens (default: 96)")
    ap.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt tokens (default: 512)")
    ap.add_argument("--suffix-len", type=int, default=16, help="shared-prefix: unique tokens each (default: 16)")
    ap.add_argument("--prefix-output", type=int, default=8, help="shared-prefix: output tokens (default: 8)")
    ap.add_argument("--prefix-prompts", type=int, default=32, help="shared-prefix: requests (default: 32)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="--compare: alternating repetitions of each comparison (default: 5)")
    ap.add_argument("--prefix-rate", type=float, default=2.0, help="shared-prefix: arrivals/s (default: 2)")
    ap.add_argument("--vocab", type=int, default=4000,
                    help="prompt token ids are drawn from [10, VOCAB); the shipped model has 4096 (default: 4000)")
    ap.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: 0)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds (default: 600)")
    ap.add_argument("--json", default=None, help="write the results here (default: print only)")
    a = ap.parse_args(argv)
    if a.compare:
        res = compare(a)
        for k in ["continuous", "static"] + [f"continuous_rate_{r:g}" for r in a.rates] + \
                 ["prefix_cache_on", "prefix_cache_off"]:
            print(_line(k, res[k]))
        b = ", ".join(f"{x['ratio']:.2f}" for x in res["batching_repeats"])
        q = ", ".join(f"{x['ratio']:.2f}" for x in res["prefix_repeats"])
        print(f"continuous / static output throughput: {res['continuous_over_static_throughput']:.2f}x "
              f"(repetitions: {b}); engine steps static / continuous: "
              f"{res['static_over_continuous_engine_steps']:.2f}x; prefix cache TTFT p50 off / on: "
              f"{res['prefix_cache_ttft_p50_off_over_on']:.2f}x (repetitions: {q}) (CPU; medians)")
    else:
        if a.base_url is None:
            ap.error("give --base-url (a running server) or --compare")
        if a.workload == "mixed":
            reqs = mixed_workload(a.num_prompts, a.vocab, a.input_min, a.input_max, a.output_min, a.output_max, a.seed)
        else:
            reqs = shared_prefix_workload(a.num_prompts, a.vocab, a.prefix_len, a.suffix_len, a.prefix_output, a.seed)
        model = a.model
        if model is None:
            req = urllib.request.Request(a.base_url.rstrip("/") + "/v1/models",
                                         headers={"Authorization": f"Bearer {a.api_key}"} if a.api_key else {})
            with urllib.request.urlopen(req, timeout=30) as r:
                model = json.loads(r.read())["data"][0]["id"]
        res = asyncio.run(run_load(a.base_url, model, reqs, a.request_rate, a.seed, a.max_concurrency, a.timeout,
                                   a.api_key))
        res["workload"] = a.workload
        print(_line(a.workload, res))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if (a.compare or res["failed"] == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
