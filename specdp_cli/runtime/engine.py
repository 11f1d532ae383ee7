"""The engine of one rank: a step loop of schedule -> draft -> verify -> accept -> bookkeeping.

One step, whatever the rank holds:
  1. the scheduler picks the running sequences (with k_eff each) and prompt chunks;
  2. the drafter phase runs n forwards (exactly k in lockstep, also over a padding batch);
  3. one target forward verifies every row's drafts and prefills the chunks;
  4. the rejection sampler accepts drafts and draws one more token per row;
  5. bookkeeping appends tokens, applies stops, rolls caches back and frees finished slots.
A rank with nothing to do runs the very same code with empty lists: each forward then carries a
padding token. That is the "dummy" step — there is no second code path to keep in step.
"""
from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass

import torch

from ..config import Config
from ..preflight import Plan
from .drafters.base import Drafter, NoDrafter
from .drafters.draft_model import ModelDrafter
from .drafters.ngram import NgramDrafter
from .faults import EXIT_STATUS, Faults
from .kv_cache import SlotKVCache
from .model_runner import ModelRunner, Segment, load_causal_lm
from .output import OutputProcessor
from .sampling import SamplingParams, row_tensors, verify
from .scheduler import Request, Scheduler, Sequence, SpecStats


@dataclass
class StepOutput:
    seq: Sequence
    new_tokens: list[int]
    finished: bool


class RankCounters:
    def __init__(self):
        self.steps = 0
        self.padding_steps = 0
        self.skipped_drafter_steps = 0
        self.generated_tokens = 0
        self.spec = SpecStats()
        self.first_step_t: float | None = None     # wall clock (comparable across ranks of a machine)
        self.last_step_t: float | None = None

    def report(self, rank: int, requests: int) -> dict:
        return {"rank": rank, "requests": requests, "steps": self.steps, "padding_steps": self.padding_steps,
                "skipped_drafter_steps": self.skipped_drafter_steps, "generated_tokens": self.generated_tokens,
                "first_step_t": self.first_step_t, "last_step_t": self.last_step_t, "spec": vars(self.spec)}


def _exit_process(code: int, message: str) -> None:
    os._exit(code)


def _kv_bytes_per_token(model) -> int:
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    return 2 * c.num_hidden_layers * kv * hd * next(model.parameters()).element_size()


def request_seed(global_seed: int, req_id) -> int:
    """The seed of a request that gives none: stable for its id, so reruns and any DP size agree."""
    return zlib.crc32(f"{global_seed}:{req_id!r}".encode()) & 0x7FFFFFFF


class Engine:
    def __init__(self, cfg: Config, plan: Plan, dp, device: torch.device, faults: Faults | None = None,
                 on_fault_exit=None):
        self.cfg, self.plan, self.dp, self.device = cfg, plan, dp, device
        self.faults = faults or Faults()
        self.on_fault_exit = on_fault_exit or _exit_process
        spec = cfg.speculative
        self.k = spec.num_speculative_tokens if spec.method != "none" else 0
        self.M = cfg.max_model_len
        self.D = plan.drafter_max_model_len or self.M
        self.output = OutputProcessor(cfg.tokenizer_path, cfg.model)

        target = load_causal_lm(cfg.model, plan.dtype, device)
        draft = load_causal_lm(spec.model, plan.dtype, device) if spec.method == "draft_model" else None
        self.num_slots = self._slots_that_fit(target, draft)
        self.target = ModelRunner(target, SlotKVCache(self.num_slots, self.M, device), device, dp, "target")
        self.target.warmup()
        self.drafter: Drafter
        if draft is not None:
            runner = ModelRunner(draft, SlotKVCache(self.num_slots, self.D, device), device, dp, "drafter")
            runner.warmup()
            self.drafter = ModelDrafter(runner, self.D, self.k)
        elif spec.method == "ngram":
            self.drafter = NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            self.drafter = NoDrafter()
        self.scheduler = Scheduler(self.num_slots, cfg.scheduler.max_num_batched_tokens, self.k, self.M, self.D)
        self.counters = RankCounters()
        self.step_no = 0

    def _slots_that_fit(self, target, draft) -> int:
        """max_num_seqs, or fewer on a GPU whose free memory cannot hold that many full-length
        KV rows (preflight warned about it)."""
        wanted = self.cfg.scheduler.max_num_seqs
        if self.device.type != "cuda":
            return wanted
        per_seq = _kv_bytes_per_token(target) * self.M + (_kv_bytes_per_token(draft) * self.D if draft else 0)
        free, _ = torch.cuda.mem_get_info(self.device)
        fit = int((free * 0.9 - (1 << 30)) // max(per_seq, 1))
        if fit < 1:
            raise RuntimeError(f"not even one sequence of max_model_len {self.M} fits in GPU memory "
                               f"({free / 2**30:.1f} GiB free): lower max_model_len")
        return min(wanted, fit)

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
            self._free(seq)
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

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        self.step_no += 1
        step = self.step_no
        self.dp.publish(step, "start of step")
        if self.faults.exit_step(self.dp.rank) == step:
            self.on_fault_exit(EXIT_STATUS, f"fault injection exit:{self.dp.rank}:{step}")
        c = self.counters
        if c.first_step_t is None:
            c.first_step_t = time.time()
        pad_before = self.target.padding_forwards + self._drafter_padding()

        plan = self.scheduler.schedule()
        drafting = [(s, ke) for s, ke in plan.decode if ke >= 1]
        n_fwd = self.drafter_forwards(drafting)
        if self.drafter.has_forward and not drafting and n_fwd == 0:
            c.skipped_drafter_steps += 1
        if self.drafter.has_forward and n_fwd == 0:
            drafting = []                 # the drafter phase is skipped: nothing is proposed
        drafts = self.drafter.propose(drafting, plan.prefill, n_fwd, step)
        draft_of = {id(s): (i, d) for i, ((s, _), d) in enumerate(zip(drafting, drafts.tokens))}

        # the target forward: every decode row verifies its drafts; prompt chunks prefill
        segs, rows = [], []            # rows: (seq, drafts, draft_row_index) that sample a token
        for s, _ in plan.decode:
            i, d = draft_of.get(id(s), (None, []))
            segs.append(Segment(s.slot, s.L - 1, [s.tokens[-1]] + d, keep=1 + len(d)))
            rows.append((s, d, i))
        for s, start, end in plan.prefill:
            done = end == s.num_prompt
            segs.append(Segment(s.slot, start, s.tokens[start:end], keep=1 if done else 0))
            s.target_len = end
            if done:
                rows.append((s, [], None))
        logits = self.target.forward(segs, step, "target forward")

        outputs: list[StepOutput] = []
        if rows:
            tokens, n_out = self._verify(logits, rows, drafts.probs)
            for (s, d, _), toks, n in zip(rows, tokens, n_out):
                outputs.append(self._accept(s, d, toks[:n]))
        for out in outputs:
            if out.finished:
                c.spec.merge(out.seq.stats)
                self._free(out.seq)

        c.steps += 1
        if self.target.padding_forwards + self._drafter_padding() > pad_before:
            c.padding_steps += 1
        c.last_step_t = time.time()
        return outputs

    def _drafter_padding(self) -> int:
        return self.drafter.runner.padding_forwards if isinstance(self.drafter, ModelDrafter) else 0

    def _verify(self, logits: torch.Tensor, rows, draft_probs):
        dev = logits.device
        K = max(len(d) for _, d, _ in rows)
        R = len(rows)
        index, drafts, base = [], [], 0
        for _, d, _ in rows:
            index += [base + min(j, len(d)) for j in range(K + 1)]
            drafts += d + [0] * (K - len(d))
            base += len(d) + 1
        # one host-to-device copy for the step's index tensors, one device-to-host copy back
        packed = torch.tensor(index + drafts + [len(d) for _, d, _ in rows] + [s.L for s, _, _ in rows],
                              dtype=torch.long).to(dev)
        idx, drafts_t, n_drafts, first_pos = torch.split(packed, [R * (K + 1), R * K, R, R])
        target_logits = logits[idx].view(R, K + 1, -1)
        rt = row_tensors([s.req.params for s, _, _ in rows], dev)
        q = None
        if draft_probs is not None and K and not rt["all_greedy"]:
            src = torch.tensor([i if i is not None else 0 for _, _, i in rows], dtype=torch.long).to(dev)
            q = draft_probs[src, :K]
        out, n_out = verify(target_logits, drafts_t.view(R, K), n_drafts, q, rt, first_pos)
        both = torch.cat([out, n_out.view(-1, 1)], 1).tolist()
        return [r[:-1] for r in both], [r[-1] for r in both]

    def _accept(self, s: Sequence, drafts: list[int], new: list[int]) -> StepOutput:
        old_len = s.L
        accepted = len(new) - 1
        if drafts:
            s.stats.add(len(drafts), accepted)
            s.target_len = old_len + accepted
            self.drafter.on_accept(s, old_len, accepted)
        elif not s.in_prefill:
            s.target_len = old_len
        emitted = self.output.append(s, new)
        self.counters.generated_tokens += len(emitted)
        return StepOutput(s, emitted, s.finish_reason is not None)

    def _free(self, seq: Sequence) -> None:
        moved = self.scheduler.remove(seq)
        if moved is not None:
            m, from_slot = moved
            self.target.cache.move(from_slot, m.slot, m.target_len)
            self.drafter.on_move(m, from_slot)
