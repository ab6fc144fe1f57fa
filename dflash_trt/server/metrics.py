"""Prometheus metrics of one server. Each app owns its registry, so several apps (tests) never collide.

Next to our own `dflash_*` metrics the server exports vLLM's speculative-decoding counters and scheduler
gauges under vLLM's names, label names and shapes, so that dashboards, autoscalers and NVIDIA's aiperf
written for vLLM read this server unchanged:

    vllm:spec_decode_num_drafts, vllm:spec_decode_num_draft_tokens, vllm:spec_decode_num_accepted_tokens
        (counters, labels model_name and engine), vllm:spec_decode_num_accepted_tokens_per_pos (the same plus
        `position`, one series per draft position from 0, created at start so a dashboard sees zeros)
    vllm:num_requests_running, vllm:num_requests_waiting (gauges, labels model_name and engine)

as vLLM defines them in vllm/v1/spec_decode/metrics.py (SpecDecodingStats.observe_draft, SpecDecodingProm;
vllm-project/vllm at commit 016a8587) and vllm/v1/metrics/loggers.py (PrometheusStatLogger: labelnames
["model_name", "engine"]; commit 005a810b). One "draft" is one verify round that drafted: a DFlash round
with block size B drafts B - 1 tokens; its accepted tokens are the drafted tokens the target kept (the bonus
token excluded), and each accepted position 0..k-1 counts once. Rounds at block size 1 draft nothing and
are no draft (vLLM counts drafts only where the proposer ran). `engine` is "0": one loop per server.

Both families are fed by one call per verify round (observe_round), so they agree by construction:
vllm:spec_decode_num_drafts == dflash_draft_rounds, ..._num_draft_tokens == dflash_draft_tokens,
..._num_accepted_tokens == dflash_accepted_draft_tokens == the sum over positions of ..._per_pos.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


VLLM_LABELS = ["model_name", "engine"]  # vllm/v1/metrics/loggers.py, PrometheusStatLogger


class ServerMetrics:
    """model_name: the served model's id (vLLM's `model_name` label); num_spec_tokens: the most draft tokens one
    round can propose (the drafter's trained block size - 1; 0 without a drafter): the positions created at start."""

    def __init__(self, model_name: str = "dflash-trt", num_spec_tokens: int = 0) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._requests()
        self._rounds()
        self._steps()
        self._speculative()
        self._vllm(num_spec_tokens)

    def _requests(self) -> None:
        """Per request: the HTTP answers, tokens, latencies, the queue and the batch."""
        r = self.registry
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
        self.queue_depth = Gauge("dflash_queue_depth", "requests waiting for a generation slot", registry=r)
        self.inflight = Gauge(
            "dflash_inflight_requests", "requests in the batch (rows advanced by each step)", registry=r
        )
        self.drafter_fallbacks = Counter(
            "dflash_drafter_fallbacks",
            "generations that lost their drafter and finished on the target alone",
            registry=r,
        )
        self.engine_errors = Counter("dflash_engine_errors", "generations failed by an engine error", registry=r)

    def _rounds(self) -> None:
        """Per verify round: tokens committed and the time of its drafter and target passes."""
        r = self.registry
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

    def _steps(self) -> None:
        """The batched steps (decoding/step.py StepProfile): their shape and where their time went."""
        r = self.registry
        self.block_size = Histogram(
            "dflash_block_size",
            "block size chosen per verify row per step (1: no drafting)",
            buckets=tuple(range(1, 17)),
            registry=r,
        )
        self.batch_rows = Histogram(
            "dflash_batch_rows",
            "rows in one batched target pass, by part: prefill (a pass of its own), chunk (prompt chunks in the "
            "verify pass), verify",
            ["pass"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.batch_tokens = Histogram(
            "dflash_batch_tokens",
            "tokens in one batched target pass (all rows), by part: prefill, chunk, verify",
            ["pass"],
            buckets=(1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384),
            registry=r,
        )
        self.step_time = Histogram(
            "dflash_step_seconds",
            "time of one batched step by part: prefill (its own pass; chunks are in verify), policy "
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

    def _speculative(self) -> None:
        """Speculative decoding under our names: verify rounds that drafted, their draft tokens, those accepted."""
        r = self.registry
        self.draft_rounds = Counter(
            "dflash_draft_rounds", "verify rounds that drafted (block size > 1): vLLM's drafts", registry=r
        )
        self.draft_tokens = Counter(
            "dflash_draft_tokens", "draft tokens proposed (block size - 1 per round)", registry=r
        )
        self.accepted_draft_tokens = Counter(
            "dflash_accepted_draft_tokens", "draft tokens the target accepted (bonus tokens excluded)", registry=r
        )
        # the same three per proposer (decoding/proposers.py), under vLLM's names with a `proposer` label; vLLM's
        # own families below keep vLLM's exact labels, on which its dashboards select
        by = ["proposer"]
        self.proposer_drafts = Counter("dflash_spec_decode_num_drafts", "drafts, by proposer", by, registry=r)
        self.proposer_draft_tokens = Counter(
            "dflash_spec_decode_num_draft_tokens", "draft tokens, by proposer", by, registry=r
        )
        self.proposer_accepted = Counter(
            "dflash_spec_decode_num_accepted_tokens", "accepted draft tokens, by proposer", by, registry=r
        )
        self.suffix_states = Gauge(
            "dflash_suffix_states", "states of the live requests' suffix automata (suffix/hybrid proposers)", registry=r
        )
        self.suffix_states_max = Gauge(
            "dflash_suffix_states_max", "the largest live request's suffix automaton, in states", registry=r
        )
        self.suffix_shared_states = Gauge(
            "dflash_suffix_shared_states", "states of the automaton over finished requests' outputs", registry=r
        )
        self.suffix_bytes = Gauge(
            "dflash_suffix_bytes",
            "the suffix automata's memory in bytes, the requests' and the shared one (their arrays, dicts and ints)",
            registry=r,
        )

    def _vllm(self, num_spec_tokens: int) -> None:
        """The same counters and the scheduler gauges under vLLM's names and labels (see the module docstring)."""
        r = self.registry
        lv = (self.model_name, "0")
        self._vllm_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", VLLM_LABELS, registry=r
        ).labels(*lv)
        self._vllm_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", VLLM_LABELS, registry=r
        ).labels(*lv)
        self._vllm_accepted = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", VLLM_LABELS, registry=r
        ).labels(*lv)
        self._vllm_per_pos_family = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*VLLM_LABELS, "position"],
            registry=r,
        )
        self._vllm_per_pos = [self._vllm_per_pos_family.labels(*lv, str(p)) for p in range(num_spec_tokens)]
        self.vllm_running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", VLLM_LABELS, registry=r
        ).labels(*lv)
        self.vllm_waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", VLLM_LABELS, registry=r
        ).labels(*lv)

    def observe_suffix_states(self, states: list[int], shared: int = 0, nbytes: int = 0) -> None:
        """The suffix automata after a step: the live requests' states in all and the largest, the shared
        automaton's, and their bytes in all (`SuffixAutomaton.nbytes`, `SharedSuffixes.nbytes`)."""
        total = sum(states)
        self.suffix_states.set(total)
        self.suffix_states_max.set(max(states, default=0))
        self.suffix_shared_states.set(shared)
        self.suffix_bytes.set(nbytes)

    def observe_round(self, drafted: int, accepted: int, proposer: str) -> None:
        """One verify round: `drafted` tokens proposed by `proposer`, the first `accepted` of them kept by the
        target."""
        if drafted <= 0:  # block size 1: no draft (vLLM counts only rounds where the proposer ran)
            return
        accepted = max(0, min(accepted, drafted))
        self.proposer_drafts.labels(proposer).inc()
        self.proposer_draft_tokens.labels(proposer).inc(drafted)
        self.proposer_accepted.labels(proposer).inc(accepted)
        for c in (self.draft_rounds, self._vllm_drafts):
            c.inc()
        for c in (self.draft_tokens, self._vllm_draft_tokens):
            c.inc(drafted)
        for c in (self.accepted_draft_tokens, self._vllm_accepted):
            c.inc(accepted)
        while len(self._vllm_per_pos) < accepted:  # a block larger than announced at start: grow the positions
            self._vllm_per_pos.append(
                self._vllm_per_pos_family.labels(self.model_name, "0", str(len(self._vllm_per_pos)))
            )
        for p in range(accepted):
            self._vllm_per_pos[p].inc()

    def set_queue(self, waiting: int | None = None, running: int | None = None) -> None:
        """The scheduler's queue (waiting) and batch (running), ours and vLLM's gauges alike."""
        if waiting is not None:
            self.queue_depth.set(waiting)
            self.vllm_waiting.set(waiting)
        if running is not None:
            self.inflight.set(running)
            self.vllm_running.set(running)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
