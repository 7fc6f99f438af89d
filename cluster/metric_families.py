"""The metric families flotilla exports: names, kinds, help, labels and buckets.

One table serves both exporters (a replica's ``/metrics`` and Ray's metrics
system, see ``cluster.metrics``) and the dashboard test: every name the Grafana
JSON queries must be one ``exported_sample_names`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "flotilla:"
RAY_PREFIX = "flotilla_"
RAY_EXPORT_PREFIX = "ray_"
REPLICA_LABELS = ("model_name", "replica")
DEPLOYMENT_LABELS = ("deployment",)

# Latency buckets (seconds), close to vLLM's: fine below 100 ms for ITL/TPOT,
# long tails for queueing and end-to-end time. Ray requires them positive.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
# Compiling one output constraint: ~0.1 ms (a regex) to seconds (a large schema).
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Moving one prompt's KV from a prefill replica to a decode replica: ~1 ms (a short prompt) to seconds.
TRANSFER_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                   20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family: ``name`` without prefix, its kind, help and labels."""

    name: str
    kind: str  # "gauge" | "counter" | "histogram"
    help: str
    labels: tuple[str, ...] = REPLICA_LABELS
    buckets: tuple[float, ...] = ()

    @property
    def exposition_name(self) -> str:
        """The family's name on a replica's ``/metrics``."""
        return PREFIX + self.name

    @property
    def ray_name(self) -> str:
        """The name given to ``ray.util.metrics``."""
        return RAY_PREFIX + self.name

    def sample_names(self, exported: str) -> set[str]:
        """The sample names a Prometheus scrape shows for the family exported as ``exported``."""
        if self.kind == "counter":
            return {exported + "_total"}
        if self.kind == "histogram":
            return {exported + s for s in ("_bucket", "_sum", "_count")}
        return {exported}


def _g(name: str, help: str, labels: tuple[str, ...] = REPLICA_LABELS) -> Family:
    return Family(name, "gauge", help, labels)


def _c(name: str, help: str, labels: tuple[str, ...] = REPLICA_LABELS) -> Family:
    return Family(name, "counter", help, labels)


def _h(name: str, help: str, buckets: tuple[float, ...]) -> Family:
    return Family(name, "histogram", help, REPLICA_LABELS, buckets)


REPLICA_FAMILIES: tuple[Family, ...] = (
    _g("num_requests_running", "Sequences in the running batch."),
    _g("num_requests_waiting", "Sequences waiting to be scheduled (including preempted ones)."),
    _g("kv_cache_usage_perc", "Fraction of KV pages held by requests (0..1; reclaimable cache pages count as free)."),
    _c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    _c("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    _c("prompt_tokens", "Prompt tokens of requests that started generating."),
    _c("generation_tokens", "Generated tokens."),
    _c("request_success", "Finished sequences by finish reason (stop, length, abort, error).",
       (*REPLICA_LABELS, "finished_reason")),
    _c("num_preemptions", "Preemptions of running sequences."),
    _c("engine_steps", "Engine steps run (one forward each)."),
    _c("engine_forward_seconds", "Seconds the engine spent in forwards; over engine_steps, seconds per step."),
    # Speculative decoding, as vLLM names it: acceptance rate is accepted_tokens / draft_tokens,
    # and accepted_tokens_per_pos{position=i} / num_drafts the chance draft token i survives.
    _c("spec_decode_num_drafts", "Speculative drafts verified (one per sequence per step that drafted)."),
    _c("spec_decode_num_draft_tokens", "Draft tokens proposed."),
    _c("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    _c("spec_decode_num_accepted_tokens_per_pos", "Drafts whose token at position (0-based) was accepted.",
       (*REPLICA_LABELS, "position")),
    # Structured output (actors/grammar): constrained requests, compile times, and the time the
    # engine's step spends on masks (over engine_steps: grammar seconds per step).
    _c("structured_output_requests", "Requests with an output constraint, by kind (json, json_object, regex, "
       "choice, grammar).", (*REPLICA_LABELS, "kind")),
    _c("structured_output_step_seconds", "Seconds the engine spent filling token masks and advancing grammar "
       "matchers, on the step's critical path."),
    _h("grammar_compile_seconds", "Time to compile one distinct output constraint (cached afterwards).",
       COMPILE_BUCKETS),
    # LoRA (actors/engine/lora_registry): requests per adapter and how long loading each took here.
    _c("lora_requests", "Requests admitted for a LoRA adapter, by adapter.", (*REPLICA_LABELS, "adapter")),
    _g("lora_load_seconds", "Seconds this replica's engine took to load a LoRA adapter (read, checked, "
       "cached on the host).", (*REPLICA_LABELS, "adapter")),
    _c("lora_resident_hits", "Adapter requests that found their adapter already loaded on this replica "
       "(over lora_resident_hits + lora_loads: the router's hit rate)."),
    _c("lora_loads", "Adapters this replica loaded on a request's arrival (the request waited for the load)."),
    # KV tiers (actors/engine/kv_tiers): per tier (host, disk, cluster) what this replica's engine asked,
    # found, moved, waited for, and the faults that became misses or dropped writes.
    _c("kv_tier_lookups", "KV blocks this replica asked a tier for.", (*REPLICA_LABELS, "tier")),
    _c("kv_tier_hits", "KV blocks found whole in a tier (loaded instead of computed).", (*REPLICA_LABELS, "tier")),
    _c("kv_tier_bytes_read", "Bytes of KV blocks read from a tier.", (*REPLICA_LABELS, "tier")),
    _c("kv_tier_bytes_written", "Bytes of KV blocks written to a tier.", (*REPLICA_LABELS, "tier")),
    _c("kv_tier_load_seconds", "Seconds spent reading KV blocks from a tier (off the step's path).",
       (*REPLICA_LABELS, "tier")),
    _c("kv_tier_errors", "Faults of a tier turned into misses or dropped writes (corrupt or foreign block, dead "
       "store, full disk): the warning metric.", (*REPLICA_LABELS, "tier")),
    _g("kv_tier_bytes", "Bytes a tier holds for this replica now (the cluster tier: written by it).",
       (*REPLICA_LABELS, "tier")),
    # Mixture of experts (actors/models/moe.py; absent for a dense model): tokens routed to expert i, summed over
    # the MoE layers (with expert parallelism rank r holds the same indices in every layer: summed by a rank's
    # indices, its load), and the hottest expert of any layer against its layer's mean (cluster.metrics).
    _c("moe_expert_tokens", "Tokens routed to an expert (each token counts once per expert it picks), summed over "
       "the MoE layers; padding rows not counted.", (*REPLICA_LABELS, "expert")),
    _g("moe_expert_load_imbalance", "Busiest expert's routed tokens over its layer's mean per expert, the largest of "
       "any MoE layer, over the latest window of enough routed tokens (1: even; num_experts / top_k: every token "
       "on the same experts)."),
    # Prefill/decode disaggregation, on decode replicas (apps.replica.disaggregation): prompts prefilled on the
    # prefill pool, retries of failed prefills, KV bytes received and the time moving them took.
    _c("pd_remote_prefills", "Prompts this decode replica had computed on the prefill pool."),
    _c("pd_prefill_retries", "Remote prefills retried after a prefill replica failed."),
    _c("pd_kv_transfer_bytes", "KV bytes received from the prefill pool."),
    _h("pd_kv_transfer_seconds", "Moving one prompt's KV from the prefill pool into this replica's scheduler "
       "(the remote call and the hand-over, less the prefill itself).", TRANSFER_BUCKETS),
    _c("process_cpu_seconds", "CPU seconds used by the engine process (rate() gives cores busy)."),
    _g("memory_used_bytes", "Resident memory of the engine process."),
    _g("memory_peak_bytes", "Peak resident memory of the engine process."),
    _g("memory_limit_bytes", "Memory the engine process may use (cgroup limit or physical RAM)."),
    _g("gpu_memory_used_bytes", "Memory in use on the engine's GPU (absent on CPU)."),
    _g("gpu_memory_total_bytes", "Size of the engine's GPU memory (absent on CPU)."),
    _g("gpu_utilization_perc", "Utilisation of the engine's GPU, 0..100 (absent without NVML)."),
    _h("time_to_first_token_seconds", "Arrival to first token, in the engine.", TTFT_BUCKETS),
    _h("inter_token_latency_seconds", "Time between a sequence's successive tokens, as the replica receives them.",
       TOKEN_BUCKETS),
    _h("request_time_per_output_token_seconds", "Mean time per output token after the first (finished sequences).",
       TOKEN_BUCKETS),
    _h("e2e_request_latency_seconds", "Arrival to last token (sequences that ended by stop or length).",
       REQUEST_BUCKETS),
    _h("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS),
)

CLUSTER_FAMILIES: tuple[Family, ...] = (
    Family("num_replicas", "gauge", "Replicas of the deployment when the autoscaler last decided.",
           DEPLOYMENT_LABELS),
    Family("target_replicas", "gauge", "Replicas the autoscaler last asked for.", DEPLOYMENT_LABELS),
    Family("scaling_decisions", "counter", "Autoscaling decisions that changed the replica count.",
           (*DEPLOYMENT_LABELS, "direction", "reason")),
)


def family(name: str) -> Family:
    """The family called ``name`` (no prefix)."""
    for f in REPLICA_FAMILIES + CLUSTER_FAMILIES:
        if f.name == name:
            return f
    raise KeyError(name)


def exported_sample_names() -> set[str]:
    """Every sample name a scrape can show, on replicas' ``/metrics`` and on Ray's endpoint."""
    names: set[str] = set()
    for f in REPLICA_FAMILIES + CLUSTER_FAMILIES:
        names |= f.sample_names(f.exposition_name)
        names |= f.sample_names(RAY_EXPORT_PREFIX + f.ray_name)
    return names
