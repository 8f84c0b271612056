"""``GET /metrics``: Prometheus text, read at scrape time from the server's
counters and the batchers' statistics (no per-token bookkeeping).

llama-server's ``llamacpp:`` names where they mean the same thing, plus
llamax's own under ``llamax:``.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily,
)

from llamax.server.tenancy import TTFT_BUCKETS


class _Collector:
    def __init__(self, backend):
        from llamax.server.store import Latency
        self.backend = backend
        self.load_latency = Latency()   # the memory tier's loads, drained from the model at each scrape
        # llama-server's throughput gauges cover the time since the previous
        # scrape: (prompt tokens decoded, their seconds, tokens generated, theirs) then
        self.window = (0, 0.0, 0, 0.0)

    def _tiers(self, table: dict):
        """The adapter tiers: disk (with --adapter-store), memory, the LoRA
        tables; and the store's own counts."""
        e = self.backend
        mem = e.llm.adapter_memory_stats()
        for sec in mem["load_seconds"]:
            self.load_latency.observe(sec)
        store = e.store.stats() if e.store is not None else None
        fams = {k: (CounterMetricFamily if k != "resident" else GaugeMetricFamily)(
            f"llamax:adapter_tier_{k}", doc, labels=["tier"]) for k, doc in (
            ("resident", "Adapters held by each tier: disk (fetched from the store), memory (loaded), table "
                         "(LoRA-table slots filled)."),
            ("hits", "A request's adapter found in the tier (disk: a store adapter on disk; memory: loaded)."),
            ("misses", "A request's adapter brought into the tier (disk: fetched; memory: loaded; table: a "
                       "slot filled)."),
            ("evictions", "Adapters let go to make room, least recently used first (never one a running "
                          "request holds)."))}
        rows = {"memory": (mem["loaded"], mem["hits"], mem["misses"], mem["evictions"]),
                "table": (table["filled"], None, table["fills"], table["evictions"])}
        if store is not None:
            rows["disk"] = (store["disk_entries"], store["disk_hits"], store["disk_misses"], store["disk_evictions"])
        for tier, values in sorted(rows.items()):
            for k, v in zip(("resident", "hits", "misses", "evictions"), values):
                if v is not None:
                    fams[k].add_metric([tier], v)
        yield from fams.values()
        h = HistogramMetricFamily("llamax:adapter_load_seconds", "Adapter loads into memory (a request's adapter "
                                  "that was not loaded, or a store adapter's first load).")
        buckets, total = self.load_latency.buckets()
        h.add_metric([], buckets, total)
        yield h
        if store is None:
            return
        h = HistogramMetricFamily("llamax:adapter_fetch_seconds", "Adapter fetches from the store into the "
                                  "disk tier.")
        buckets, total = e.store.fetch_latency.buckets()
        h.add_metric([], buckets, total)
        yield h
        yield GaugeMetricFamily("llamax:adapter_disk_bytes", "Bytes the adapter disk tier holds "
                                "(--adapter-cache-bytes bounds it).", value=store["disk_bytes"])
        for k, doc in (("lookups", "Store lookups (a name not held, or a re-check after --adapter-store-ttl)."),
                       ("fetches", "Adapters fetched from the store."),
                       ("fetched_bytes", "Bytes fetched from the store."),
                       ("not_found", "Lookups of names the store does not hold."),
                       ("unavailable", "Requests answered 503 because the store could not be reached in time."),
                       ("refused", "Store adapters refused (too big, too large a rank, not a LoRA for this model)."),
                       ("updates", "Newer store versions that replaced a held adapter.")):
            yield CounterMetricFamily(f"llamax:adapter_store_{k}", doc, value=store[k])

    def collect(self):
        e = self.backend
        c = e.counters
        stats = {"n_decodes": 0, "n_tokens": 0, "n_switches": 0, "n_cached_tokens": 0, "n_seq_copies": 0,
                 "n_multi_adapter_decodes": 0, "n_seq_decoded": 0, "decode_s": 0.0, "preempted_s": 0.0,
                 "newcomer_s": 0.0}
        table = {"slots": 0, "filled": 0, "fills": 0, "evictions": 0, "bytes": 0, "fallback": 0}
        for s in e.llm.context_stats():
            for k, v in s.items():
                if k in stats:
                    stats[k] += v
            for k, v in (s.get("lora_table") or {}).items():
                if k in table:
                    table[k] += v
        with c.lock:
            prompt, predicted, cached = c.prompt_tokens, c.predicted_tokens, c.cached_tokens
            timed = (c.timed_prompt_tokens, c.prompt_seconds, c.timed_predicted_tokens, c.predicted_seconds)
            requests = dict(c.requests)
        d = [now - then for now, then in zip(timed, self.window)]
        self.window = timed
        running = min(e.in_flight, e.capacity)
        waiting = max(0, e.in_flight - e.capacity)

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc)
            m.add_metric([], value)
            return m

        def gauge(name, doc, value):
            m = GaugeMetricFamily(name, doc)
            m.add_metric([], value)
            return m

        yield counter("llamacpp:prompt_tokens", "Prompt tokens of finished requests (cached ones included).",
                      prompt)
        yield counter("llamacpp:tokens_predicted", "Generated tokens of finished requests.", predicted)
        yield counter("llamacpp:n_decode", "llama_decode calls of the batchers.", stats["n_decodes"])
        yield counter("llamacpp:prompt_tokens_cached", "Prompt tokens read from the prefix cache.", cached)
        yield counter("llamacpp:prompt_seconds", "Seconds of prompt processing of the requests that timed it "
                      "(each from its start, past any queue, to its first token).", timed[1])
        yield counter("llamacpp:tokens_predicted_seconds", "Seconds of generation of the requests that timed it.",
                      timed[3])
        yield gauge("llamacpp:prompt_tokens_seconds", "Prompt tokens decoded per second since the previous scrape.",
                    d[0] / d[1] if d[1] > 0 else 0.0)
        yield gauge("llamacpp:predicted_tokens_seconds", "Tokens generated per second since the previous scrape.",
                    d[2] / d[3] if d[3] > 0 else 0.0)
        yield gauge("llamacpp:n_busy_slots_per_decode", "Mean sequences per decode since start.",
                    stats["n_seq_decoded"] / stats["n_decodes"] if stats["n_decodes"] else 0.0)
        yield gauge("llamacpp:requests_processing", "Requests running.", running)
        yield gauge("llamacpp:requests_deferred", "Requests waiting for a sequence slot.", waiting)
        yield gauge("llamax:queue_depth", "Requests admitted and not yet running.", waiting)
        co = getattr(e, "coalescer", None)
        yield counter("llamax:embedding_requests", "Embedding requests run (/v1/embeddings, /embedding).",
                      co.requests if co is not None else 0)
        yield counter("llamax:embedding_calls", "Native calls that ran them: concurrent requests share one.",
                      co.calls if co is not None else 0)
        yield counter("llamax:prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache.", cached)
        yield counter("llamax:prefix_copies", "Prefixes copied from a running sequence's cells.",
                      stats["n_seq_copies"])
        yield counter("llamax:adapter_set_switches", "State changes between decodes (adapter set or control "
                      "vector applied anew).", stats["n_switches"])
        yield counter("llamax:multi_adapter_decodes", "Decodes that served several adapter sets at once.",
                      stats["n_multi_adapter_decodes"])
        yield counter("llamax:decoded_tokens", "Tokens decoded by the batchers (prompt and generated).",
                      stats["n_tokens"])
        yield counter("llamax:sequence_steps", "Sum over decodes of the sequences in each.",
                      stats["n_seq_decoded"])
        yield gauge("llamax:sequences_per_decode", "Mean sequences per decode since start.",
                    stats["n_seq_decoded"] / stats["n_decodes"] if stats["n_decodes"] else 0.0)
        yield counter("llamax:decode_seconds", "Seconds the batchers spent in llama_decode (aborted decodes "
                      "too).", stats["decode_s"])
        yield counter("llamax:preempted_decode_seconds", "Of those, seconds in decodes aborted for a newcomer "
                      "tenant or a shorter prompt (their work is redone).", stats["preempted_s"])
        yield counter("llamax:newcomer_step_seconds", "Of those, seconds in newcomer tenants' first prompts decoded "
                      "alone (--reserve-slots).", stats["newcomer_s"])
        loras = e.llm.list_loras()
        yield gauge("llamax:adapters_loaded", "LoRA adapters in memory.", sum(1 for x in loras if x["loaded"]))
        yield gauge("llamax:adapters_registered", "LoRA adapters offered (loaded or on demand).", len(loras))
        yield gauge("llamax:lora_table_slots", "Slots of the contexts' LoRA tables (--max-lora-slots).",
                    table["slots"])
        yield gauge("llamax:lora_table_slots_filled", "LoRA-table slots holding an adapter.", table["filled"])
        yield gauge("llamax:lora_table_bytes", "Memory the LoRA tables' stacked weights hold.", table["bytes"])
        yield counter("llamax:lora_table_fills", "Adapters copied into a LoRA-table slot.", table["fills"])
        yield counter("llamax:lora_table_evictions", "LoRA-table fills that replaced the least recently used "
                      "idle adapter.", table["evictions"])
        yield gauge("llamax:lora_table_fallback_adapters", "Adapters of the applied sets that don't fit the "
                    "table (other weights or ranks, or no free slot) and run the union way.", table["fallback"])
        yield from self._tiers(table)
        m = CounterMetricFamily("llamax:requests", "Requests answered, by endpoint and status code.",
                                labels=["endpoint", "code"])
        for (endpoint, code), v in sorted(requests.items()):
            m.add_metric([endpoint, str(code)], v)
        yield m
        tenancy = getattr(e, "tenancy", None)
        if tenancy is not None and tenancy.enabled:
            yield from _tenant_metrics(tenancy.snapshot())


def _tenant_metrics(snap: dict):
    """Per-tenant series (servers with a tenants file), labelled by tenant name."""
    req = CounterMetricFamily("llamax:tenant_requests", "Requests answered, by tenant and status code.",
                              labels=["tenant", "code"])
    fams = {k: CounterMetricFamily(f"llamax:tenant_{k}", doc, labels=["tenant"]) for k, doc in (
        ("prompt_tokens", "Prompt tokens of finished requests, by tenant."),
        ("completion_tokens", "Generated tokens of finished requests, by tenant."),
        ("cached_tokens", "Prompt tokens reused from the tenant's prefix cache."))}
    active = GaugeMetricFamily("llamax:tenant_active_sequences", "Sequences admitted (running or waiting for a "
                               "slot), by tenant.", labels=["tenant"])
    queue = SummaryMetricFamily("llamax:tenant_queue_seconds", "Time the tenant's generation requests waited "
                                "for a batch slot (the longest of a request's sequences).", labels=["tenant"])
    ttft = HistogramMetricFamily("llamax:tenant_ttft_seconds", "Time to the first streamed token, from the "
                                 "request's arrival (streamed requests), by tenant.", labels=["tenant"])
    for name, u in sorted(snap.items()):
        for code, v in sorted(u["by_status"].items()):
            req.add_metric([name, str(code)], v)
        for k, fam in fams.items():
            fam.add_metric([name], u[k])
        active.add_metric([name], u["in_flight"])
        queue.add_metric([name], count_value=u["queue_time_n"], sum_value=u["queue_time_sum"])
        cum, buckets = 0, []
        for b, n in zip(list(TTFT_BUCKETS) + [float("inf")], u["ttft"]):
            cum += n
            buckets.append(("+Inf" if b == float("inf") else str(b), cum))
        ttft.add_metric([name], buckets, u["ttft_sum"])
    yield req
    yield from fams.values()
    yield active
    yield queue
    yield ttft


def render(backend) -> tuple[bytes, str]:
    """Prometheus text for a LocalBackend (its collector made on first use)."""
    reg = getattr(backend, "prometheus_registry", None)
    if reg is None:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Collector(backend))
        backend.prometheus_registry = reg
    return generate_latest(reg), CONTENT_TYPE_LATEST
