"""Server metrics through prometheus_client: vLLM v1's set (names, suffixes, labels, buckets) under the
`specdp:` prefix, labelled per DP rank as vLLM labels its engines (`model_name`, `engine` = the rank).

What the ranks know (running / waiting requests, KV cache usage, preemptions, the step k used) comes
with their "out" messages (server/rank.py); what a request's client sees (TTFT, inter-token latency,
end-to-end latency, tokens) is measured by the frontend as the tokens arrive, and counted for the rank
that served the request. Each server has its own registry, so several servers can share a process.

With several API server processes (`server.api_server_count`), prometheus_client's multiprocess mode: each process
writes its values to files in one directory and /metrics, whichever process answers it, adds them up (counters
and histograms summed; the ranks' gauges, which only the first process sets, their maximum).
"""
from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..runtime.heap import collections_since_startup

try:        # the `_created` series of each counter and histogram: one more series each that nobody reads
    from prometheus_client import disable_created_metrics
    disable_created_metrics()
except ImportError:       # pragma: no cover - prometheus_client < 0.18
    pass

CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def share_between_processes(directory: str) -> None:
    """This process's metrics go to files in `directory`, shared with the other API server processes; before
    any Metrics is built (prometheus_client picks how values are kept from the environment when imported: set it
    again for a process that imported it already)."""
    from prometheus_client import values

    os.environ[MULTIPROC_ENV] = directory
    values.ValueClass = values.get_value_class()


def _multiprocess() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class Metrics:
    def __init__(self, model_name: str, world: int, max_model_len: int):
        self.model = model_name
        self.world = world
        self.registry = r = CollectorRegistry()
        engine = ["model_name", "engine"]

        def per_rank(metric) -> list:
            return [metric.labels(model_name, str(i)) for i in range(world)]

        def counter(name: str, doc: str) -> list:
            return per_rank(Counter(f"specdp:{name}", doc, engine, registry=r))

        def gauge(name: str, doc: str) -> list:       # set by the first API server process only
            return per_rank(Gauge(f"specdp:{name}", doc, engine, registry=r, multiprocess_mode="max"))

        def histogram(name: str, doc: str, buckets) -> list:
            return per_rank(Histogram(f"specdp:{name}", doc, engine, buckets=buckets, registry=r))

        # the scheduler of each rank, as its last message said
        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        success = Counter("specdp:request_success", "Count of successfully processed requests.",
                          engine + ["finished_reason"], registry=r)
        self.success = {reason: [success.labels(model_name, str(i), reason) for i in range(world)]
                        for reason in FINISH_REASONS}
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt = histogram("request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                            token_buckets)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        # speculative decoding: acceptance rate = accepted_tokens / draft_tokens, mean acceptance length
        # = 1 + accepted_tokens / drafts
        self.drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.accepted_per_pos = Counter("specdp:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", engine + ["position"], registry=r)
        # specdp's own: the step k actually used (spec_length.py), steps per k; and the ranks up
        self.steps_by_k = Counter("specdp:spec_decode_steps_by_k", "Engine steps run with each speculation length k.",
                                  engine + ["k"], registry=r)
        self.planned_ahead = counter("steps_planned_ahead", "Engine steps planned before the previous step's "
                                     "results were read (async scheduling).")
        self.chunk_steps = counter("steps_with_prompt_chunks", "Engine steps whose forwards were prompt-chunk wide.")
        self.busy = counter("rank_busy_seconds", "Seconds the rank was not waiting for requests (stepping, or "
                            "taking messages).")
        self.step_seconds = counter("rank_step_seconds", "Seconds the rank spent in engine steps (of its busy seconds; "
                                    "the rest is its serving loop's own work: taking requests, sending tokens).")
        self.rank_gc = counter("rank_gc_collections", "Garbage collections in the rank process since its start-up "
                               "heap was frozen.")
        self.rank_gc_pause = counter("rank_gc_pause_seconds", "Seconds the rank process spent in garbage collections "
                                     "since start-up (inside its steps or its serving loop's work).")
        # this API server process's garbage collections since its start-up heap was frozen (runtime/heap.py)
        self.gc_collections = Counter("specdp:api_server_gc_collections", "Garbage collections in the API server "
                                      "process(es) since start-up.", ["model_name"], registry=r).labels(model_name)
        self.gc_pause = Counter("specdp:api_server_gc_pause_seconds", "Seconds the API server process(es) spent in "
                                "garbage collections since start-up (their event loop stalled meanwhile).",
                                ["model_name"], registry=r).labels(model_name)
        self.ranks_up = Gauge("specdp:ranks_up", "Ranks connected to the frontend.", ["model_name"],
                              registry=r, multiprocess_mode="min").labels(model_name)
        Gauge("specdp:ranks", "Data-parallel ranks of the server.", ["model_name"], registry=r,
              multiprocess_mode="max").labels(model_name).set(world)
        self._gc_seen = {"gc_collections": 0, "gc_pause_s": 0.0}
        # the counters of a rank's totals, in its state's order after running, waiting and KV cache usage
        # (server/rank.py's `_state`), and each rank's totals counted so far
        self._totals = (self.preemptions, self.prefix_queries, self.prefix_hits, self.planned_ahead, self.chunk_steps,
                        self.busy, self.step_seconds, self.rank_gc, self.rank_gc_pause)
        self._seen = [(0,) * len(self._totals)] * world

    # -- from the ranks' messages (read on the event loop) -----------------------------------------

    def rank_report(self, rank: int, steps_by_k: dict[int, int], state: tuple | None = None) -> None:
        """A rank's "out" message: steps per k since its last one, and its scheduler's state after the
        step (running, waiting, KV cache usage 0..1; preemptions, prefix cache queries and hits, steps planned
        ahead, steps with prompt chunks, seconds busy and seconds in engine steps, garbage collections and their
        seconds so far)."""
        for k, n in steps_by_k.items():
            self.steps_by_k.labels(self.model, str(rank), str(k)).inc(n)
        self.publish_gc()
        if state is None:
            return
        running, waiting, kv_usage, *totals = state
        self.running[rank].set(running)
        self.waiting[rank].set(waiting)
        self.kv_usage[rank].set(kv_usage)
        for counter, now, seen in zip(self._totals, totals, self._seen[rank]):
            if now > seen:
                counter[rank].inc(now - seen)
        self._seen[rank] = tuple(totals)

    def publish_gc(self) -> None:
        """This process's garbage collections since its start-up heap was frozen (runtime/heap.py counts them),
        added to the counters since the last call: on the event loop, never in a collection's callback
        (prometheus_client's multiprocess values share one lock, which a collection may start under)."""
        now, seen = collections_since_startup(), self._gc_seen
        if now["gc_collections"] == seen["gc_collections"]:      # none since (most calls: one a rank's step message)
            return
        if now["gc_collections"] < seen["gc_collections"]:       # frozen again since (the count starts over)
            seen = {"gc_collections": 0, "gc_pause_s": 0.0}
        self.gc_collections.inc(now["gc_collections"] - seen["gc_collections"])
        self.gc_pause.inc(max(now["gc_pause_s"] - seen["gc_pause_s"], 0.0))
        self._gc_seen = now

    # -- from the frontend, as a request's tokens reach its handler ------------------------------

    def tokens_arrived(self, inf, n: int, now: float) -> None:
        """n new tokens of request `inf` (frontend.Inflight, not yet updated with them) at `now`."""
        rank = inf.rank
        self.generation_tokens[rank].inc(n)
        if inf.first_token_t is None:
            self.ttft[rank].observe(now - inf.created)
            self.prompt_tokens[rank].inc(len(inf.req.prompt_ids))
        else:
            self.itl[rank].observe(now - inf.last_token_t)

    def finished(self, inf, outcome: str, stats: dict | None, now: float) -> None:
        """Request `inf` ended with `outcome` (stop | length | abort | error); `stats`: the rank's, None
        when it failed or was aborted."""
        rank = inf.rank
        self.success.get(outcome, self.success["error"])[rank].inc()
        self.e2e[rank].observe(now - inf.created)
        if inf.n_tokens > 1:
            self.tpot[rank].observe((inf.last_token_t - inf.first_token_t) / (inf.n_tokens - 1))
        self.request_prompt[rank].observe(stats["prompt_tokens"] if stats else len(inf.req.prompt_ids))
        self.request_generation[rank].observe(stats["completion_tokens"] if stats else inf.n_tokens)
        if not stats:
            return
        self.queue_time[rank].observe(stats["queue_s"])
        self.prefill_time[rank].observe(stats["prefill_s"])
        self.decode_time[rank].observe(stats["decode_s"])
        self.inference_time[rank].observe(stats["prefill_s"] + stats["decode_s"])
        self.drafts[rank].inc(stats["num_drafts"])
        self.draft_tokens[rank].inc(stats["num_draft_tokens"])
        self.accepted_tokens[rank].inc(stats["num_accepted_tokens"])
        for pos, v in enumerate(stats["accepted_per_pos"]):
            self.accepted_per_pos.labels(self.model, str(rank), str(pos)).inc(v)

    def render(self, ranks_up: int) -> bytes:
        self.ranks_up.set(ranks_up)
        self.publish_gc()
        if not _multiprocess():
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)


def parse_prometheus(text: str) -> dict[str, float]:
    """name{labels} -> value, for the few counters a client reads back (bench serve)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            pass
    return out

