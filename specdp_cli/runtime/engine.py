"""The engine of one rank: a step loop of schedule -> draft -> verify -> accept -> bookkeeping.

One step, whatever the rank holds:
  1. the scheduler picks the running sequences (with k_eff each) and prompt chunks, preempting the
     newest sequences when KV blocks run out;
  2. the step sync agrees the size of every forward of the step between the ranks (lockstep: one
     collective; otherwise a local decision). It also answers "anything left?": when no rank has
     work the step ends there, so lockstep costs one collective per step, not a second vote;
  3. the step's per-row integers go to the device in one copy;
  4. the drafter phase runs its forwards on the device (exactly k in lockstep, also over a padding
     batch), the drafts staying on the device;
  5. one target forward verifies every row's drafts and prefills the prompt chunks;
  6. the rejection sampler accepts drafts and draws one more token per row, on the device;
     (an EAGLE head or an MTP layer runs its drafter phase here instead, after verification: it
     reads the target's hidden states and proposes the next step's drafts — `drafters/eagle.py`)
  7. one device-to-host copy brings the new tokens (and an EAGLE head's proposals) back for
     bookkeeping (stops, frees), and the progress guard counts a step in which no sequence gained a
     token, finished or failed (`progress.py`: a livelock stops with a sentence, never loops).
Every forward is uniform (padded rows x T tokens; a prompt chunk takes several rows) and replays a
CUDA graph; an all-greedy step replays one graph of all its device work. A rank with nothing to do
runs the very same code with no rows: each forward then carries only padding. That is the "dummy"
step — there is no second code path to keep in step.
"""
from __future__ import annotations

import os
import time
import zlib
from dataclasses import replace
from typing import Callable

import torch

from ..config import Config
from ..methods import METHODS
from ..plan import Plan
from .drafters.base import Drafter, Drafts, NoDrafter
from .drafters.draft_model import ModelDrafter
from .drafters.eagle import EagleDrafter
from .drafters.ngram import NgramDrafter
from .faults import EXIT_STATUS, Faults
from .heap import collections_since_startup
from .kv_cache import BlockPool, allocate_kv, kv_bytes_per_token
from . import async_rows, logits_process
from .models.decoder import routed_expert_bytes
from .models.loader import load_head, load_model
from .model_runner import ModelRunner, capture_sizes, pad_rows
from .output import OutputProcessor
from .progress import NoProgressError, ProgressGuard, StalledPeerError, describe_stall
from .sampling import SamplingParams, row_tensors, row_values, rows_on, verify
from .scheduler import PENDING, Request, Scheduler, Sequence, SpecStats, StepPlan
from .spec_length import SpecLength
from .structured import GrammarCompiler
from .step_inputs import DNREAL, DOUT, DSTART, FIRST, LEN, NDRAFT, NREAL, OUT, SRC, START, RowSpec, StepInputs
from . import step_package
from .step_package import StepPackage
from .step_types import (WIDE_CHUNKS, WIDE_DRAFTER, DeviceResult, LaunchedStep, ScheduledStep, StepContext, StepOutput,
                         StepSizes, StepSync)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHUNK_ROW_TOKENS = 16    # tokens per row in a step with prompt chunks (a chunk takes one row per 16 tokens)
CHUNK_ROWS = 32          # rows a step has for prompt chunks beyond max_num_seqs decode rows
HOLD_SHARE = 0.25        # async scheduling: the share of the batch that may sit a step out for the next to be planned ahead


class CaptureError(RuntimeError):
    kind = "graph-capture"


class RequestError(ValueError):
    """A request the engine cannot take (its message says why): that request fails, the rank goes on."""


class RankCounters:
    def __init__(self):
        self.steps = 0
        self.padding_steps = 0
        self.skipped_drafter_steps = 0
        self.generated_tokens = 0
        self.preemptions = 0
        self.planned_ahead = 0       # async scheduling: steps planned before the previous step's results were read
        self.chunk_steps = 0         # steps whose forwards were prompt-chunk wide (a prompt chunk rode in them)
        self.spec = SpecStats()
        self.weight_bytes: int | None = None       # device memory the loaded weights took (CUDA), None elsewhere
        self.expert_weight_bytes = 0               # of which routed experts (this rank's share under EP)
        self.first_step_t: float | None = None     # wall clock (comparable across ranks of a machine)
        self.last_step_t: float | None = None
        self.spec_length: SpecLength | None = None    # the step k's schedule, its counts and model
        self.pool: BlockPool | None = None            # the KV blocks (its prefix cache's queries and hits)

    def report(self, rank: int, requests: int) -> dict:
        return {"rank": rank, "requests": requests, "steps": self.steps, "padding_steps": self.padding_steps,
                "skipped_drafter_steps": self.skipped_drafter_steps, "generated_tokens": self.generated_tokens,
                "preemptions": self.preemptions, "planned_ahead": self.planned_ahead,
                "chunk_steps": self.chunk_steps, "weight_bytes": self.weight_bytes,
                "expert_weight_bytes": self.expert_weight_bytes, "first_step_t": self.first_step_t,
                "last_step_t": self.last_step_t, "spec": vars(self.spec),
                "spec_length": self.spec_length.report() if self.spec_length else None,
                "prefix_cache": {"queries": self.pool.queries, "hits": self.pool.hits} if self.pool else None,
                **collections_since_startup()}


def _exit_process(code: int, message: str) -> None:
    os._exit(code)


def request_seed(global_seed: int, req_id) -> int:
    """The seed of a request that gives none: stable for its id, so reruns and any DP size agree."""
    return zlib.crc32(f"{global_seed}:{req_id!r}".encode()) & 0x7FFFFFFF


class Engine:
    def __init__(self, cfg: Config, plan: Plan, dp, device: torch.device, faults: Faults | None = None,
                 on_fault_exit=None, started_at: float | None = None, launch: dict[str, float] | None = None):
        """Load the models, build their runners and the drafter, size and allocate the KV cache, capture
        the CUDA graphs: each phase timed for the start-up report."""
        t_begin = time.time()
        self.cfg, self.plan, self.dp, self.device = cfg, plan, dp, device
        self.tp = dp.tp             # tensor parallelism: this DP rank's TP group (dist.TPGroup), else None
        self.faults = faults or Faults()
        self.on_fault_exit = on_fault_exit or _exit_process
        meth = METHODS[cfg.speculative.method]
        self.k = cfg.speculative.num_speculative_tokens if meth.drafts else 0
        self.lookahead = self.k - 1 if meth.after_verify else 0     # positions an EAGLE head writes past the verified ones
        self.M = cfg.max_model_len
        self.D = plan.drafter_max_model_len or self.M
        self.output = OutputProcessor(cfg.tokenizer_path, cfg.model)
        self.counters = RankCounters()

        target, draft, head = self._load_models(meth)
        models = [m for m in (target, draft, head) if m is not None]
        t_loaded = time.time()
        self._build_runners(target, draft, head, meth)
        self._init_async(plan.async_scheduling)
        self.vocab = target.vocab_size                  # the target's logits (a padded vocabulary: past the tokenizer)
        self.grammars = GrammarCompiler(self.output.tokenizer, self.vocab, self.output.eos)
        num_blocks = self._num_blocks(models)
        if self.tp is not None:         # each process sized its own: the leader's block ids must fit every one
            num_blocks = self.tp.agree_min(num_blocks, "sizing the KV cache")
        for m in models:
            allocate_kv(m, num_blocks, cfg.cache.block_size)
        self.pool = self.counters.pool = BlockPool(num_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching)
        t_kv = time.time()
        self._capture_graphs()
        if self.spec_len.adaptive:
            self._time_forwards()
        t_captured = time.time()

        self.startup = {"launch_s": max(0.0, t_begin - started_at) if started_at else 0.0,
                        "load_s": t_loaded - t_begin, "kv_alloc_s": t_kv - t_loaded,
                        "capture_s": t_captured - t_kv}
        self.scheduler = Scheduler(self.pool, cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens, self.k,
                                   self.M, self.D, max_rows=self.row_sizes[-1], row_tokens=self.T_chunk,
                                   lookahead=self.lookahead, reads_drafter_kv=self.drafter.prefills,
                                   drafter_kv_upto=self.drafter.kv_upto)
        self.launch = launch or {}
        who = f"rank {dp.rank}" + (f" (TP rank {self.tp.rank} of {self.tp.world})" if self.tp is not None else "")
        self.ready_line = (f"{who} ready in {t_captured - (started_at or t_begin):.1f} s: "
                           + ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in self.startup.items())
                           + (" (launch: " + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in self.launch.items()) + ")"
                              if self.launch else "")
                           + f"; KV cache {num_blocks} blocks x {cfg.cache.block_size} tokens; {self.graphs} CUDA graphs"
                           + (f"; draft model split over {self.tp.world} processes"
                              if draft is not None and draft.tp is not None else "")
                           + (" (enforce_eager)" if cfg.enforce_eager and device.type == "cuda" else "")
                           + (f"; step sync over {dp.sync_transport}" if dp.lockstep else ""))
        self.step_no = 0
        # set by an offline job once it has handed over every input: when nothing waits to be admitted the
        # adaptive k then finishes the running rows soonest (the job's end) instead of maximising tokens per
        # second. A server leaves it off: a request may come at any time, and each one's latency counts.
        self.drain_to_finish = False
        # the progress guard: a stall stops the job (every rank, at the next step's sync), or with
        # fail_stalled (a server) fails the stalled requests and goes on
        self.progress = ProgressGuard(self.scheduler.prefill_steps)
        self.fail_stalled = False
        self._stalled: str | None = None       # a stall's sentence, until the next step's sync stops every rank

    def _load_models(self, meth) -> tuple:
        """(target, draft model or None, EAGLE head / MTP layer or None) on the device; under expert parallelism
        each holds this rank's experts."""
        cfg, plan, device, spec = self.cfg, self.plan, self.device, self.cfg.speculative
        dtype = DTYPES[plan.dtype]
        # rotary tables reach past M: a padding row of a drafter forward may sit up to k positions beyond
        positions = self.M + self.k + self.lookahead + 2
        ep = self.dp if plan.expert_parallel else None
        allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        target = load_model(cfg.model, dtype, device, positions, ep=ep, quantization=cfg.quantization, tp=self.tp)
        # the draft model replicated on every process of the TP group, or split over it as the target
        draft = (load_model(spec.model, dtype, device, positions, quantization=spec.quantization,
                            tp=self.tp if plan.draft_tensor_parallel_size > 1 else None)
                 if meth.separate_lm else None)
        head = (load_head(spec.method, cfg.model if meth.in_target else spec.model, target, dtype, device, positions,
                          ep) if meth.after_verify else None)
        c = self.counters
        c.weight_bytes = torch.cuda.memory_allocated(device) - allocated_before if allocated_before is not None else None
        c.expert_weight_bytes = sum(routed_expert_bytes(m) for m in (target, draft, head) if m is not None)
        return target, draft, head

    def _build_runners(self, target, draft, head, meth) -> None:
        """The step's buffers, the target's runner, the drafter (with its runner) and the step k's schedule."""
        cfg, device, spec = self.cfg, self.device, self.cfg.speculative
        models = [m for m in (target, draft, head) if m is not None]
        bs, n_seqs = cfg.cache.block_size, cfg.scheduler.max_num_seqs
        self.T_chunk = max(CHUNK_ROW_TOKENS, self.k + 1)       # row width of a step with prompt chunks
        self.decode_sizes = capture_sizes(n_seqs)               # rows of a decode step
        self.row_sizes = capture_sizes(n_seqs + CHUNK_ROWS)     # rows of a step with prompt chunks too
        max_rows = self.row_sizes[-1]
        for m in models:
            allocate_kv(m, 1, bs)                    # a trash block only, until the pool is sized
        self.inputs = StepInputs(max_rows, self.T_chunk, -(-(self.M + self.k + 1 + self.lookahead) // bs), device)
        drafter_forward = ("none" if draft is None and head is None else "always" if head is not None else "per_draft")
        sched = self.plan.speculation
        self.spec_len = SpecLength(self.k, sched["ranges"], sched["mode"] == "adaptive", self.dp.rank, drafter_forward)
        self.counters.spec_length = self.spec_len
        self.k_next = self.k                 # the next step's k (decided at each step's sync)
        self.k_pref = self.k                 # adaptive: this rank's preference, worked out while a step ran
        self._observed: tuple | None = None  # adaptive: the last step's measurements, read in while the next runs
        windows = [k + 1 for k in self.spec_len.k_values]     # verification widths: a graph per k
        self.target = ModelRunner(target, device, self.inputs.block_table, bs, max_rows,
                                  [1, *windows, self.T_chunk], window=self.k + 1,
                                  keep_hidden="all" if head is not None and head.needs_target_hidden else None)
        self.drafter: Drafter
        if draft is not None:
            runner = ModelRunner(draft, device, self.inputs.block_table, bs, max_rows, [1, 2, self.T_chunk], window=1)
            self.drafter = ModelDrafter(runner, self.D, self.k)
        elif head is not None:
            runner = ModelRunner(head, device, self.inputs.block_table, bs, max_rows, [1, *windows, self.T_chunk],
                                 window=1, keep_hidden="window")
            self.drafter = EagleDrafter(runner, self.target, self.k)
        elif meth.prompt_lookup:
            self.drafter = NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            self.drafter = NoDrafter()
        self.runners = [self.target] + ([self.drafter.runner] if self.drafter.has_forward else [])

    def _init_async(self, on: bool) -> None:
        """Async scheduling (vLLM's name): the host schedules and stages step N + 1 while the device runs step N,
        and reads step N's results while N + 1 runs. What the host does not know yet about a sequence in step N
        stays on the device, written at the end of every step's device work for each row (`async_rows.record`): its
        last emitted token, how many of its drafts verification rejected, the drafts an EAGLE head or MTP layer proposed
        for its next step, or the tokens a draft model has not seen yet. Step N + 1's rows of such sequences name N's
        row (SRC) and take them there (`_feed`): the token, the drafts or the draft model's catch-up, and their
        positions moved back by the rejected drafts (the host counted every draft as accepted). Results come back
        through two pinned buffers, used in turn, each with an event."""
        self.async_sched = on
        self._inflight: LaunchedStep | None = None     # the step whose device work is queued, results unread
        self._drained: list[StepOutput] = []           # outputs of a step completed early, for step() to return
        max_rows = self.row_sizes[-1]
        self.carry = async_rows.Carry.allocate(max_rows if on else 0, self.k, self.drafter.after_verify,
                                               self.drafter.catches_up, self.device)
        pin = self.device.type == "cuda"
        cols = 2 * self.k + 2                           # tokens (<= k + 1), their count, proposed drafts (<= k)
        self._tables = [torch.zeros(max_rows * cols, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._tb = 0

    def _capture_graphs(self) -> None:
        """On a GPU: a CUDA graph per forward size of each runner, and of each step kind's whole device work.
        Under expert parallelism the graphs hold the MoE layers' NCCL collectives: every rank captures (and
        warms up) the same graphs in the same order, and a rank replays the graph of the forward sizes the
        step sync agreed, padding or not, so the ranks' collectives match by construction. Their capture is
        thread-local: the process group's watchdog thread queries CUDA events meanwhile."""
        self.graphs = 0
        self.step_graphs: dict[tuple, tuple] = {}
        if self.device.type != "cuda" or self.cfg.enforce_eager:
            return
        self.graph_pool = torch.cuda.graph_pool_handle()
        # collectives inside the graphs (expert or tensor parallelism): the process group's watchdog thread
        # queries CUDA events meanwhile, so the capture is thread-local
        collectives = self.plan.expert_parallel or self.tp is not None
        self.capture_mode = "thread_local" if collectives else "global"
        try:
            with torch.no_grad():
                self.graphs = sum(r.capture({T: self.row_sizes if T == self.T_chunk else self.decode_sizes
                                             for T in r.t_values}, self.graph_pool, self.capture_mode)
                                  for r in self.runners)
                self._capture_steps()
        except RuntimeError as e:
            if not collectives:
                raise
            what = "expert parallelism's" if self.plan.expert_parallel else "tensor parallelism's"
            raise CaptureError(f"capturing {what} collectives in CUDA graphs failed on rank "
                               f"{self.dp.rank} ({str(e).splitlines()[0][:300]}); set enforce_eager: true to run "
                               f"them eagerly") from None
        self.graphs += len(self.step_graphs)

    @torch.no_grad()
    def _time_forwards(self) -> None:
        """The adaptive k's cost model: the target's forward at every decode batch size (a CUDA graph
        each), 1 and k + 1 tokens a row, and the drafter's (1 token a row), timed over padding rows (a
        warm-up run, then the best of three; on CUDA synchronized around each)."""
        cuda = self.device.type == "cuda"

        def timed(runner, R, T) -> float:
            best = float("inf")
            for i in range(4):
                if cuda:
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                runner.forward(R, T, graphs=not self.cfg.enforce_eager)
                if cuda:
                    torch.cuda.synchronize(self.device)
                if i:
                    best = min(best, time.perf_counter() - t0)
            return best

        self.inputs.stage([], self.decode_sizes[-1])
        for R in self.decode_sizes:
            for T in (1, self.k + 1):
                self.spec_len.target_cost[(R, T)] = timed(self.target, R, T)
            if self.drafter.has_forward:      # a draft model, or an EAGLE head / MTP layer (its forwards 2..k)
                self.spec_len.drafter_cost[(R, 1)] = self.spec_len.drafter_cost[(R, 2)] = timed(self.drafter.runner, R, 1)

    def _num_blocks(self, models) -> int:
        """KV blocks: what preflight resolved (`cache.num_blocks`, or on CPU enough for max_num_seqs
        full-length sequences); on a GPU what `gpu_memory_utilization` leaves after the weights and
        the peak activations of the largest forward (measured by running it, as vLLM does)."""
        c = self.cfg.cache
        per_block = sum(kv_bytes_per_token(m) for m in models) * c.block_size
        if self.plan.num_blocks:
            n = self.plan.num_blocks
        elif self.device.type != "cuda":
            raise RuntimeError("internal error: preflight sizes the KV cache of a CPU run")
        else:
            peak = self._profile_activations()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = c.gpu_memory_utilization * total - (total - free) - peak
            n = int(budget // per_block)
        need = -(-self.M // c.block_size)
        if n < need:
            raise RuntimeError(
                f"the KV cache holds {n} blocks of {c.block_size} tokens ({n * c.block_size} tokens), less than one "
                f"sequence of max_model_len {self.M} needs ({need} blocks): raise cache.gpu_memory_utilization or "
                f"cache.num_blocks, or lower max_model_len")
        return n

    @torch.no_grad()
    def _profile_activations(self) -> int:
        """Peak bytes the largest forward allocates beyond what is held now."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        for r in self.runners:
            r.forward(self.row_sizes[-1], self.T_chunk, graphs=False)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return peak + (256 << 20)            # headroom: CUDA graph pools, library workspaces

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.faults.arrived(self.dp.rank, req.id)
        self.scheduler.add(req)

    def make_request(self, req_id, prompt_ids: list[int], params: SamplingParams, seed: int | None,
                     block_hashes: list[bytes] | None = None) -> Request:
        """Raises RequestError when the request's grammar cannot be followed with this tokenizer. `block_hashes`:
        the prompt's full blocks' (`block_hash.block_hashes`) when the server's frontend worked them out."""
        params.seed = seed if seed is not None else request_seed(self.cfg.seed, req_id)
        grammar = None
        if params.structured_outputs and self.tp is not None:
            raise RequestError("structured output is not supported with tensor_parallel_size > 1 yet (a grammar's "
                               "state lives in the TP group's leader); run this request at tensor_parallel_size 1")
        if params.structured_outputs:
            try:
                grammar = self.grammars.grammar(params.structured_outputs)
            except Exception as e:  # noqa: BLE001 - llguidance on this tokenizer: the request's failure, not the rank's
                raise RequestError(f"structured output cannot be followed with this model's tokenizer: {e}") from None
        return Request(req_id, prompt_ids, params, grammar, block_hashes)

    def abort(self, req_id) -> bool:
        """Drop a waiting or running request (between steps); False when it is unknown."""
        found, seq = self.scheduler.abort(req_id)
        if seq is not None:
            seq.finish_reason = "abort"
        return found

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def step_in_flight(self) -> bool:
        """A launched step's device work is still running (async scheduling: `step` returned before it ended)."""
        return self._inflight is not None

    def _rows_left(self) -> list[tuple[int, int, int, bool]]:
        """Each running sequence's (tokens left to generate, draft tokens so far, accepted so far, drafts at
        all: the request did not opt out)."""
        return [(s.limit - s.L, s.stats.num_draft_tokens, s.stats.num_accepted_tokens, s.req.params.speculative)
                for s in self.scheduler.running]

    @property
    def free_slots(self) -> int:
        """Requests the batch could take now: max_num_seqs less those running or waiting."""
        sc = self.scheduler
        return max(0, sc.max_num_seqs - len(sc.running) - len(sc.waiting))

    # -- the step -----------------------------------------------------------------------------------

    def drafter_forwards(self, rows: list[tuple[Sequence, int]], any_rows: bool, k: int) -> int:
        """How many drafter forwards this step runs, for the step's k: exactly k in lockstep (the
        padding batch included), k over a padding batch under policy dummy, otherwise as many as the
        longest draft needs, and none when there is nothing to draft under policy skip. A drafter that
        proposes after verification drafts for the next step of every row: k whenever there are rows."""
        if not self.drafter.has_forward:
            return 0
        has_draft = any_rows if self.drafter.after_verify else bool(rows)
        if self.plan.lockstep or (not has_draft and self.plan.policy == "dummy"):
            wanted = k
        elif self.drafter.after_verify:
            wanted = k if has_draft else 0
        else:
            wanted = max((ke for _, ke in rows), default=0)
        return self.faults.drafter_forwards(self.dp.rank, has_draft, wanted)

    def agree(self, synced: list[StepSync], step: int, k: int) -> StepSizes | None:
        """Every rank's row of the step sync -> the step's sizes, computed alike on every rank (wide bits:
        prompt chunks ride in the step's forwards / a drafter catches up); None when no rank has work and
        every rank has received the same messages (see `server/rank.py`): the ranks stop stepping together.
        A rank whose last step ended a stall stops every rank here, together. Also decides the next step's
        k from the batch sizes and preferences (`SpecLength.agree`): the same numbers give the same k
        everywhere."""
        stalled = [r for r, f in enumerate(synced) if f.stalled]
        if stalled:
            if self._stalled is not None:
                raise NoProgressError(self._stalled)
            raise StalledPeerError(f"stopped with rank {stalled[0]}, which made no progress (its message says "
                                   f"why), at step {step}")
        self.k_next = SpecLength.agree([f.batch for f in synced], [f.preferred_k for f in synced])
        if not any(f.has_work for f in synced) and len({f.received for f in synced}) == 1:
            return None
        Ks = [f.drafter_forwards for f in synced]
        if len(set(Ks)) > 1 and self.faults.guard:
            self.dp.out_of_step([f"step {step}, start of step: {K} drafter forward{'' if K == 1 else 's'} planned"
                                 for K in Ks])
        K = Ks[self.dp.rank if self.dp.lockstep else 0]      # the same on every rank unless the guard is off
        T_dec = max(f.window for f in synced)
        chunks = any(f.wide & WIDE_CHUNKS for f in synced)
        wide_drafter = any(f.wide for f in synced)
        return StepSizes(R_pad=pad_rows(max(max(f.rows for f in synced), 1), self.row_sizes), K=K, T_dec=T_dec,
                         T=self.T_chunk if chunks else T_dec, T1=self.T_chunk if wide_drafter else 2, k=k)

    def _rows(self, plan, drafts: Drafts) -> list[RowSpec]:
        """The step's rows: each decode row (its last token and drafts), then each prompt chunk cut
        into rows of T_chunk tokens."""
        rows = []
        for i, ((s, _), n) in enumerate(zip(plan.decode, drafts.n)):
            d_start, d_toks, n = self.drafter.catch_up(s, n, self.T_chunk) if n else (0, [], 0)
            # a last token and drafts still on the device (async scheduling) are fed there, from the row of the
            # step before (`_feed`)
            if s.pending:
                toks, src = [0] * (1 + (n if drafts.host is not None else 0)), s.pending_row
            else:
                toks, src = [s.tokens[-1]] + (drafts.host[i][:n] if drafts.host is not None else []), -1
            rows.append(RowSpec(s, start=s.L - 1, tokens=toks, n_real=1 + n, first_pos=s.L, n_drafts=n,
                                d_start=d_start, d_tokens=tuple(d_toks), src=src))
        W = self.T_chunk
        for s, start, end in plan.prefill:
            pre = self.drafter.prefills(s)
            for a in range(start, end, W):
                b = min(end, a + W)
                toks = s.tokens[a:b]
                rows.append(RowSpec(s, start=a, tokens=toks, n_real=b - a, out_start=b - a - 1, first_pos=b,
                                    d_start=a, d_tokens=tuple(toks) if pre else (),
                                    done=b == end == s.prefill_len and s.samples_after_prefill,
                                    next_token=s.tokens[b] if b < s.L else -2))
        return rows

    @torch.no_grad()
    def step(self, received: int = 0, while_device_runs: Callable[[], None] | None = None) -> list[StepOutput] | None:
        """One step: schedule -> sync -> execute -> update. None when it found no work on any rank (in
        lockstep: every rank returns None from the same step). `received`: a server rank's count of
        frontend messages; `while_device_runs`: host work (e.g. writing the last step's results) done while
        the device runs this step, off the step's critical path — in lockstep, uneven host work is time the
        other ranks wait.

        With async scheduling the step's device work is still running when step returns, and the outputs
        returned are those of the step before it, read while this one runs (a step's outputs come one call
        later; the last ones with the call that finds no more work)."""
        sched = self._schedule(received)
        synced = self.dp.sync_step(sched.sync, sched.step)
        if self.dp.lockstep:
            synced = [StepSync._make(row) for row in synced]
        sizes = self.agree(synced, sched.step, sched.k)
        if sizes is None:
            # (a step still on the device holds only rows of finished sequences here: any rank with a live
            # row says it has work; in lockstep a rank with outputs to return does too, so all return None)
            outputs = self._drained + (self._complete() if self._inflight is not None else [])
            self._drained = []
            return outputs or None
        # the drafter phase runs when it drafts, when an EAGLE head learns the verified positions (every
        # step: their features exist only now), or when some rank feeds it prompt chunks or a catch-up
        drafter_runs = self.drafter.has_forward and bool(sizes.K or self.drafter.after_verify
                                                         or any(f.feeds_drafter for f in synced))
        launched = self._launch(sched, sizes, drafter_runs)
        if while_device_runs is not None:
            while_device_runs()
        if self.spec_len.adaptive:
            self._plan_k(sched.sync.batch)
        outputs, self._drained = self._drained, []
        if self._inflight is not None:
            outputs += self._complete()        # the step before, read while this one runs
        if self.async_sched:
            self._inflight = launched
        else:
            outputs += self._finish(launched)
        return outputs

    def _plan(self) -> StepPlan:
        """The scheduler's plan. With a step still on the device (async scheduling) the next one is planned
        before that step's results are read when it can be: nothing has to be preempted, no running request
        needs its tokens on the host first (a grammar, penalties or other logits processing, log-probabilities,
        the freeze fault), and the plan has rows. A sequence of that step whose next row depends on what
        verification does with its drafts (`settled`: its drafts, whether it has reached its limit) is planned
        with the drafts of its shortest length when only its limit is at stake (`drafts_ahead`: greedy requests);
        otherwise it sits this step out, as does one whose drafter cannot take its next inputs on the device
        (`feeds_on_device`): it waits one step rather than the whole batch waiting for the host — while such
        sequences are at most HOLD_SHARE of the batch (a step's cost hardly depends on its rows: past that, the rows
        it would leave empty cost more than the host's time). Otherwise that step is completed first (step returns
        its outputs)."""
        if self._inflight is not None:
            sc = self.scheduler
            if self.faults.frozen_id is None and not any(s.req.special or s.req.grammar is not None
                                                         for s in sc.running):
                hold, ahead = set(), {}
                for s in sc.running:
                    if not s.pending:
                        continue
                    feeds = self.drafter.feeds_on_device(s)
                    if feeds and sc.settled(s):
                        continue
                    n = sc.drafts_ahead(s) if feeds else None
                    if n is None:
                        hold.add(s)
                    else:
                        ahead[s] = n
                plan = (sc.schedule(preempt=False, hold=hold, ahead=ahead) if len(hold) <= HOLD_SHARE * len(sc.running)
                        else None)
                if plan is not None and (plan.decode or plan.prefill):
                    self.counters.planned_ahead += 1
                    return plan
            self._drained += self._complete()
        return self.scheduler.schedule()

    def _schedule(self, received: int) -> ScheduledStep:
        """This rank's part of the step: the scheduler's rows, the drafter forwards it plans, its sync row."""
        self.step_no += 1
        step = self.step_no
        self.dp.publish(step, "start of step")
        if self.faults.exit_step(self.dp.rank) == step:
            self.on_fault_exit(EXIT_STATUS, f"fault injection exit:{self.dp.rank}:{step}")
        if self.faults.slow:
            time.sleep(self.faults.step_delay(self.dp.rank))     # fault injection: a straggler rank
        c = self.counters
        if c.first_step_t is None:
            c.first_step_t = time.time()
        t_start = time.perf_counter()
        k = self.scheduler.k_step = self.k_next
        plan = self._plan()
        c.preemptions += plan.preempted
        drafting = [(s, ke) for s, ke in plan.decode if ke >= 1]
        K = self.drafter_forwards(drafting, bool(plan.decode or plan.prefill), k)
        if self.drafter.has_forward and not drafting and K == 0:
            c.skipped_drafter_steps += 1
        rows = self._rows(plan, self.drafter.host_drafts(plan.decode, K))
        n_drafts = [r.n_drafts for r in rows[:len(plan.decode)]]
        batch = len(self.scheduler.running)
        sl = self.spec_len
        # adaptive: the preference worked out while the last step ran (`_plan_k`); fixed k and ranges: now
        preferred = self.k_pref if sl.adaptive else sl.preferred(batch, pad_rows(max(batch, 1), self.row_sizes))
        wide = (WIDE_CHUNKS if plan.prefill else 0) | (WIDE_DRAFTER if any(len(r.d_tokens) > 2 for r in rows) else 0)
        # (in lockstep, outputs still to return count as work: every rank then returns None from the same step)
        has_work = bool(rows) or self.has_work or (self.dp.lockstep and bool(self._drained))
        sync = StepSync(len(rows), K, 1 + k if (K or any(n_drafts)) else 1, wide, int(has_work), received, batch,
                        preferred, int(any(r.d_tokens for r in rows)), int(self._stalled is not None))
        return ScheduledStep(step, k, plan, rows, n_drafts, sync, t_start)

    def _launch(self, sched: ScheduledStep, sizes: StepSizes, drafter_runs: bool) -> LaunchedStep:
        """The step's device work over the agreed sizes, queued with its one copy back to the host."""
        rows, step = sched.rows, sched.step
        self.inputs.stage(rows, sizes.R_pad)
        n_decode = len(sched.plan.decode)
        # rows drawing tokens whose request asks for log-probabilities or changed logits (most steps: none)
        special = [(i, r) for i, r in enumerate(rows) if r.seq.req.special and (i < n_decode or r.done)]
        asked = [r.seq.req.params.logprobs for _, r in special if r.seq.req.params.logprobs is not None]
        pkg = StepPackage(step, sizes, drafter_runs, max(asked, default=-1),
                          row_values([r.seq.req.params for r in rows], pad_to=sizes.R_pad),
                          logits_process.build(special, sizes.R_pad, self.vocab, self.output.eos, self.device)
                          if special else None)
        if self.tp is not None:        # the followers run this step's device work with the leader
            step_package.send(self.tp, pkg, self.inputs)
            self.tp.verify(pkg.decision(), step, "step package")
        ctx = self._context(pkg, rows)
        table, logprobs = self._run_device_step(ctx)
        host, event = self._copy_out(table, len(rows))
        if self.drafter.after_verify:
            drafter_padding = drafter_runs and not rows
        else:
            drafter_padding = drafter_runs and (not sched.sync.feeds_drafter or sizes.K > max(sched.n_drafts, default=0))
        if not rows or drafter_padding:
            self.counters.padding_steps += 1          # some forward of the step ran over padding rows only
        self.drafter.after_step(ctx)
        for s, _start, end in sched.plan.prefill:     # the prompt positions the step writes
            s.target_len = end
            self.scheduler.commit(s)
        proposes = self._proposes(ctx)
        if self.async_sched:
            # the tokens each row emits count in its sequence's L until they are read, every draft as accepted
            # (`unsure`: how many may not be); an EAGLE head's / MTP layer's proposals stand as K placeholders
            proposed = [PENDING] * sizes.K if proposes else None
            for i, r in enumerate(rows):
                if i < n_decode or r.done:
                    s = r.seq
                    s.tokens += [PENDING] * (1 + r.n_drafts)
                    s.pending += 1 + r.n_drafts
                    s.pending_row, s.unsure = i, r.n_drafts
                    if proposed is not None:
                        s.next_drafts = proposed
        return LaunchedStep(sched, sizes, host, event, proposes,
                            tuple(t[:len(rows)] for t in logprobs) if logprobs is not None else None)

    def _complete(self) -> list[StepOutput]:
        """Read the results of the step still on the device (waiting for it) and keep its books."""
        launched, self._inflight = self._inflight, None
        return self._finish(launched)

    def _finish(self, launched: LaunchedStep) -> list[StepOutput]:
        return self._update(launched.sched, launched.sizes, self._read(launched))

    @staticmethod
    def _read(launched: LaunchedStep) -> DeviceResult:
        """A launched step's results on the host (waiting for its device work)."""
        if launched.event is not None:
            launched.event.synchronize()
        # as Python lists in one call: the bookkeeping reads every element (per-element numpy scalars cost ~10 %
        # of a host-bound step's time at batch 32)
        table = launched.table.numpy().tolist() if launched.table is not None else ()
        logprobs = tuple(t.cpu().numpy() for t in launched.logprobs) if launched.logprobs is not None else None
        return DeviceResult(table, launched.sizes.T_dec, launched.proposed, logprobs)

    def _context(self, pkg: StepPackage, rows: list[RowSpec]) -> StepContext:
        """What the step's device work reads, from its package (a TP follower's: no rows of its own)."""
        step = pkg.step
        return StepContext(step, rows, pkg.sizes, self.inputs, rows_on(*pkg.sampling, self.device),
                           lambda what: self.dp.publish(step, what), graphs=not self.cfg.enforce_eager,
                           drafter_runs=pkg.drafter_runs, adjust=pkg.adjust, logprobs=pkg.logprobs)

    @torch.no_grad()
    def follow(self) -> None:
        """A TP follower's loop, until its leader says stop: each step's package (step_package.py) staged as
        the leader staged it, then the very device work the leader runs (`_run_device_step`: the same forwards,
        so the same collectives). Its results stay here: the leader keeps the books."""
        pkg = None
        while True:
            self.dp.publish(self.step_no, "waiting for the next step package")
            if pkg is not None and self.faults.skips_package(self.dp.proc, self.tp.packages + 1):
                self.tp.packages += 1          # fault injection: this package is missed, the last one run again
            else:
                pkg = step_package.receive(self.tp, self.inputs, self.device, self.step_no)
                if pkg is None:
                    return
                pkg = self.faults.alter_package(self.dp.proc, self.tp.packages, pkg)
            self.step_no = pkg.step
            self.tp.verify(pkg.decision(), pkg.step, "step package")
            self._run_device_step(self._context(pkg, []))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)     # the host rows are refilled for the next step
            self.counters.steps += 1

    def stop_followers(self) -> None:
        """The leader's last word to its TP followers (their `follow` returns)."""
        if self.tp is not None:
            step_package.stop(self.tp, self.step_no)

    def _update(self, sched: ScheduledStep, sizes: StepSizes, result: DeviceResult) -> list[StepOutput]:
        """Bookkeeping: accepted tokens, stops and frees, the adaptive k's measurements, the progress guard."""
        c, plan, rows, W = self.counters, sched.plan, sched.rows, result.W
        n_decode = len(plan.decode)
        outputs = []
        verified = []                       # (drafts, accepted) of each drafting row: the acceptance averages
        frozen = self.faults.frozen_id      # fault injection (`freeze`): None unless a request is frozen
        live = False
        for i, (row, res) in enumerate(zip(rows, result.table)):
            s = row.seq
            if s.finish_reason is not None:     # finished or aborted while this step ran (async scheduling): void
                continue
            live = True
            if i < n_decode or row.done:
                # async scheduling: the placeholders of a step launched after this one stay
                later = max(s.drop_pending() - 1 - row.n_drafts, 0)
                new = [] if frozen is not None and i < n_decode and s.req.id == frozen else \
                    res[:res[W]]
                n_drafts = row.n_drafts
                if plan.ahead and s in plan.ahead:
                    # planned ahead with the drafts of its shortest length: the contract's k_eff at its length now,
                    # and the tokens verification emitted past it (past its limit) cut
                    n_drafts = self.scheduler.drafts(s, k_step=sched.k)
                    new = new[:n_drafts + 1]
                out = self._accept(s, n_drafts, new, self._logprobs(result.logprobs, i, row, new))
                outputs.append(out)
                if later and not out.finished:
                    s.tokens += [PENDING] * later
                    s.pending = later
                    s.target_len += 1        # the later step writes this position (its first token: final)
                else:
                    s.unsure = 0
                if n_drafts:
                    verified.append((n_drafts, min(res[W], n_drafts + 1) - 1))
                if result.proposed and not later:     # (with a later step: its proposals, on the device)
                    row.seq.next_drafts = res[W + 1:]
        sl = self.spec_len
        sl.used[sched.k] += 1
        if sl.adaptive:                     # read in by `_plan_k` while the next step runs
            step_s = time.perf_counter() - sched.t_start
            if rows and sizes.T1 == 2 and sizes.T == sizes.T_dec:        # a plain decode step: its cost
                timed = (sizes.R_pad, sizes.T_dec - 1, step_s, False)
            elif rows and plan.decode and sizes.T != sizes.T_dec:        # decode rows riding in a chunk step
                timed = (pad_rows(sched.sync.batch, self.row_sizes), sched.k, step_s, True)
            else:
                timed = None
            self._observed = (verified, timed)
        progressed = False
        for out in outputs:
            if out.finished:
                c.spec.merge(out.seq.stats)
                self.scheduler.remove(out.seq)
                progressed = True
            elif out.new_tokens:
                progressed = True
        if self.progress.after_step(live or bool(self.scheduler.waiting), progressed):
            outputs += self._stall(sched.step)
        c.steps += 1
        c.chunk_steps += sizes.T != sizes.T_dec
        c.last_step_t = time.time()
        return outputs

    def _stall(self, step: int) -> list[StepOutput]:
        """The progress guard fired: say which sequences stalled; a server fails them (the running ones,
        or the waiting ones when none runs) and goes on, a job stops at the next step's sync."""
        sc = self.scheduler
        message = describe_stall(self.dp.rank, step, self.progress.limit, sc.running, sc.waiting, self.pool.num_free,
                                 self.k, self.D, self.M)
        if not self.fail_stalled:
            self._stalled = message
            return []
        failed = list(sc.running or sc.waiting)
        for s in failed:
            sc.abort(s.req.id)
            s.finish_reason, s.error = "error", message
        return [StepOutput(s, [], True) for s in failed]

    def _plan_k(self, batch: int) -> None:
        """The adaptive k's host work, done while the device runs a step (the host would only wait for
        its result): the previous step's measurements go in, this rank's preferred k comes out. It rides
        in the next step's sync, so it is the k of the step after that: one step more of lag than
        working it out before the sync, and none of the model's host time on any step's critical path
        (on the H200 host, 20-50 us a step; a codepair step at batch 1 takes 0.4-0.8 ms)."""
        sl = self.spec_len
        if self._observed is not None:
            verified, timed = self._observed
            self._observed = None
            sl.observe_rows(verified)
            if timed is not None:
                rows, k, seconds, chunks = timed
                sl.observe_step(rows, k, seconds, chunks=chunks)
        draining = self.drain_to_finish and not self.scheduler.waiting
        self.k_pref = sl.preferred(batch, pad_rows(max(batch, 1), self.row_sizes),
                                   self._rows_left if draining else None)

    def _proposes(self, ctx: StepContext) -> bool:
        """The step's drafter proposes the next step's drafts after verification (an EAGLE head, an MTP layer)."""
        return ctx.drafter_runs and self.drafter.after_verify

    def _run_device_step(self, ctx: StepContext) -> tuple[torch.Tensor, tuple | None]:
        """An all-greedy step of a kind captured at start-up replays one CUDA graph of its whole
        device work; any other step runs its forwards' graphs one by one."""
        sz = ctx.sizes
        key = (sz.R_pad, sz.K, sz.T_dec, sz.T, sz.T1, ctx.drafter_runs)
        whole = ctx.graphs and ctx.rt["all_greedy"] and ctx.adjust is None and ctx.logprobs < 0
        graph = self.step_graphs.get(key) if whole else None
        if graph is None:
            return self._device_step(ctx)
        graph[0].replay()
        return graph[1]

    def _step_kinds(self) -> list[tuple[list[int], StepSizes, bool]]:
        """The steps captured whole: (row counts, sizes with R_pad unset, drafter phase runs) of a
        decode step and of a step with prompt chunks, for every k the schedule can choose (with
        continuous batching, prompt chunks ride in a large share of the steps), as this job's method and
        policy run them. Rarer kinds (fewer drafts near the drafter's limit, a drafter catching up, a
        fault's drafter count) run their forwards' graphs one by one."""
        Tc = self.T_chunk
        dec, wide = self.decode_sizes, self.row_sizes
        ks = self.spec_len.k_values
        if self.drafter.has_forward:
            kinds = [(dec, StepSizes(0, j, j + 1, j + 1, 2, k=j), bool(j) or self.drafter.after_verify) for j in ks]
            kinds += [(wide, StepSizes(0, j, j + 1, Tc, Tc, k=j), True) for j in ks if j]
            if 0 in ks or (not self.plan.lockstep and self.plan.policy == "skip" and not self.drafter.after_verify):
                # prompt chunks with nothing to draft: a step at k = 0, or (skip policy, a drafter drafting
                # before verification) no decode row that fits the drafter
                kinds.append((wide, StepSizes(0, 0, 1, Tc, Tc), True))
            return kinds
        windows = sorted({1} | {j + 1 for j in ks})     # ngram: a step drafts (up to its k) or it does not
        return [(sizes, StepSizes(0, 0, W, T, T1), False) for W in windows
                for sizes, T, T1 in ((dec, W, 2), (wide, Tc, Tc))]

    def _capture_steps(self) -> None:
        """Capture the whole device work of each step kind over a padding batch (every row padding:
        the staged inputs are zeros, so the capture writes only the trash block)."""
        for sizes, kind, runs in self._step_kinds():
            for i, R in enumerate(sorted(sizes, reverse=True)):
                sz = replace(kind, R_pad=R)
                self.inputs.stage([], R)
                ctx = StepContext(0, [], sz, self.inputs, row_tensors([], self.device, pad_to=R), lambda what: None,
                                  graphs=False, drafter_runs=runs)
                if i == 0:
                    self._device_step(ctx)         # once eagerly per kind: library workspaces, first-call set-up
                    torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.graph_pool, capture_error_mode=self.capture_mode):
                    outputs = self._device_step(ctx)
                self.step_graphs[(R, sz.K, sz.T_dec, sz.T, sz.T1, runs)] = (g, outputs)
        # one replay of each over a padding batch (it writes only the trash block, as an idle rank's
        # step does): a graph's first replay pays one-time costs, on the H200 1.2-1.4 x a later one, that
        # would otherwise land on the job's first step of each kind (with adaptive k: of each k)
        self.inputs.stage([], max(R for R, *_ in self.step_graphs) if self.step_graphs else 1)
        for g, _ in self.step_graphs.values():
            g.replay()
        torch.cuda.synchronize(self.device)

    def _device_step(self, ctx: StepContext) -> tuple:
        """The step on the device: the drafter's forwards, the target's, verification (an EAGLE head
        proposes after it). Reads only the staged inputs; returns (a table [R_pad, T_dec + 1 (+ K)]: each row's
        tokens, how many of them it emits and the next step's drafts (EAGLE, MTP), what the step's one
        device-to-host copy reads; the log-probabilities of the tokens or None). What a request asks of the
        distribution (logits_process.py) changes the verified logits; log-probabilities are the target's own (as
        vLLM reports them by default)."""
        sz, inp, t = ctx.sizes, ctx.inputs, self.target
        R, T, W = sz.R_pad, sz.T, sz.T_dec
        drafts = probs = None
        if self.async_sched:       # what the host has not read yet: from the rows of the step before
            self._feed(inp, R)
        if ctx.drafter_runs and not self.drafter.after_verify:
            drafts, probs = self.drafter.propose(ctx)
            if drafts is not None and self.tp is not None and self.tp.check:
                self._check_drafts(ctx.step, drafts)
        ctx.publish("target forward")
        n = inp.col(NDRAFT, R)
        t.set_rows(R, inp.target_ids(R, T), inp.col(START, R), inp.col(NREAL, R), inp.col(OUT, R))
        ids = t.ids[:R * T].view(R, T)
        if drafts is not None and W > 1:
            ids[:, 1:W] = torch.where(n.view(R, 1) > 0, drafts, ids[:, 1:W])
        logits = t.forward(R, T, ctx.graphs)[:, :W]
        drafted = ids[:, 1:W]
        verified = logits if ctx.adjust is None else ctx.adjust.apply(logits, drafted, n)
        out, n_out = verify(verified, drafted, n, probs, ctx.rt, inp.col(FIRST, R))
        cols = [out, n_out.view(R, 1)]
        if self._proposes(ctx):
            cols.append(self.drafter.propose_after(ctx, out, n_out))
            if self.tp is not None and self.tp.check:     # (a follower's go unused: the leader's travel next step)
                self._check_drafts(ctx.step, cols[-1])
        table = torch.cat(cols, 1)
        if self.async_sched:       # for the next step's rows to read (`_feed`)
            async_rows.record(table, W, table.shape[1] - W - 1, n, inp.col(FIRST, R), self.carry)
        return table, token_logprobs(logits, out, ctx.logprobs) if ctx.logprobs >= 0 else None

    def _feed(self, inp: StepInputs, R: int) -> None:
        """The staged rows take what the step before left on the device for them (`async_rows.feed`)."""
        o = inp.ints
        async_rows.feed(inp.dev[:R], (inp.tids, inp.dids, o + START, o + FIRST, o + NDRAFT, o + SRC, o + DSTART,
                                      o + DNREAL, o + DOUT, o + LEN), self.carry)

    def _check_drafts(self, step: int, drafts: torch.Tensor) -> None:
        """check_collectives under tensor parallelism: the drafts that feed the target's forward are the same on
        every process of the group (the replicated drafter computed them from identical inputs), and so are the
        drafts an MTP layer split over the group proposes; eager steps only (reading them back would break a CUDA
        graph's capture)."""
        if drafts.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        self.tp.verify((f"drafts crc32={zlib.crc32(drafts.cpu().numpy().tobytes())}",), step, "drafts")

    def _copy_out(self, table: torch.Tensor, n: int):
        """The step's one device-to-host copy, queued: the first n rows of its table (each row's tokens, how many
        of them count, and the drafts proposed for its next step). On CUDA into a pinned buffer (two, used in
        turn: the previous step's may still be read) with an event to wait for: (host tensor, event or None)."""
        if n == 0:
            return None, None
        table = table[:n]
        if table.device.type != "cuda":
            return table, None
        self._tb ^= 1
        host = self._tables[self._tb][:table.numel()].view(table.shape)
        host.copy_(table, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    @staticmethod
    def _logprobs(result: tuple | None, i: int, row, new: list[int]) -> list | None:
        """Row i's log-probabilities of its `new` tokens, with the alternatives its request asks for."""
        k = row.seq.req.params.logprobs
        if k is None or result is None:
            return None
        chosen, top_ids, top_lp = result
        return [(float(chosen[i, j]), [(int(t), float(v)) for t, v in zip(top_ids[i, j, :k], top_lp[i, j, :k])])
                for j in range(len(new))]

    def _accept(self, s: Sequence, n_drafts: int, new: list[int], logprobs: list | None = None) -> StepOutput:
        """`new`: the tokens verification emitted (none only under the `freeze` fault: the sequence stays
        where it was, its last token to be fed again); `logprobs`: theirs, when the request asks."""
        old_len = s.L
        accepted = len(new) - 1
        if n_drafts and new:
            s.stats.add(n_drafts, accepted)
        s.target_len = old_len + accepted
        if n_drafts:
            self.drafter.on_accept(s, old_len, accepted, n_drafts)
        self.scheduler.commit(s)
        emitted = self.output.append(s, new)
        self.counters.generated_tokens += len(emitted)
        if emitted and s.first_token_t is None:
            s.first_token_t = time.monotonic()
        grammar = s.req.grammar
        if grammar is not None and s.finish_reason != "error" and not grammar.accept(emitted):
            s.finish_reason, s.error = "error", f"structured output: {grammar.error}"
        if s.logprobs is not None and logprobs is not None:
            logprobs = logprobs[:len(emitted)]
            s.logprobs += logprobs
        return StepOutput(s, emitted, s.finish_reason is not None, logprobs)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple:
    """The target's log-probabilities [R, W] of `tokens` [R, W] at the verified positions, and its k most likely
    tokens there (ids, log-probabilities [R, W, k])."""
    lp = torch.log_softmax(logits.float(), -1)
    top = lp.topk(k, -1) if k else None
    return (lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
            top.indices if top is not None else tokens.unsqueeze(-1)[..., :0],
            top.values if top is not None else lp[..., :0])
