"""Prometheus metrics for the serving stack: raw counters and histograms, fed from `StepRecord`s and final
`RequestOutput`s. Rates are derived in PromQL, never in the server.

Vocabulary: a *step* is one verification forward over the running batch; a request's *accepted tokens* are draft
tokens the target agreed with (the bonus token is not counted); *nodes* are draft-tree nodes sent to verification.

Derived series (PromQL):

    acceptance rate                  rate(retrospec_accepted_tokens_total[1m]) / rate(retrospec_draft_nodes_total[1m])
    mean accepted tokens per step    rate(retrospec_realized_tokens_total[1m]) / rate(retrospec_request_steps_total[1m])
                                     (per request and step, bonus included: 1.0 = no speculation gain)
    goodput (tokens/s)               rate(retrospec_generation_tokens_total[1m])
    mean drafting ms                 1e3 * rate(retrospec_draft_seconds_sum[1m]) / rate(retrospec_draft_seconds_count[1m])
    mean verification ms             1e3 * rate(retrospec_verify_seconds_sum[1m]) / rate(retrospec_verify_seconds_count[1m])
    speculation nodes per step       rate(retrospec_step_nodes_sum[1m]) / rate(retrospec_step_nodes_count[1m])
    drafter fallback share           rate(retrospec_drafter_fallbacks_total[1m]) / rate(retrospec_request_steps_total[1m])
    drafting hidden share            rate(retrospec_drafted_ahead_request_steps_total[1m])
                                     / rate(retrospec_request_steps_total[1m])
                                     (trees drafted while another micro-batch was verified; 0 without micro-batches)
    prefix-cache hit rate            rate(retrospec_cached_prompt_tokens_total[1m])
                                     / rate(retrospec_prompt_tokens_total[1m])

Example: after one step of a batch of 2 that sent 5 and 3 nodes and accepted 2 and 0 of them,
`retrospec_draft_nodes_total` grows by 8, `retrospec_realized_tokens_total` by (2+1)+(0+1) = 4,
`retrospec_request_steps_total` by 2, so mean accepted tokens per step = 4 / 2 = 2.0.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from orchestrator.core import StepRecord
from orchestrator.request import FinishReason, RequestOutput

_MS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_NODE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class ServingMetrics:
    """One registry per stack (tests run several stacks in one process, so never the global registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("retrospec_requests", "Finished requests by finish reason and front end",
                                ["finish_reason", "frontend"], registry=r)
        self.rejected = Counter("retrospec_rejected_requests", "Requests refused before generation (bad input)",
                                ["frontend"], registry=r)
        self.prompt_tokens = Counter("retrospec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_prompt_tokens = Counter("retrospec_cached_prompt_tokens",
                                            "Prompt tokens read from the prefix cache instead of computed", registry=r)
        self.generation_tokens = Counter("retrospec_generation_tokens", "Tokens streamed to clients", registry=r)
        self.draft_nodes = Counter("retrospec_draft_nodes", "Draft-tree nodes sent to verification", registry=r)
        self.accepted_tokens = Counter("retrospec_accepted_tokens", "Draft tokens accepted by the target", registry=r)
        self.realized_tokens = Counter("retrospec_realized_tokens", "Tokens produced by steps (accepted + bonus)",
                                       registry=r)
        self.request_steps = Counter("retrospec_request_steps", "Request-steps (batch size summed over steps)",
                                     registry=r)
        self.steps = Counter("retrospec_steps", "Verification steps", registry=r)
        self.drafter_fallbacks = Counter("retrospec_drafter_fallbacks",
                                         "Request-steps decoded plainly because drafting failed", registry=r)
        self.drafted_ahead = Counter("retrospec_drafted_ahead_request_steps",
                                     "Request-steps verified on a tree drafted during an earlier step's verify "
                                     "(micro-batches)", registry=r)
        self.draft_seconds = Histogram("retrospec_draft_seconds", "Drafting time per step that the step waited for",
                                       buckets=_MS_BUCKETS, registry=r)
        self.overlapped_draft_seconds = Histogram(
            "retrospec_overlapped_draft_seconds", "Drafting of the next micro-batch run during a step's verify "
            "(steps that split the batch)", buckets=_MS_BUCKETS, registry=r)
        self.verify_seconds = Histogram("retrospec_verify_seconds", "Verification forward time per step",
                                        buckets=_MS_BUCKETS, registry=r)
        self.step_nodes = Histogram("retrospec_step_nodes", "Speculation nodes per step (whole batch)",
                                    buckets=_NODE_BUCKETS, registry=r)
        self.batch_size = Histogram("retrospec_step_batch_size", "Requests verified per step (the micro-batch where "
                                    "the running batch is split)",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.running = Gauge("retrospec_running_requests", "Requests being generated now", registry=r)
        self.waiting = Gauge("retrospec_waiting_requests", "Requests waiting for KV blocks", registry=r)
        self.free_kv_blocks = Gauge("retrospec_free_kv_blocks", "Free KV-cache blocks", registry=r)

    def observe_step(self, record: StepRecord) -> None:
        if record.batch == 0:  # it only prefilled: no verification step
            return
        nodes = sum(record.nodes)
        self.steps.inc()
        self.request_steps.inc(record.batch)
        self.draft_nodes.inc(nodes)
        self.realized_tokens.inc(record.realized_tokens)
        self.accepted_tokens.inc(record.realized_tokens - record.batch)
        self.drafter_fallbacks.inc(record.fallbacks)
        self.drafted_ahead.inc(record.drafted_ahead)
        self.draft_seconds.observe(record.draft_s)
        if record.micro_batches > 1:
            self.overlapped_draft_seconds.observe(record.overlapped_draft_s)
        self.verify_seconds.observe(record.measured_s)
        self.step_nodes.observe(nodes)
        self.batch_size.observe(record.batch)

    def observe_output(self, output: RequestOutput, *, frontend: str) -> None:
        """Per streamed update: count tokens; on the final one, the request by finish reason and the prompt tokens
        it read from the prefix cache."""
        self.generation_tokens.inc(len(output.token_ids))
        if output.finish_reason is not None:
            if output.stats is not None:  # per request, so one that finished at its prefill counts too
                self.cached_prompt_tokens.inc(output.stats.cached_prompt_tokens)
            reason = output.finish_reason.value if isinstance(output.finish_reason, FinishReason) else str(output.finish_reason)
            self.requests.labels(finish_reason=reason, frontend=frontend).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
