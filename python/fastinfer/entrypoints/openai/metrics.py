"""``GET /metrics``: Prometheus text (``prometheus_client``), names as vLLM's with a ``fastinfer:`` prefix.

Per request, observed when it ends: ``time_to_first_token_seconds``, ``time_per_output_token_seconds``
(the request's mean gap between output tokens after the first), ``e2e_request_latency_seconds``,
``request_queue_time_seconds`` (arrival -> the first engine step that computed any of its tokens),
``prompt_tokens_total`` / ``generation_tokens_total`` and ``request_success_total{finished_reason}``
(one per engine request, i.e. per prompt; the reason of its first completion)
(or ``request_aborted_total`` for a client that left); ``request_rejected_total``: /v1 requests
refused with an error status. Read from the engine at scrape time: ``num_requests_running`` / ``num_requests_waiting``,
``kv_cache_usage_perc`` and the block pool (``kv_cache_free_blocks`` / ``kv_cache_total_blocks``:
every block is free again once nothing runs), the prefix cache's queried / hit tokens and hit rate,
preemptions, engine steps (forward passes), with a draft model the speculative draft / accepted
tokens and acceptance rate, and with expert parallelism each rank's load:
``expert_parallel_routed_slots_total{rank}`` (the (token, expert) slots its experts processed,
summed over the layers) and ``expert_parallel_load_imbalance`` (the busiest rank's slots over the
mean; 1 = balanced).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ...engine.params import RequestOutput

__all__ = ["ServerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_P = "fastinfer:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5)


class _EngineCollector:
    """Gauges and engine-side counters read from the engine's last step (no state here)."""

    def __init__(self, stats: Callable[[], Dict], model_name: str):
        self.stats = stats
        self.labels = ["model_name"], [model_name]

    def collect(self) -> Iterator:
        st = self.stats()
        names, values = self.labels

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(_P + name, doc, labels=names)
            g.add_metric(values, float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(_P + name, doc, labels=names)
            c.add_metric(values, float(value))
            return c

        total, free = st.get("num_kv_blocks", 0), st.get("num_free_blocks", 0)
        queries, hits = st.get("prefix_cache_queries", 0), st.get("prefix_cache_hits", 0)
        yield gauge("num_requests_running", "Sequences the scheduler is running.", st.get("num_running", 0))
        yield gauge("num_requests_waiting", "Sequences waiting to be admitted.", st.get("num_waiting", 0))
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                    1.0 - free / total if total else 0.0)
        yield gauge("kv_cache_free_blocks", "Free KV blocks (cached prefix blocks included).", free)
        yield gauge("kv_cache_total_blocks", "KV blocks in the pool.", total)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", hits)
        yield gauge("prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries.",
                    hits / queries if queries else 0.0)
        yield counter("num_preemptions", "Sequences preempted (recomputed later).", st.get("num_preemptions", 0))
        yield counter("engine_steps", "Engine steps (one target forward pass each).", st.get("num_steps", 0))
        if "spec_num_draft_tokens" in st:
            draft, acc = st.get("spec_num_draft_tokens", 0), st.get("spec_num_accepted_tokens", 0)
            yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", draft)
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", acc)
            yield gauge("spec_decode_acceptance_rate", "Accepted / verified draft tokens.",
                        acc / draft if draft else 0.0)
        slots = st.get("expert_parallel_routed_slots")
        if slots:
            c = CounterMetricFamily(_P + "expert_parallel_routed_slots",
                                    "(Token, expert) slots each expert-parallel rank's experts processed.",
                                    labels=names + ["rank"])
            for rank, n in enumerate(slots):
                c.add_metric(values + [str(rank)], float(n))
            yield c
            mean = sum(slots) / len(slots)
            yield gauge("expert_parallel_load_imbalance", "Busiest expert-parallel rank's slots / the mean.",
                        max(slots) / mean if mean else 1.0)


class ServerMetrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], Dict]):
        disable_created_metrics()  # no *_created series (process-wide; this is the server's process)
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.model_name = model_name

        def hist(name, doc, buckets):
            return Histogram(_P + name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first.",
                         _TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prompt_tokens = Counter(_P + "prompt_tokens", "Prompt tokens of finished or aborted requests.",
                                     lab, registry=r).labels(model_name)
        self.generation_tokens = Counter(_P + "generation_tokens", "Generated tokens.", lab,
                                         registry=r).labels(model_name)
        self.success = Counter(_P + "request_success", "Requests that finished.", lab + ["finished_reason"],
                               registry=r)
        self.aborted = Counter(_P + "request_aborted", "Requests whose client left first.", lab,
                               registry=r).labels(model_name)
        self.rejected = Counter(_P + "request_rejected", "Requests refused (4xx / 503).", lab,
                                registry=r).labels(model_name)
        r.register(_EngineCollector(engine_stats, model_name))

    def observe(self, out: Optional[RequestOutput], num_prompt_tokens: int, finished: bool) -> None:
        """One engine request ended (``out``: its last output, None when none came)."""
        gen = sum(len(c.token_ids) for c in out.outputs) if out is not None else 0
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(gen)
        if not finished or out is None:
            self.aborted.inc()
            return
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.success.labels(self.model_name, reason or "unknown").inc()
        m = out.metrics
        t0 = m.get("arrival_time")
        if t0 is None:
            return
        if "scheduled_time" in m:
            self.queue.observe(m["scheduled_time"] - t0)
        if "first_token_time" in m:
            self.ttft.observe(m["first_token_time"] - t0)
        if "finished_time" in m:
            self.e2e.observe(m["finished_time"] - t0)
            longest = max((len(c.token_ids) for c in out.outputs), default=0)
            if "first_token_time" in m and longest > 1:
                self.tpot.observe((m["finished_time"] - m["first_token_time"]) / (longest - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
