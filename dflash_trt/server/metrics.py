"""Prometheus metrics of one server. Each app owns its registry, so several apps (tests) never collide."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "dflash_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("dflash_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.generated_tokens = Counter("dflash_generated_tokens", "tokens generated (committed)", registry=r)
        self.ttft = Histogram(
            "dflash_time_to_first_token_seconds",
            "submission to first committed token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "dflash_inter_token_latency_seconds",
            "time between rounds divided by the tokens the round committed (one sample per token)",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "dflash_request_latency_seconds",
            "submission to last token, by outcome",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.acceptance = Histogram(
            "dflash_acceptance_length",
            "tokens committed per verify round (bonus included)",
            buckets=tuple(range(1, 17)) + (24, 32),
            registry=r,
        )
        self.draft_time = Histogram(
            "dflash_draft_time_seconds",
            "drafter time per round (its batched step's drafter pass)",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.verify_time = Histogram(
            "dflash_verify_time_seconds",
            "target verify time per round (its batched step's target pass + its own acceptance)",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("dflash_queue_depth", "requests waiting for a generation slot", registry=r)
        self.inflight = Gauge(
            "dflash_inflight_requests", "requests in the batch (rows advanced by each step)", registry=r
        )
        self.drafter_fallbacks = Counter(
            "dflash_drafter_fallbacks",
            "generations that lost their drafter and finished on the target alone",
            registry=r,
        )
        # the batched steps (decoding/loop.py StepProfile): their shape and where their time went
        self.block_size = Histogram(
            "dflash_block_size",
            "block size chosen per verify row per step (1: no drafting)",
            buckets=tuple(range(1, 17)),
            registry=r,
        )
        self.batch_rows = Histogram(
            "dflash_batch_rows",
            "rows in one batched target pass, by pass (prefill, verify)",
            ["pass"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.batch_tokens = Histogram(
            "dflash_batch_tokens",
            "tokens in one batched target pass (all rows), by pass (prefill, verify)",
            ["pass"],
            buckets=(1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384),
            registry=r,
        )
        self.step_time = Histogram(
            "dflash_step_seconds",
            "time of one batched step by part: prefill, policy "
            "(choosing block sizes), draft, verify, accept, overhead (Python bookkeeping)",
            ["part"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.cost_correction = Gauge(
            "dflash_cost_correction",
            "adaptive block sizes: observed / start-up-predicted "
            "seconds of recent passes, by engine (target, target_one_token: a lone request's one-token passes, "
            "drafter); 1 = the start-up costs hold",
            ["engine"],
            registry=r,
        )
        self.engine_errors = Counter("dflash_engine_errors", "generations failed by an engine error", registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
