"""Server metrics in the Prometheus text format, named like vLLM's (prefix `specdp:`)."""
from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)


class Histogram:
    def __init__(self, buckets):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.total}")
        out.append(f"{name}_count {self.n}")
        return out


class Metrics:
    def __init__(self, model_name: str):
        self.model = model_name
        self.lock = threading.Lock()
        self.outcomes: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        self.preemptions = 0
        self.steps_by_k: dict[int, int] = {}

    def steps(self, by_k: dict[int, int]) -> None:
        """Steps each rank ran with each k (the step k actually used: spec_length.py)."""
        with self.lock:
            for k, n in by_k.items():
                self.steps_by_k[k] = self.steps_by_k.get(k, 0) + n

    def finished(self, outcome: str, stats: dict | None, ttft: float | None, tpot: float | None) -> None:
        with self.lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)
            if not stats:
                return
            self.prompt_tokens += stats["prompt_tokens"]
            self.generation_tokens += stats["completion_tokens"]
            self.num_drafts += stats["num_drafts"]
            self.num_draft_tokens += stats["num_draft_tokens"]
            self.num_accepted_tokens += stats["num_accepted_tokens"]
            self.preemptions += stats.get("preemptions", 0)
            per = stats["accepted_per_pos"]
            if len(self.accepted_per_pos) < len(per):
                self.accepted_per_pos += [0] * (len(per) - len(self.accepted_per_pos))
            for i, v in enumerate(per):
                self.accepted_per_pos[i] += v

    def render(self, waiting: int, running: int, ranks_up: int, world: int) -> str:
        m = f'model_name="{self.model}"'
        with self.lock:
            lines = ["# TYPE specdp:request_success_total counter"]
            for outcome in sorted(set(self.outcomes) | {"stop", "length", "abort", "error"}):
                lines.append(f'specdp:request_success_total{{{m},finished_reason="{outcome}"}} '
                             f'{self.outcomes.get(outcome, 0)}')
            lines += ["# TYPE specdp:prompt_tokens_total counter", f"specdp:prompt_tokens_total{{{m}}} {self.prompt_tokens}",
                      "# TYPE specdp:generation_tokens_total counter",
                      f"specdp:generation_tokens_total{{{m}}} {self.generation_tokens}",
                      "# TYPE specdp:num_requests_waiting gauge", f"specdp:num_requests_waiting{{{m}}} {waiting}",
                      "# TYPE specdp:num_requests_running gauge", f"specdp:num_requests_running{{{m}}} {running}",
                      "# TYPE specdp:ranks_up gauge", f"specdp:ranks_up{{{m}}} {ranks_up}",
                      "# TYPE specdp:ranks gauge", f"specdp:ranks{{{m}}} {world}",
                      "# TYPE specdp:num_preemptions_total counter",
                      f"specdp:num_preemptions_total{{{m}}} {self.preemptions}",
                      "# TYPE specdp:time_to_first_token_seconds histogram"]
            lines += self.ttft.lines("specdp:time_to_first_token_seconds")
            lines += ["# TYPE specdp:time_per_output_token_seconds histogram"]
            lines += self.tpot.lines("specdp:time_per_output_token_seconds")
            lines += ["# TYPE specdp:spec_decode_num_drafts_total counter",
                      f"specdp:spec_decode_num_drafts_total{{{m}}} {self.num_drafts}",
                      "# TYPE specdp:spec_decode_num_draft_tokens_total counter",
                      f"specdp:spec_decode_num_draft_tokens_total{{{m}}} {self.num_draft_tokens}",
                      "# TYPE specdp:spec_decode_num_accepted_tokens_total counter",
                      f"specdp:spec_decode_num_accepted_tokens_total{{{m}}} {self.num_accepted_tokens}",
                      "# TYPE specdp:spec_decode_num_accepted_tokens_per_pos_total counter"]
            for i, v in enumerate(self.accepted_per_pos):
                lines.append(f'specdp:spec_decode_num_accepted_tokens_per_pos_total{{{m},position="{i}"}} {v}')
            # the step k actually used: steps per k, summed over the ranks (a histogram over steps)
            lines.append("# TYPE specdp:spec_decode_steps_by_k_total counter")
            for k, v in sorted(self.steps_by_k.items()):
                lines.append(f'specdp:spec_decode_steps_by_k_total{{{m},k="{k}"}} {v}')
        return "\n".join(lines) + "\n"


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
