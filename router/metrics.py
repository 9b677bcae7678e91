"""Prometheus metrics of the router, named as vLLM users already graph them.

Acceptance rate       = rate(specpool_spec_decode_num_accepted_tokens_total)
                        / rate(specpool_spec_decode_num_draft_tokens_total)
Mean accepted length  = 1 + rate(specpool_spec_decode_num_accepted_tokens_total)
                            / rate(specpool_spec_decode_num_drafts_total)      (tokens per drafting round)
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

WORKER_STATES = ("loading", "ready", "down", "failed")     # router.worker_client.WorkerClient.state
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """The router's metrics in their own registry (one per router, so tests can read them)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self._server = None                  # the /metrics endpoint, once served
        r = self.registry
        self.drafts = Counter("specpool_spec_decode_num_drafts", "Rounds that proposed at least one draft", registry=r)
        self.draft_tokens = Counter("specpool_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("specpool_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       registry=r)
        self.accepted_per_pos = Counter("specpool_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by draft position", ["position"], registry=r)
        self.target_passes = Counter("specpool_target_passes", "Target verification passes", registry=r)
        self.predrafts = Counter("specpool_spec_decode_num_predrafts",
                                 "Pre-drafts of the next round sent while the target verified", registry=r)
        self.predraft_hits = Counter("specpool_spec_decode_num_predraft_hits",
                                     "Rounds whose drafts a pre-draft had ready (no draft call on the critical path)",
                                     registry=r)
        self.predraft_branch_hits = Counter(
            "specpool_spec_decode_num_predraft_branch_hits",
            "Of those, rounds whose drafts came from a rejection branch (the previous verdict rejected a draft and "
            "corrected it to the draft's runner-up or third choice)", registry=r)
        self.staged_rounds = Counter(
            "specpool_spec_decode_num_staged_rounds",
            "Of those, rounds the target had started verifying by itself when its verdict came (a staged pre-draft: "
            "no router round trip)", registry=r)
        self.handed_off_rounds = Counter(
            "specpool_spec_decode_num_handed_off_rounds",
            "Rounds whose drafts went from the draft worker straight to the target (speculation.hand_off), by "
            "whose copy the target verified: the draft worker's, or the router's (the draft's had not arrived: a "
            "draft worker that cannot reach the target shows as copy=\"router\")", ["copy"], registry=r)
        self.round_seconds = Counter("specpool_round_seconds", "Wall time of rounds, by where it went (compute, "
                                     "worker queue/thread hop, transport per call; pre-draft wait; router)", ["part"],
                                     registry=r)
        self.k = Gauge("specpool_spec_decode_k", "K the policy holds for greedy requests' rounds (the draft model's; "
                       "prompt lookup's under draft.method ngram), as last chosen (probes aside)", registry=r)
        self.batch_size = Histogram("specpool_target_batch_size", "Rows in the target forward that verified a round",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.ttft = Histogram("specpool_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specpool_inter_token_latency_seconds", "Time between output tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("specpool_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.predictions_dropped = Counter("specpool_predictions_dropped", "Requests whose prediction was dropped "
                                           "as useless: its drafts delivered fewer tokens per second than the "
                                           "request's other rounds (router/prediction.py)", registry=r)
        self.requests = Counter("specpool_requests", "Finished requests by final gRPC status", ["code"], registry=r)
        self.out_of_memory = Counter("specpool_out_of_memory", "Draft and verify calls that ran out of device memory, "
                                     "by pool: the target's fail their request (RESOURCE_EXHAUSTED), the draft's cost "
                                     "a round its drafts (a lost pre-draft is not counted)", ["pool"], registry=r)
        self.queued = Gauge("specpool_queued_requests", "Requests waiting in the admission queue for a slot "
                            "(router.max_active_requests running; past router.max_queued_requests: RESOURCE_EXHAUSTED)",
                            registry=r)
        self.worker_sessions = Gauge("specpool_worker_active_sessions", "Sessions the router has open on a worker",
                                     ["pool", "address"], registry=r)
        # Per proposal source (model: the draft pool; ngram: prompt lookup). Acceptance at position j of a source =
        # accepted_tokens_per_pos{source, position=j} / draft_tokens_per_pos{source, position=j}.
        self.source_drafts = Counter("specpool_spec_decode_source_num_drafts", "Rounds that drafted, by proposal "
                                     "source", ["source"], registry=r)
        self.source_draft_tokens_per_pos = Counter("specpool_spec_decode_source_num_draft_tokens_per_pos",
                                                   "Draft tokens proposed, by proposal source and draft position",
                                                   ["source", "position"], registry=r)
        self.source_accepted_per_pos = Counter("specpool_spec_decode_source_num_accepted_tokens_per_pos",
                                               "Draft tokens accepted, by proposal source and draft position",
                                               ["source", "position"], registry=r)
        # Prefix caching (*.prefix_cache_tokens): hit rate = rate(..._hits_total) / rate(..._queries_total), by pool.
        self.prefix_queries = Counter("specpool_prefix_cache_queries", "Context tokens looked up in a worker's prefix "
                                      "cache at session starts (re-prefills included), by pool", ["pool"], registry=r)
        self.prefix_hits = Counter("specpool_prefix_cache_hits", "Of those, tokens found there (not computed again)",
                                   ["pool"], registry=r)

    def count_replicas(self, pools: dict) -> None:
        """specpool_worker_replicas{pool, state}: each pool's replicas (lists of worker clients, read at each scrape)
        by state: loading, ready, down (recovering) or failed (did not load)."""
        gauge = Gauge("specpool_worker_replicas", "Worker replicas by pool and state (loading, ready, down, failed)",
                      ["pool", "state"], registry=self.registry)
        for pool, clients in pools.items():
            for state in WORKER_STATES:
                gauge.labels(pool, state).set_function(
                    lambda clients=clients, state=state: sum(c.state == state for c in clients))

    def observe_round(self, round_) -> None:
        """One round (router.request_state.Round)."""
        self.target_passes.inc()
        self.batch_size.observe(round_.timings.batch_size)
        for part, seconds in round_.parts.items():
            self.round_seconds.labels(part).inc(seconds)
        self.predrafts.inc(round_.predraft_sent)
        self.predraft_hits.inc(round_.predrafted)
        self.predraft_branch_hits.inc(round_.from_branch)
        self.staged_rounds.inc(round_.staged)
        if round_.handed:
            self.handed_off_rounds.labels(round_.handed).inc()
        if round_.k == 0:
            return
        self.drafts.inc()
        self.draft_tokens.inc(round_.k)
        self.accepted_tokens.inc(round_.accepted)
        for position in range(round_.accepted):
            self.accepted_per_pos.labels(str(position)).inc()

    def observe_source(self, source: str, k: int, accepted: int) -> None:
        """One round's drafts from `source` (nothing for a round with K = 0)."""
        if k == 0:
            return
        self.source_drafts.labels(source).inc()
        for position in range(k):
            self.source_draft_tokens_per_pos.labels(source, str(position)).inc()
            if position < accepted:
                self.source_accepted_per_pos.labels(source, str(position)).inc()

    def observe_prefix_caches(self, stats) -> None:
        """A finished request's prefix-cache lookups (generation_pb2.GenerationStats), per pool."""
        for pool, lookups in (("target", stats.target_prefix_cache), ("draft", stats.draft_prefix_cache)):
            self.prefix_queries.labels(pool).inc(lookups.looked_up)
            self.prefix_hits.labels(pool).inc(lookups.found)

    def prefix_caches(self) -> dict:
        """Per pool, the context tokens looked up in its prefix caches and found there, since the router started."""
        value = self.registry.get_sample_value
        return {pool: {"looked_up": int(value("specpool_prefix_cache_queries_total", {"pool": pool}) or 0),
                       "found": int(value("specpool_prefix_cache_hits_total", {"pool": pool}) or 0)}
                for pool in ("target", "draft")}

    def observe_tokens(self, gap_seconds: float, tokens: int, first: bool) -> None:
        """A chunk of `tokens` arrived `gap_seconds` after the previous one (or after admission)."""
        if first:
            self.ttft.observe(gap_seconds)
            tokens -= 1
        for _ in range(tokens):
            self.itl.observe(gap_seconds / max(tokens, 1))

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP (router.metrics_port); returns the bound port. A port that cannot be bound is
        a MetricsPortBusy naming the key and the port. `stop()` closes it."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise MetricsPortBusy(f"router.metrics_port = {port}: cannot listen on {host}:{port}: "
                                  f"{exc.strerror or exc}") from None
        return self._server.server_port

    def stop(self) -> None:
        """Close the /metrics endpoint, if it was served."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class MetricsPortBusy(OSError):
    """router.metrics_port could not be bound (in use, or not allowed)."""
