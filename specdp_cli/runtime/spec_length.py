"""How many tokens a step drafts (k_step, 0..num_speculative_tokens), and how ranks agree on it.

Three modes, read from `speculative`:
  fixed           k_step = num_speculative_tokens;
  per batch size  `num_speculative_tokens_per_batch_size` ranges [start, end, k] over the number of
                  running sequences (vLLM's form); a batch size no range covers uses num_speculative_tokens;
  adaptive        k_step = argmax_k E[tokens per row | k] / E[step cost | k, rows]: acceptance per position
                  as running (decayed) averages; the cost of a decode step is measured per k, and a
                  step carrying prompt chunks costs its k's decode step plus what the chunks add (one
                  average per batch size over all such steps: the extra varies with the prompt rows a
                  step happens to carry, not with k), mixed by the measured share of chunk steps. A k
                  not yet measured is priced by a line through the measured ones (step time is
                  near-linear in k); at a batch size not yet measured so, by the nearest one's line moved
                  by the start-up timings' ratio; else by the start-up timings. Every EXPLORE_EVERY-th
                  choice tries a neighbour of the best k (one not yet measured first), so a k the
                  estimate undervalues gets measured and the choice can climb to it. A step time counts
                  at most OUTLIER x what the measurements expect, the first one of each kind is left out
                  and the next ones are averaged: a single stall must not price a k out of the choice
                  (it is measured again only when chosen).
                  How fast everything runs drifts (the host, clocks, the other rank in lockstep) by
                  more than k changes a step's cost; the chosen k is measured every step, the others
                  once in a while, so raw times would compare one k's now with another's then. Step
                  times are therefore kept relative to a running level (LEVEL_EMA), moved only by decode
                  steps of a kind measured more than MATURE times: the level follows the drift, the per-k
                  costs what k itself costs, and a k newly chosen on a guess learns its own price.
                  The engine feeds the model and asks for the choice while the device runs a step
                  (`Engine._plan_k`: the host would only wait for the result), so none of this is on a
                  step's critical path (on the H200 host it cost 20-50 us a step, 7 % of a codepair
                  step at batch 1, when it ran before the step's sync). It is still worked out again only
                  every CHOOSE_EVERY steps, on new rows, or when another k than the chosen one was
                  measured: with many rows draining it loops over each row, and a host slower than the
                  device's step would put it back on the critical path.
                  When an offline job has nothing left to admit (the engine says so), the objective
                  turns from tokens per second to finishing the running rows soonest (`_drain_choice`).

Agreement. The k of step s + 1 is decided at step s's sync, from what that sync carried: every rank
puts its batch size and its preferred k into the sync's fields, and every rank applies the same
rule to the same numbers — the preference of the rank holding the largest batch (lowest rank on
ties), which for ranges is "the ranges applied to the largest batch". So no extra collective, and
the step's drafter-forward count is known *before* the step is scheduled: it travels in the step's
own sync like any other size, and a rank that then plans a different count than the others is
out of step exactly as before (`Engine.agree`). Under `dp_sync: never` each rank follows its own
preference. The cost of this order is a lag of one step between a batch size and its k; an adaptive
preference, worked out while step s - 1 ran from the measurements of the steps before it, adds one
more (the k of step s + 1 has seen steps up to s - 2).

Test hook: SPECDP_TEST_K="R:k,k,...;R:..." makes rank R prefer those k in turn (one per step), so
tests can force ranks' local choices to differ. Diagnostics: SPECDP_TRACE_K=1 adds every measured step
to the report's `trace` ([k, rows, chunks, ms, the level after it or None for a kind's first step]): what
the choice saw over time.
"""
from __future__ import annotations

import math
import os
from collections import Counter
from typing import Callable

TEST_ENV = "SPECDP_TEST_K"
TRACE_ENV = "SPECDP_TRACE_K"
PRIOR_ACCEPT, PRIOR_WEIGHT = 0.6, 2.0     # acceptance before any measurement, as pseudo-counts
DECAY = 0.98                              # per-step decay of the acceptance counts (running averages)
COST_EMA = 0.05                           # weight of a new step-time measurement (once there are 20)
LEVEL_EMA = 0.2                           # weight of one step in the running level of all step times
OUTLIER = 2.0                             # a step time counts at most this factor times its expected time
OUTLIER_GUESS = 4.0                       # ... and a first one this factor times its guessed time
MATURE = 4                                # a kind's steps averaged before they move the running level
SHARE_EMA = 0.05                          # weight of one step in the share of steps carrying prompt chunks
EXPLORE_EVERY = 16                        # every so many choices, a neighbour of the best k is tried
DRAIN_PRIOR = 32.0                        # draft tokens of pooled acceptance a row's own acceptance is mixed with
CHOOSE_EVERY = 4                          # the best k is worked out again every so many choices (or new rows)


def forced_choices(rank: int) -> list[int] | None:
    text = os.environ.get(TEST_ENV, "")
    for part in filter(None, (p.strip() for p in text.split(";"))):
        r, _, ks = part.partition(":")
        if int(r) == rank:
            return [int(k) for k in ks.split(",")]
    return None


def running_average(old: float, sample: float, n: int) -> float:
    """The n-th sample's update: the mean of the first samples, then an exponential average (COST_EMA)."""
    w = max(COST_EMA, 1 / n)
    return (1 - w) * old + w * sample


def nearest_rows(measured, rows: int) -> int:
    """Of the batch sizes `measured`, the nearest to `rows` by ratio (the larger one on ties)."""
    return min(measured, key=lambda r: (abs(math.log(r / rows)), -r))


def interpolate(table: dict[tuple[int, int], float], R: float, T: float) -> float:
    """A cost measured at rows R_i (a grid) and tokens per row T_lo, T_hi, interpolated piecewise
    linearly in R, then linearly in T (and extrapolated past the ends)."""
    Rs = sorted({r for r, _ in table})
    Ts = sorted({t for _, t in table})
    t0, t1 = Ts[0], Ts[-1]
    i = max(0, min(len(Rs) - 2, sum(1 for r in Rs if r <= R) - 1))
    r0, r1 = Rs[i], Rs[min(i + 1, len(Rs) - 1)]
    fr = 0.0 if r1 == r0 else (R - r0) / (r1 - r0)
    ft = 0.0 if t1 == t0 else (T - t0) / (t1 - t0)

    def at(r):
        return table[(r, t0)] + (table[(r, t1)] - table[(r, t0)]) * ft
    return max(at(r0) + (at(r1) - at(r0)) * fr, 1e-6)


def schedule(k_max: int, ranges: list[list[int]] | None, adaptive: bool) -> dict:
    """The step k's schedule as the Plan records it: mode, ranges and every k a step can use (each gets its
    CUDA graphs). k_max = 0 (method none): mode none."""
    if not k_max:
        return {"mode": "none", "ranges": None, "k_values": [0]}
    if adaptive:
        return {"mode": "adaptive", "ranges": None, "k_values": list(range(k_max + 1))}
    if ranges:
        return {"mode": "per batch size", "ranges": [list(r) for r in sorted(ranges)],
                "k_values": sorted({k_max} | {r[2] for r in ranges})}
    return {"mode": "fixed", "ranges": None, "k_values": [k_max]}


class SpecLength:
    def __init__(self, k_max: int, ranges: list[list[int]] | None, adaptive: bool, rank: int = 0,
                 drafter_forward: str = "none"):
        """drafter_forward: "none" (no drafter model), "per_draft" (a draft model: one forward per draft),
        "always" (an EAGLE head: its first forward runs every step, drafting or not)."""
        self.k_max, self.ranges, self.adaptive = k_max, ranges, adaptive
        sched = schedule(k_max, ranges, adaptive)
        self.mode, self.k_values = sched["mode"], sched["k_values"]      # every k a step can use
        self.drafter_forward = drafter_forward
        self.forced = forced_choices(rank)
        self.calls = 0
        self._best: tuple | None = None                     # ((rows, draining), call, k) of the last worked-out choice
        self._modelled: dict = {}                           # (k, rows, timings taken) -> modelled seconds
        self.used: Counter = Counter()               # steps run with each k
        self.accepted = [PRIOR_ACCEPT * PRIOR_WEIGHT] * k_max
        self.reached = [PRIOR_WEIGHT] * k_max
        self.pool_drafted = self.pool_accepted = 0.0          # decayed draft tokens and accepted ones, all rows
        self.target_cost: dict[tuple[int, int], float] = {}     # (rows, tokens per row) -> seconds
        self.drafter_cost: dict[tuple[int, int], float] = {}
        self.measured: dict[tuple[int, int], float] = {}        # (rows, k) -> seconds of a decode step
        self.chunk_extra: dict[int, float] = {}                 # rows -> seconds prompt chunks add to a step
        self.chunk_steps: Counter = Counter()                   # rows -> chunk steps averaged into chunk_extra
        self.steps_seen: Counter = Counter()                    # (chunks, rows, k) -> steps of that kind observed
        self.chunk_share = 0.0                                  # running share of steps with prompt chunks
        self.ratio = 1.0                                        # measured / modelled step time
        self.ratio_samples = 0
        self.level = 1.0          # how fast steps run now, relative to the measurements (they are seconds / level)
        self.trace: list | None = [] if os.environ.get(TRACE_ENV) == "1" else None

    # -- the choice -----------------------------------------------------------------------------

    def for_batch(self, n: int) -> int:
        for start, end, k in self.ranges or ():
            if start <= n <= end:
                return k
        return self.k_max

    def preferred(self, n: int, rows: int, rows_left: Callable[[], list[tuple]] | None = None) -> int:
        """This rank's k for its next step: n running sequences, which take `rows` padded rows.
        `rows_left`: given when an offline job has nothing left to admit (the batch drains), each running sequence's
        (tokens left, draft tokens so far, accepted so far, drafts at all: False when the request opted
        out), called only when the choice is worked out."""
        self.calls += 1
        if self.forced:
            return min(self.forced[(self.calls - 1) % len(self.forced)], self.k_max)
        if self.adaptive and n and self.target_cost:
            # worked out again every CHOOSE_EVERY choices, when the rows change, or to explore (see the
            # module's text: host work in the device's time only while it is shorter than the step)
            explore = self.calls % EXPLORE_EVERY == 0
            key = (rows, rows_left is not None)
            if explore or self._best is None or self._best[0] != key or self.calls - self._best[1] >= CHOOSE_EVERY:
                cost = self.costs(rows)
                best = self._drain_choice(cost, rows_left()) if rows_left is not None else None
                if best is None:
                    tokens = self.tokens_all()
                    best = max(range(self.k_max + 1), key=lambda k: (tokens[k] / cost[k], -k))
                self._best = (key, self.calls, best)
            best = self._best[2]
            if explore:                                  # deterministic: the same calls on every run
                near = [k for k in (best + 1, best - 1) if 0 <= k <= self.k_max]
                # a neighbour never measured at these rows first (the larger one first): its price is a guess
                unmeasured = [k for k in near if (rows, k) not in self.measured]
                if unmeasured:
                    return unmeasured[0]
                return near[(self.calls // EXPLORE_EVERY) % len(near)] if near else best
            return best
        return self.for_batch(n)

    def _drain_choice(self, cost: list[float], rows_left: list[tuple]) -> int | None:
        """The k that finishes the running rows soonest when an offline job has nothing left to admit: its
        end waits for the row needing the most steps, and the rows left last are mostly those whose drafts are rarely accepted, where a
        larger k adds cost to every step and few tokens. Steps a row needs: tokens left / its expected
        tokens a step, from the pooled acceptance per position scaled by the row's own acceptance (mixed
        with DRAIN_PRIOR draft tokens of the pooled rate); a row that opted out gains a token a step whatever
        k is. None when no row has more than a token left."""
        pooled = self.pool_accepted / self.pool_drafted if self.pool_drafted else PRIOR_ACCEPT
        alpha = [a / r for a, r in zip(self.accepted, self.reached)]
        steps = [0.0] * (self.k_max + 1)
        for left, drafted, accepted, drafts in rows_left:
            if left <= 1:
                continue
            if not drafts:
                steps = [max(t, left) for t in steps]
                continue
            scale = (accepted + DRAIN_PRIOR * pooled) / (drafted + DRAIN_PRIOR) / max(pooled, 1e-6)
            total, p = 1.0, 1.0
            steps[0] = max(steps[0], left)
            for k in range(1, self.k_max + 1):
                p *= min(0.98, alpha[k - 1] * scale)
                total += p
                steps[k] = max(steps[k], left / total)
        if not steps[0]:
            return None
        return min(range(self.k_max + 1), key=lambda k: (cost[k] * steps[k], k))

    @staticmethod
    def agree(batches: list[int], prefs: list[int]) -> int:
        """The step's k from every rank's (batch size, preferred k): the preference of the rank with the
        largest batch, the lowest rank on ties — the same number on every rank."""
        best = max(range(len(batches)), key=lambda r: (batches[r], -r))
        return prefs[best]

    # -- the model ------------------------------------------------------------------------------

    def tokens(self, k: int) -> float:
        """Expected tokens a row gains in a step that drafts k: 1 + sum_i prod_{j <= i} alpha_j."""
        return self.tokens_all()[k]

    def tokens_all(self) -> list[float]:
        """tokens(k) for every k in 0..k_max, in one pass."""
        out, total, p = [1.0], 1.0, 1.0
        for a, r in zip(self.accepted, self.reached):
            p *= a / r
            total += p
            out.append(total)
        return out

    def cost(self, k: int, rows: int) -> float:
        return self.costs(rows)[k]

    def costs(self, rows: int) -> list[float]:
        """Expected seconds of a step of `rows` padded decode rows drafting k, for every k in
        0..k_max (one pass over the measurements: this runs every step): decode and chunk steps mixed
        by the share of chunk steps."""
        dec = self._decode_costs(rows)
        if self.chunk_share:
            share = self.chunk_share
            dec = [(1 - share) * d + share * c for d, c in zip(dec, self._chunk_costs(rows, dec))]
        return [self.level * c for c in dec]

    def _decode_costs(self, rows: int) -> list[float]:
        """A decode step: measured when such a step ran; else on the least-squares line through the
        k measured at these rows (two or more); else the line of the nearest rows measured so (the
        batch drains at the end of a job: at its new sizes the start-up timings of single forwards
        overprice k, while the measured steps' shape in k carries over), moved to these rows by the
        start-up timings' ratio between the two, else the start-up timings (target forward of k + 1
        tokens a row, k drafter forwards) scaled by how measured steps compared with them; either
        scaled to the one k measured at these rows, if any."""
        by_rows: dict[int, list[tuple[int, float]]] = {}
        for (r, j), t in self.measured.items():
            by_rows.setdefault(r, []).append((j, t))
        pts = by_rows.get(rows, [])
        if len(pts) >= 2:
            estimate = self._line(pts)
        else:
            shaped = [r for r, p in by_rows.items() if len(p) >= 2]
            if shaped:
                near = nearest_rows(shaped, rows)
                line = self._line(by_rows[near])
                estimate = [line[k] * self.modelled(k, rows) / self.modelled(k, near) for k in range(self.k_max + 1)]
            else:
                estimate = [self.modelled(k, rows) * self.ratio for k in range(self.k_max + 1)]
            if pts:
                j, t = pts[0]
                estimate = [e * t / estimate[j] for e in estimate]
        return [self.measured.get((rows, k), e) for k, e in enumerate(estimate)]

    def _line(self, pts: list[tuple[int, float]]) -> list[float]:
        """The least-squares line through measured (k, seconds) points, at every k (no lower than half
        the cheapest measured step: a noisy pair of points can send the line to ~0 at small k, and a
        guess too low gets its k chosen, then every measurement of it clipped)."""
        mk = sum(j for j, _ in pts) / len(pts)
        mt = sum(t for _, t in pts) / len(pts)
        slope = max(0.0, sum((j - mk) * (t - mt) for j, t in pts) / sum((j - mk) ** 2 for j, _ in pts))
        floor = 0.5 * min(t for _, t in pts)
        return [max(mt + slope * (k - mk), floor) for k in range(self.k_max + 1)]

    def _chunk_costs(self, rows: int, dec: list[float]) -> list[float]:
        """A step carrying prompt chunks: the decode step of its k plus what chunks add at these rows
        (else at the nearest rows measured: the chunks' own cost hardly depends on the decode rows)."""
        if not self.chunk_extra:
            return dec
        near = nearest_rows(self.chunk_extra, rows)
        return [max(d + self.chunk_extra[near], 1e-6) for d in dec]

    def modelled(self, k: int, rows: int) -> float:
        key = (k, rows, len(self.target_cost), len(self.drafter_cost))    # timings are taken once, at start-up
        t = self._modelled.get(key)
        if t is None:
            t = interpolate(self.target_cost, rows, k + 1)
            if self.drafter_cost and self.drafter_forward != "none":
                n = k if self.drafter_forward == "per_draft" else max(k, 1)
                t += n * interpolate(self.drafter_cost, rows, 1)
            self._modelled[key] = t
        return t

    def observe_rows(self, drafted_accepted: list[tuple[int, int]]) -> None:
        """After a step: each drafting row's (drafts, accepted). Position j is reached when the first
        j - 1 drafts were accepted; its average is accepted / reached, both decayed each step."""
        if not (self.adaptive and drafted_accepted):      # the model's input only (the summary counts acceptance itself)
            return
        # a histogram of the rows' (drafts, accepted) first: one cheap pass over the rows, then k_max^2 work
        hist = Counter(drafted_accepted)
        acc, reach = [0] * self.k_max, [0] * self.k_max
        self.pool_drafted *= DECAY
        self.pool_accepted *= DECAY
        for (n, a), count in hist.items():
            self.pool_drafted += n * count
            self.pool_accepted += a * count
            for j in range(min(a + 1, n)):
                reach[j] += count
            for j in range(a):
                acc[j] += count
        for j in range(self.k_max):
            if reach[j]:
                self.accepted[j] = DECAY * self.accepted[j] + acc[j]
                self.reached[j] = DECAY * self.reached[j] + reach[j]

    def observe_step(self, rows: int, k: int, seconds: float, chunks: bool = False) -> None:
        """A step's measured time (the host waits for its result, so this is the device time too);
        `chunks`: the step carried prompt chunks (then `rows` is the decode rows' padded count)."""
        if not self.target_cost or seconds <= 0:
            return
        self.chunk_share = (1 - SHARE_EMA) * self.chunk_share + SHARE_EMA * chunks
        seen = self.steps_seen[(chunks, rows, k)] = self.steps_seen[(chunks, rows, k)] + 1
        if seen == 1:
            # the first step of its kind may pay one-time costs (a graph's first replay, before start-up
            # replayed each once: 1.2-1.4 x its later steps on the H200): not a measurement of the kind
            if self.trace is not None:
                self.trace.append([k, rows, int(chunks), round(1e3 * seconds, 4), None])
            return
        if self._best is not None and k != self._best[2]:
            self._best = None            # news of another k than the chosen one: the choice is worked out again
        if chunks:
            self._observe_chunk_step(rows, k, seconds)
        else:
            self._observe_decode_step(rows, k, seconds, seen - 1)
        if self.trace is not None:
            self.trace.append([k, rows, int(chunks), round(1e3 * seconds, 4), round(self.level, 4)])

    def _observe_decode_step(self, rows: int, k: int, seconds: float, n: int) -> None:
        """n: the decode steps of this kind averaged so far, this one included."""
        old = self.measured.get((rows, k))
        expected = old if old is not None else (self._decode_costs(rows)[k] if self.measured else None)
        if expected is not None:
            # one stall (the OS, a collection, a rank waiting on another in lockstep) must not price a k
            # out of the choice for the rest of the job: this k is measured again only when chosen. (Only
            # upwards: noise that makes a step faster does not come in stalls, and an estimate that is too
            # high keeps its k from being chosen, so it must be able to fall at once.) A first
            # measurement is held only to a wider bound: its expectation is a guess.
            seconds = min(seconds, self.level * expected * (OUTLIER if old is not None else OUTLIER_GUESS))
        relative = seconds / self.level
        self.measured[(rows, k)] = running_average(old or 0.0, relative, n)
        # the drift, from kinds measured often enough that their cost is known: a k newly chosen whose
        # cost was guessed (or measured a few times) learns its cost against the level of the steps
        # before it, rather than having the level absorb the guess's error as if every step had slowed
        if n > MATURE:
            self.level *= 1 + LEVEL_EMA * (relative / old - 1)
        self.ratio_samples += 1
        self.ratio = running_average(self.ratio, relative / self.modelled(k, rows), self.ratio_samples)

    def _observe_chunk_step(self, rows: int, k: int, seconds: float) -> None:
        """A step with prompt chunks costs what the decode step of its k costs plus what the chunks add;
        that extra varies with how many prompt rows a step carries (on the H200's 8B shape 8-17 ms beside
        6-ms decode steps), not with k (every row is T_chunk wide whatever k is): one average per batch
        size over every chunk step, whatever its k, and no say in the level."""
        dec = self._decode_costs(rows)[k]
        old = self.chunk_extra.get(rows)
        if old is not None:
            seconds = min(seconds, self.level * (dec + old) * OUTLIER)
        n = self.chunk_steps[rows] = self.chunk_steps[rows] + 1
        self.chunk_extra[rows] = running_average(old or 0.0, seconds / self.level - dec, n)

    def reset_measurements(self) -> None:
        """Forget acceptance and measured step times (keep the start-up timings): a fresh workload."""
        self.accepted = [PRIOR_ACCEPT * PRIOR_WEIGHT] * self.k_max
        self.reached = [PRIOR_WEIGHT] * self.k_max
        self.pool_drafted = self.pool_accepted = 0.0
        self.measured.clear()
        self.chunk_extra.clear()
        self.chunk_steps.clear()
        self.steps_seen.clear()
        self.chunk_share = 0.0
        self.ratio = 1.0
        self.ratio_samples = 0
        self.level = 1.0
        self.used.clear()

    def describe(self, rows: int) -> list[dict]:
        """Per k, at `rows` padded rows: expected tokens per row and step, the step's cost, and their ratio."""
        if not self.target_cost:
            return []
        cost = self.costs(rows)

        def ms(k):
            return round(1e3 * self.level * self.measured[(rows, k)], 3) if (rows, k) in self.measured else None
        # the measured decode step times beside the model's cost: what it saw, to check its choice against
        return [{"k": k, "tokens_per_step": round(self.tokens(k), 3), "step_ms": round(1e3 * cost[k], 3),
                 "tokens_per_s_per_row": round(self.tokens(k) / cost[k], 1), "measured_decode_ms": ms(k)}
                for k in range(self.k_max + 1)]

    def report(self) -> dict:
        rows = max(self.measured, default=(1, 0))[0]
        return {"mode": self.mode, "k_values": self.k_values, "steps_by_k": {str(k): v for k, v in sorted(self.used.items())},
                "model_acceptance_per_position": ([round(a / r, 3) for a, r in zip(self.accepted, self.reached)]
                                                  if self.adaptive else []),
                "model_rows": rows, "model": self.describe(rows) if self.adaptive else [],
                "model_chunk_share": round(self.chunk_share, 3) if self.adaptive else None,
                "model_chunk_extra_ms": (round(1e3 * self.level * self.chunk_extra[rows], 3)
                                         if self.adaptive and rows in self.chunk_extra else None),
                "model_level": round(self.level, 3) if self.adaptive else None,
                **({"trace": self.trace} if self.trace is not None else {})}
