"""The engine of one rank: a step loop of schedule -> draft -> verify -> accept -> bookkeeping.

One step, whatever the rank holds:
  1. the scheduler picks the running sequences (with k_eff each) and prompt chunks, preempting the
     newest sequences when KV blocks run out;
  2. the step sync agrees the size of every forward of the step between the ranks (lockstep: one
     collective; otherwise a local decision);
  3. the step's per-row integers go to the device in one copy;
  4. the drafter phase runs its forwards on the device (exactly k in lockstep, also over a padding
     batch), the drafts staying on the device;
  5. one target forward verifies every row's drafts and prefills the prompt chunks;
  6. the rejection sampler accepts drafts and draws one more token per row, on the device;
  7. one device-to-host copy brings the new tokens back for bookkeeping (stops, frees).
Decode forwards are uniform (padded rows x T tokens) and replay CUDA graphs; a step with prompt
chunks runs its forwards as mixed batches, eagerly. A rank with nothing to do runs the very same
code with no rows: each forward then carries only padding. That is the "dummy" step — there is no
second code path to keep in step.
"""
from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import Config
from ..preflight import Plan
from .drafters.base import Drafter, Drafts, NoDrafter
from .drafters.draft_model import ModelDrafter
from .drafters.ngram import NgramDrafter
from .faults import EXIT_STATUS, Faults
from .kv_cache import BlockPool, allocate_kv, kv_bytes_per_token
from .model import load_model
from .model_runner import MixedBatch, MixedRow, ModelRunner, capture_sizes, pad_rows
from .output import OutputProcessor
from .sampling import SamplingParams, row_tensors, verify
from .scheduler import Request, Scheduler, Sequence, SpecStats
from .step_inputs import DRAFTS, LAST, LEN, NDRAFT, StepInputs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepOutput:
    seq: Sequence
    new_tokens: list[int]
    finished: bool


@dataclass
class StepSizes:
    """What every rank of a lockstep step agrees on before its first forward."""
    R_pad: int            # rows of every uniform forward (a CUDA graph size)
    K: int                # drafter forwards
    T: int                # tokens per decode row in the target forward (1 + draft slots)
    draft_mixed: int      # tokens of a mixed first drafter forward (padding included), 0 when uniform
    target_mixed: int     # tokens of a mixed target forward (padding included), 0 when uniform


@dataclass
class StepContext:
    step: int
    rows: list[tuple[Sequence, int]]              # decode rows (sequence, k_eff), in row order
    prefill: list[tuple[Sequence, int, int]]
    sizes: StepSizes
    inputs: StepInputs
    rt: dict                                      # sampling settings of the R_pad rows
    publish: Callable[[str], None]
    padding: list[bool] = field(default_factory=list)   # per phase: did it run over a padding batch only


class RankCounters:
    def __init__(self):
        self.steps = 0
        self.padding_steps = 0
        self.skipped_drafter_steps = 0
        self.generated_tokens = 0
        self.preemptions = 0
        self.spec = SpecStats()
        self.first_step_t: float | None = None     # wall clock (comparable across ranks of a machine)
        self.last_step_t: float | None = None

    def report(self, rank: int, requests: int) -> dict:
        return {"rank": rank, "requests": requests, "steps": self.steps, "padding_steps": self.padding_steps,
                "skipped_drafter_steps": self.skipped_drafter_steps, "generated_tokens": self.generated_tokens,
                "preemptions": self.preemptions, "first_step_t": self.first_step_t,
                "last_step_t": self.last_step_t, "spec": vars(self.spec)}


def _exit_process(code: int, message: str) -> None:
    os._exit(code)


def request_seed(global_seed: int, req_id) -> int:
    """The seed of a request that gives none: stable for its id, so reruns and any DP size agree."""
    return zlib.crc32(f"{global_seed}:{req_id!r}".encode()) & 0x7FFFFFFF


def default_num_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Enough blocks for max_num_seqs full-length sequences (the CPU default)."""
    return max_num_seqs * -(-max_model_len // block_size)


class Engine:
    def __init__(self, cfg: Config, plan: Plan, dp, device: torch.device, faults: Faults | None = None,
                 on_fault_exit=None, started_at: float | None = None):
        t_begin = time.time()
        self.cfg, self.plan, self.dp, self.device = cfg, plan, dp, device
        self.faults = faults or Faults()
        self.on_fault_exit = on_fault_exit or _exit_process
        spec = cfg.speculative
        self.k = spec.num_speculative_tokens if spec.method != "none" else 0
        self.M = cfg.max_model_len
        self.D = plan.drafter_max_model_len or self.M
        self.output = OutputProcessor(cfg.tokenizer_path, cfg.model)
        dtype = DTYPES[plan.dtype]

        # rotary tables reach past M: a padding row of a drafter forward may sit up to k positions beyond
        positions = self.M + self.k + 2
        target = load_model(cfg.model, dtype, device, positions)
        draft = load_model(spec.model, dtype, device, positions) if spec.method == "draft_model" else None
        models = [m for m in (target, draft) if m is not None]
        t_loaded = time.time()

        bs = cfg.cache.block_size
        self.row_sizes = capture_sizes(cfg.scheduler.max_num_seqs)
        max_rows = self.row_sizes[-1]
        max_blocks = -(-(self.M + self.k + 1) // bs)
        for m in models:
            allocate_kv(m, 1, bs)                    # a trash block only, until the pool is sized
        self.inputs = StepInputs(max_rows, self.k, max_blocks, device)
        self.target = ModelRunner(target, device, self.inputs.block_table, bs, max_rows,
                                  [1, self.k + 1] if self.k else [1], "all")
        self.drafter: Drafter
        if draft is not None:
            runner = ModelRunner(draft, device, self.inputs.block_table, bs, max_rows, [1, 2], "last")
            self.drafter = ModelDrafter(runner, self.D, self.k)
        elif spec.method == "ngram":
            self.drafter = NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            self.drafter = NoDrafter()
        self.runners = [self.target] + ([self.drafter.runner] if draft is not None else [])
        num_blocks = self._num_blocks(models)
        for m in models:
            allocate_kv(m, num_blocks, bs)
        self.pool = BlockPool(num_blocks, bs)
        t_kv = time.time()

        self.graphs = 0
        if device.type == "cuda" and not cfg.enforce_eager:
            with torch.no_grad():
                self.graphs = sum(r.capture(self.row_sizes) for r in self.runners)
        t_captured = time.time()
        self.startup = {"launch_s": max(0.0, t_begin - started_at) if started_at else 0.0,
                        "load_s": t_loaded - t_begin, "kv_alloc_s": t_kv - t_loaded,
                        "capture_s": t_captured - t_kv}
        self.scheduler = Scheduler(self.pool, cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens,
                                   self.k, self.M, self.D)
        self.ready_line = (f"rank {dp.rank} ready in {t_captured - (started_at or t_begin):.1f} s: "
                           + ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in self.startup.items())
                           + f"; KV cache {num_blocks} blocks x {bs} tokens; {self.graphs} CUDA graphs"
                           + (" (enforce_eager)" if cfg.enforce_eager and device.type == "cuda" else ""))
        self.counters = RankCounters()
        self.step_no = 0

    def _num_blocks(self, models) -> int:
        """KV blocks: `cache.num_blocks` when set; on CPU enough for max_num_seqs full-length
        sequences; on a GPU what `gpu_memory_utilization` leaves after the weights and the peak
        activations of the largest forwards (measured by running them, as vLLM does)."""
        c = self.cfg.cache
        per_block = sum(kv_bytes_per_token(m) for m in models) * c.block_size
        if c.num_blocks:
            n = c.num_blocks
        elif self.device.type != "cuda":
            n = default_num_blocks(self.cfg.scheduler.max_num_seqs, self.M, c.block_size)
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
        """Peak bytes the largest mixed and uniform forwards allocate beyond what is held now."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.cfg.scheduler.max_num_batched_tokens, self.M)
        rows = self.row_sizes[-1]
        trash = [0] * -(-n // self.cfg.cache.block_size)           # every position in the trash block
        for r in self.runners:
            r.mixed(MixedBatch([MixedRow(trash, 0, [0] * n, n, "last")], n_pad=n))
            r.uniform(rows, max(r.t_values))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return peak + (256 << 20)            # headroom: CUDA graph pools, library workspaces

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)

    def make_request(self, req_id, prompt_ids: list[int], params: SamplingParams, seed: int | None) -> Request:
        params.seed = seed if seed is not None else request_seed(self.cfg.seed, req_id)
        return Request(req_id, prompt_ids, params)

    def abort(self, req_id) -> bool:
        """Drop a waiting or running request (between steps); False when it is unknown."""
        found, seq = self.scheduler.abort(req_id)
        if seq is not None:
            seq.finish_reason = "abort"
        return found

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- the step -----------------------------------------------------------------------------------

    def drafter_forwards(self, rows: list[tuple[Sequence, int]]) -> int:
        """How many drafter forwards this step runs: exactly k in lockstep (the padding batch
        included), k over a padding batch under policy dummy, otherwise as many as the longest
        draft needs, and none when there is nothing to draft under policy skip."""
        if not self.drafter.has_forward:
            return 0
        has_draft = bool(rows)
        if self.plan.lockstep or (not has_draft and self.plan.policy == "dummy"):
            wanted = self.k
        else:
            wanted = max((ke for _, ke in rows), default=0)
        return self.faults.drafter_forwards(self.dp.rank, has_draft, wanted)

    def agree(self, fields: list[list[int]], step: int) -> StepSizes:
        """Every rank's [rows, drafter forwards, T, drafter-mixed flag, its tokens, prefill tokens]
        -> the step's sizes, computed alike on every rank."""
        Ks = [f[1] for f in fields]
        if len(set(Ks)) > 1:
            self.dp.out_of_step([f"step {step}, start of step: {K} drafter forward{'' if K == 1 else 's'} planned"
                                 for K in Ks])
        T = max(f[2] for f in fields)
        return StepSizes(
            R_pad=pad_rows(max(max(f[0] for f in fields), 1), self.row_sizes), K=Ks[0], T=T,
            draft_mixed=max(max(f[4] for f in fields), 1) if any(f[3] for f in fields) else 0,
            target_mixed=max(max(f[0] * T + f[5] for f in fields), 1) if any(f[5] for f in fields) else 0)

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        self.step_no += 1
        step = self.step_no
        self.dp.publish(step, "start of step")
        if self.faults.exit_step(self.dp.rank) == step:
            self.on_fault_exit(EXIT_STATUS, f"fault injection exit:{self.dp.rank}:{step}")
        c = self.counters
        if c.first_step_t is None:
            c.first_step_t = time.time()

        plan = self.scheduler.schedule()
        c.preemptions += plan.preempted
        rows = plan.decode
        drafting = [(s, ke) for s, ke in rows if ke >= 1]
        K = self.drafter_forwards(drafting)
        if self.drafter.has_forward and not drafting and K == 0:
            c.skipped_drafter_steps += 1
        drafts = self.drafter.host_drafts(rows, K)
        d_mixed, d_tokens = self.drafter.mixed_fields(rows, plan.prefill, drafts, K)
        T = 1 + self.k if (K or any(drafts.n)) else 1
        fields = [len(rows), K, T, d_mixed, d_tokens, sum(e - s for _, s, e in plan.prefill)]
        sizes = self.agree(self.dp.sync_step(fields, step), step)

        self.inputs.stage(rows, drafts, sizes.R_pad)
        params = [s.req.params for s, _ in rows]
        ctx = StepContext(step, rows, plan.prefill, sizes, self.inputs,
                          row_tensors(params, self.device, pad_to=sizes.R_pad),
                          lambda what: self.dp.publish(step, what))
        self.drafter.propose(ctx, drafts)

        self.dp.publish(step, "target forward")
        ctx.padding.append(not rows and not plan.prefill)
        if sizes.target_mixed:
            done, result = self._target_mixed(ctx, drafts)
        else:
            done, result = [], self._target_uniform(ctx, drafts)
        n_drafts = drafts.n + [0] * len(done)
        outputs = [self._accept(s, n, list(r[:r[-1]]))
                   for s, n, r in zip([s for s, _ in rows] + done, n_drafts, result)]
        for out in outputs:
            if out.finished:
                c.spec.merge(out.seq.stats)
                self.scheduler.remove(out.seq)

        c.steps += 1
        if any(ctx.padding):
            c.padding_steps += 1
        c.last_step_t = time.time()
        return outputs

    def _target_uniform(self, ctx: StepContext, drafts: Drafts):
        R, T = ctx.sizes.R_pad, ctx.sizes.T
        t, inp = self.target, self.inputs
        ids = t.ids[:R * T].view(R, T)
        ids[:, 0] = inp.col(LAST, R)
        if T > 1:
            ids[:, 1:] = drafts.tokens if drafts.tokens is not None else inp.dev[:R, DRAFTS:DRAFTS + T - 1]
        torch.sub(inp.col(LEN, R), 1, out=t.start[:R])
        torch.add(inp.col(NDRAFT, R), 1, out=t.n_real[:R])
        logits = t.uniform(R, T).view(R, T, -1)
        out, n_out = verify(logits, ids[:, 1:], inp.col(NDRAFT, R), drafts.probs, ctx.rt, inp.col(LEN, R))
        return self._to_host(out, n_out, len(ctx.rows))

    def _target_mixed(self, ctx: StepContext, drafts: Drafts):
        """A step with prompt chunks: the decode rows (T tokens each) and the chunks in one eager
        forward; rows whose prompt is complete draw their first token."""
        T, inp, dev = ctx.sizes.T, self.inputs, self.device
        R = len(ctx.rows)
        batch = MixedBatch(n_pad=ctx.sizes.target_mixed)
        for i, (s, _) in enumerate(ctx.rows):
            toks = [s.tokens[-1]] + (drafts.host[i] if drafts.host is not None else [0] * drafts.n[i])
            batch.rows.append(MixedRow(s.blocks, s.L - 1, toks + [0] * (T - len(toks)), len(toks), "all"))
        if drafts.tokens is not None:
            batch.fill = (R, T, T - 1, drafts.tokens)
        done = []
        for s, start, end in ctx.prefill:
            last = end == s.prefill_len and s.samples_after_prefill
            batch.rows.append(MixedRow(s.blocks, start, s.tokens[start:end], end - start, "last" if last else "none"))
            s.target_len = end
            if last:
                done.append(s)
        logits = self.target.mixed(batch)
        n = R + len(done)
        if not n:
            return done, []
        V = logits.shape[-1]
        grid = torch.cat([logits[:R * T].view(R, T, V), logits[R * T:].view(-1, 1, V).expand(-1, T, -1)])
        tail = torch.tensor([[0] * (T - 1) + [0, s.L] for s in done], dtype=torch.long).view(-1, T + 1).to(dev)
        head = torch.cat([drafts.tokens[:R] if drafts.tokens is not None else inp.dev[:R, DRAFTS:DRAFTS + T - 1],
                          inp.col(NDRAFT, R).view(R, 1), inp.col(LEN, R).view(R, 1)], 1)
        rows_in = torch.cat([head, tail])
        q = drafts.probs
        if q is not None:
            q = torch.cat([q[:R], q.new_zeros((len(done),) + q.shape[1:])])
        rt = row_tensors([s.req.params for s, _ in ctx.rows] + [s.req.params for s in done], dev)
        out, n_out = verify(grid, rows_in[:, :T - 1], rows_in[:, T - 1], q, rt, rows_in[:, T])
        return done, self._to_host(out, n_out, n)

    @staticmethod
    def _to_host(out: torch.Tensor, n_out: torch.Tensor, n: int):
        """The step's one device-to-host copy: each row's tokens and how many of them count."""
        return torch.cat([out[:n], n_out[:n].view(-1, 1)], 1).cpu().numpy()

    def _accept(self, s: Sequence, n_drafts: int, new: list[int]) -> StepOutput:
        old_len = s.L
        accepted = len(new) - 1
        if n_drafts:
            s.stats.add(n_drafts, accepted)
        if not s.in_prefill:
            s.target_len = old_len + accepted
            if n_drafts:
                self.drafter.on_accept(s, old_len, accepted)
        emitted = self.output.append(s, [int(t) for t in new])
        self.counters.generated_tokens += len(emitted)
        return StepOutput(s, emitted, s.finish_reason is not None)
