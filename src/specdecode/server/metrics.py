"""Prometheus metrics, named after vLLM's under our prefix, and the per-request speculation summary.

Speculation counters are added when a request ends, from the same statistics the response reports, so
``/metrics`` and the responses always agree.  Inter-token latency is observed once per generated token:
a step that accepts three tokens after 90 ms counts three tokens of 30 ms each, which is how a reader of the
stream experiences it (and what makes it comparable with plain decoding).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specdecode.stats import GenerationStats

PREFIX = "specdecode:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 51.2)


def speculative_summary(stats: GenerationStats) -> dict:
    """``metrics.speculative_decoding`` of a response (vLLM's field names where they exist)."""
    drafts = stats.drafted_at[0] if stats.drafted_at else 0
    return {
        "num_drafts": drafts,
        "num_draft_tokens": stats.drafted_tokens,
        "num_accepted_tokens": stats.accepted_tokens,
        "mean_acceptance_length": round(1.0 + stats.accepted_tokens / drafts, 4) if drafts else 1.0,
        "draft_acceptance_rate": round(stats.acceptance_rate, 4),
        "acceptance_per_position": [round(x, 4) for x in stats.acceptance_by_position],
        "verifier": stats.verifier,
        "lossless": stats.lossless,  # false: a relaxed verifier kept tokens the target would not have produced
    }


class ServerMetrics:
    """The server's Prometheus collectors, in a registry of their own (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter(f"{PREFIX}spec_decode_num_drafts", "Steps that verified a draft", registry=r)
        self.num_draft_tokens = Counter(f"{PREFIX}spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.num_accepted_tokens = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.accepted_per_pos = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = first)",
            ["position"],
            registry=r,
        )
        self.verified_requests = Counter(
            f"{PREFIX}verifier_requests",
            "Finished requests by verifier; lossless=false: relaxed verification, not the target's exact output",
            ["verifier", "lossless"],
            registry=r,
        )
        self.running = Gauge(f"{PREFIX}num_requests_running", "Requests decoding now", registry=r)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "Requests waiting for a place in the batch", registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated", registry=r)
        # vLLM's names: prompt tokens looked up in the prefix cache, and those found there.
        self.prefix_cache_queries = Counter(
            f"{PREFIX}prefix_cache_queries",
            "Prompt tokens of finished requests looked up in the prefix cache",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            f"{PREFIX}prefix_cache_hits", "Prompt tokens taken from the prefix cache instead of read", registry=r
        )
        self.requests = Counter(
            f"{PREFIX}request_success", "Finished requests by finish reason", ["finished_reason"], registry=r
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Arrival to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Time between streamed tokens (a step's interval shared by the tokens it accepted)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def record_load(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def record_tokens(self, count: int, since_last_s: float, first: bool) -> None:
        """``count`` tokens arrived ``since_last_s`` after the previous ones (or after arrival if ``first``)."""
        if count <= 0:
            return
        if first:
            self.time_to_first_token.observe(since_last_s)
            count -= 1  # the rest of a first step's tokens arrive with it, at no extra latency
            for _ in range(count):
                self.inter_token_latency.observe(0.0)
            return
        for _ in range(count):
            self.inter_token_latency.observe(since_last_s / count)

    def record_finished(self, prompt_tokens: int, stats: GenerationStats, finish_reason: str) -> None:
        summary = speculative_summary(stats)
        self.num_drafts.inc(summary["num_drafts"])
        self.num_draft_tokens.inc(stats.drafted_tokens)
        self.num_accepted_tokens.inc(stats.accepted_tokens)
        for position, accepted in enumerate(stats.accepted_at):
            self.accepted_per_pos.labels(position=str(position)).inc(accepted)
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(stats.cached_tokens)
        self.generation_tokens.inc(stats.new_tokens)
        self.requests.labels(finished_reason=finish_reason).inc()
        self.verified_requests.labels(verifier=stats.verifier, lossless=str(stats.lossless).lower()).inc()
