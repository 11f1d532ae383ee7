"""Continuous batching over a paged KV cache: which sequences run this step, with how many draft
tokens, which prompt chunks are prefilled, and who is preempted when blocks run out.

As in vLLM: a waiting request is admitted (first come, first served, up to `max_num_seqs`) when
the blocks of its whole prompt are free; every step, each running sequence first gets the blocks
this step writes (`kv_positions`: the one rule for both); when none are free the newest running
sequence is preempted — its blocks are freed and it goes back to the head of the queue, to be recomputed
later (its prompt and generated tokens, but the last, prefilled again) with nothing it produced
lost: it then goes on decoding from the same length, so its outputs do not change. Prompts are
prefilled within `max_num_batched_tokens` minus what the decode rows need, in chunks when they do
not fit whole.

Lengths follow DESIGN.md's contract: L = prompt + generated; a sequence fits the drafter when
L + k <= D and then drafts k_eff = min(k, M - L - 1, max_tokens_left - 1), at most the step's k
(`spec_length.py`; k stays num_speculative_tokens in the fit, so the no-draft window is unchanged).

Progress: the oldest running sequence is never preempted for another, and alone it always gets its
blocks (`kv_positions` never asks for more than a full-length sequence, which the cache always
holds), so some sequence gains a token within the steps its prefill takes (`progress.py` checks it).
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from .block_hash import block_hashes
from .kv_cache import BlockPool
from .sampling import SamplingParams


PENDING = -1        # async scheduling: a token the device has not returned yet (Sequence.pending)


@dataclass
class Request:
    id: Any
    prompt_ids: list[int]
    params: SamplingParams
    grammar: Any = None              # structured output: its grammar's state (structured.Grammar)
    block_hashes: list | None = None      # its prompt's first full blocks' chained hashes, when already worked out
    special: bool = field(init=False)     # asks for log-probabilities or changes the logits: a step checks it once

    def __post_init__(self):
        self.special = self.params.changes_logits or self.params.logprobs is not None


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos += [0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos))
        for i, v in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += v


class Sequence:
    def __init__(self, req: Request, max_model_len: int):
        self.req = req
        self.tokens = list(req.prompt_ids)
        self.num_prompt = len(req.prompt_ids)
        self.limit = min(max_model_len, self.num_prompt + req.params.max_tokens)  # L never passes this
        self.M = max_model_len
        self.blocks: list[int] = []  # KV blocks (shared by the target's and the drafter's caches)
        self.block_row = None        # step_inputs' int32 copy of `blocks` (with the list and length it was made from)
        self.prefill_len = self.num_prompt   # tokens to prefill: the prompt, or all but the last after a preemption
        self.target_len = 0          # positions held in the target's KV cache
        self.draft_len = 0           # positions held in the drafter's KV cache
        self.next_drafts: list[int] = []   # drafts proposed after the last verification (EAGLE), for the next step
        # async scheduling: the tokens of steps still on the device stand at the end of `tokens` as PENDING, so
        # that L already counts them when the next step is scheduled; pending_row is the row of the latest step
        # launched, whose emitted token the device feeds to this sequence's next row
        self.pending = 0
        self.pending_row = -1
        # of those, the drafts verification may reject: the sequence's length is between L - unsure and L
        self.unsure = 0
        self.catch_up_on_device = False   # a draft model has seen all but the tokens of its step on the device
        self.finish_reason: str | None = None
        self.error: str | None = None          # why the engine failed it (finish_reason "error")
        self.stop_text_end: int | None = None   # where a matched stop string starts in the text
        self.stats = SpecStats()
        self.preemptions = 0
        self.logprobs: list | None = [] if req.params.logprobs is not None else None   # per generated token
        # prefix caching: the chained hashes of its full blocks so far
        self.block_hashes: list[bytes] = list(req.block_hashes or ())
        self.cached_tokens = 0                 # prompt tokens its last admission found in the prefix cache
        self.committed_blocks = 0              # of its blocks, those registered in the prefix cache
        # the request's phases on this rank (time.monotonic): arrived, first scheduled, first token (vLLM's queue,
        # prefill and decode times)
        self.arrived_t = time.monotonic()
        self.scheduled_t: float | None = None
        self.first_token_t: float | None = None

    @property
    def L(self) -> int:
        return len(self.tokens)

    def drop_pending(self) -> int:
        """Take the PENDING tokens off the end (their step's results are being read, or the sequence is dropped);
        returns how many there were."""
        n = self.pending
        del self.tokens[len(self.tokens) - n:]
        self.pending = 0
        return n

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def in_prefill(self) -> bool:
        return self.target_len < self.prefill_len

    @property
    def samples_after_prefill(self) -> bool:
        """A prompt's last chunk draws the first token; a recomputation (after a preemption) stops one
        token short and goes on decoding exactly where it was, drafts and random draws included."""
        return self.prefill_len == self.L

    def k_eff(self, k: int, D: int, L: int | None = None) -> int:
        """Draft tokens this step at length L (default: the sequence's; 0 while prefilling, when L + k > D, or
        when the request opted out)."""
        L = self.L if L is None else L
        if self.in_prefill or L + k > D or not self.req.params.speculative:
            return 0
        left = self.req.params.max_tokens - (L - self.num_prompt)
        return max(0, min(k, self.M - L - 1, left - 1))


@dataclass
class StepPlan:
    decode: list[tuple[Sequence, int]]            # (sequence, k_eff)
    prefill: list[tuple[Sequence, int, int]]      # (sequence, start, end) of a prompt chunk
    preempted: int = 0
    # async scheduling: the decode rows planned before the step on the device is read whose k_eff that step decides
    # (`Scheduler.drafts_ahead`): the books count their drafts at the length the step leaves them at
    ahead: dict[Sequence, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_batched_tokens: int, k: int,
                 max_model_len: int, D: int, max_rows: int | None = None, row_tokens: int = 1, lookahead: int = 0,
                 reads_drafter_kv: Callable[[Sequence], bool] = lambda s: False,
                 drafter_kv_upto: Callable[[Sequence], float] = lambda s: math.inf):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        # a step's forwards hold at most max_rows rows (None: no limit); a prompt chunk takes one row
        # per row_tokens tokens (the engine passes both)
        self.max_rows = max_rows if max_rows is not None else max_num_seqs + max_batched_tokens
        self.row_tokens = row_tokens
        self.k, self.M, self.D = k, max_model_len, D
        self.k_step = k                      # this step's k (spec_length.py): caps k_eff; fitting uses k
        self.lookahead = lookahead           # positions past a step's tokens its drafter writes (EAGLE: k - 1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []      # admission order: the last is the newest
        # prefix caching (the engine's drafter says): whether a sequence will read a draft model's KV of its
        # prompt, and up to which position a sequence's drafter KV is computed
        self.reads_drafter_kv, self.drafter_kv_upto = reads_drafter_kv, drafter_kv_upto

    @property
    def prefill_steps(self) -> int:
        """The most steps the prefill of a max_model_len-token prompt takes when nothing else runs (a
        step prefills up to max_num_batched_tokens tokens, in up to max_rows rows of row_tokens)."""
        return -(-self.M // min(self.max_batched_tokens, self.max_rows * self.row_tokens))

    def add(self, req: Request) -> None:
        self.waiting.append(Sequence(req, self.M))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, preempt: bool = True, hold: Collection[Sequence] = (),
                 ahead: dict[Sequence, int] | None = None) -> StepPlan | None:
        """The step's plan; None when it would have to preempt a sequence and `preempt` is off (async
        scheduling plans a step ahead only when nothing has to be preempted). The sequences in `hold` get no
        row this step (async scheduling: their next row depends on the step still on the device); those in
        `ahead` get a row with that many drafts (`drafts_ahead`), even where the step may have ended them."""
        ahead = ahead or {}
        preempted = self._grow_running(preempt)
        if preempted < 0:
            return None
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self._cached_prefix(seq)
            need = self.pool.blocks_for(self.kv_positions(seq)) - len(hit)
            if need > self.pool.num_free - self.pool.evictable_among(hit):
                break
            self.waiting.popleft()
            self.pool.take(hit)
            seq.blocks = hit + self.pool.allocate(need)
            if seq.scheduled_t is None:
                seq.scheduled_t = time.monotonic()
            if self.pool.prefix_caching:
                seq.cached_tokens = seq.target_len = seq.draft_len = len(hit) * self.pool.block_size
                seq.committed_blocks = len(hit)
                self.pool.queries += seq.prefill_len
                self.pool.hits += seq.cached_tokens
            self.running.append(seq)
        # (a sequence whose pending token brings it to its limit finishes with that token: no row)
        decode = [(s, ahead[s] if s in ahead else self.drafts(s))
                  for s in self.running if not s.in_prefill and (s.L < s.limit or s in ahead) and s not in hold]
        budget = self.max_batched_tokens - sum(1 + ke for _, ke in decode)
        rows = self.max_rows - len(decode)
        prefill = []
        for s in self.running:
            if s.in_prefill and budget > 0 and rows > 0:
                end = min(s.prefill_len, s.target_len + budget, s.target_len + rows * self.row_tokens)
                prefill.append((s, s.target_len, end))
                budget -= end - s.target_len
                rows -= -(-(end - s.target_len) // self.row_tokens)
        return StepPlan(decode, prefill, preempted, ahead)

    def settled(self, s: Sequence) -> bool:
        """Whether the sequence's next step is the same whatever verification does with its drafts still on the
        device (async scheduling): at every length they allow it drafts as many tokens this step (the contract's
        fit and k_eff, at most the step's k), and it either has tokens left to generate at all of them or at none."""
        if not s.unsure:
            return True
        L_min = s.L - s.unsure
        if (L_min < s.limit) != (s.L < s.limit):
            return False
        return self.drafts(s, L_min) == self.drafts(s)

    def drafts(self, s: Sequence, L: int | None = None, k_step: int | None = None) -> int:
        """The sequence's drafts in a step at length L (default: its own): the contract's k_eff (fitting at
        num_speculative_tokens), at most the step's k (default: this step's)."""
        return min(s.k_eff(self.k, self.D, L), self.k_step if k_step is None else k_step)

    def drafts_ahead(self, s: Sequence) -> int | None:
        """An unsettled sequence's drafts when its next row is planned before the step on the device is read, or None
        (it sits the step out). A greedy request whose length decides only where its limit cuts it (how many drafts
        fit before it, whether it is reached): its row verifies the drafts of its shortest length, the most it may
        have. Verification then emits the same tokens as with the contract's k_eff at its true length, and perhaps
        more past its limit, which are cut (the books count the contract's drafts, `Engine._update`); had the step
        ended it, the row is void. Its positions stay within M (the rotary tables), and it fits the drafter at every
        length or at none. (Sampled requests sit out: their draws at a position depend on whether a draft stands
        there.)"""
        L_min = s.L - s.unsure
        if not s.req.params.greedy or L_min >= s.limit or (s.L + self.k <= self.D) != (L_min + self.k <= self.D):
            return None
        n = self.drafts(s, L_min)
        return n if s.L + n <= self.M else None

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks of the sequence's first full blocks, short of its last token to prefill: that one
        is always computed (its logits draw the next token), in a block of the sequence's own, so a
        sequence never writes a block it shares."""
        if not self.pool.prefix_caching:
            return []
        n = (seq.prefill_len - 1) // self.pool.block_size
        return self.pool.cached_prefix(block_hashes(seq.tokens, self.pool.block_size, seq.block_hashes, n),
                                       self.reads_drafter_kv(seq))

    def commit(self, seq: Sequence) -> None:
        """The sequence's positions below target_len are final: register its full blocks among them."""
        if not self.pool.prefix_caching:
            return
        bs = self.pool.block_size
        n = min(seq.target_len // bs, len(seq.blocks))
        if n > seq.committed_blocks:
            hashes = block_hashes(seq.tokens, bs, seq.block_hashes, n)
            upto = self.drafter_kv_upto(seq)
            for i in range(seq.committed_blocks, n):
                self.pool.register(seq.blocks[i], hashes[i], (i + 1) * bs <= upto)
            seq.committed_blocks = n

    def kv_positions(self, s: Sequence) -> int:
        """KV positions sequence `s` holds blocks for before a step: the one rule of admission and growth.

        Whatever the step writes for it: prefilling, the tokens to prefill (the prompt; after a
        preemption, all it had but the last token); decoding at length L, the last token and its drafts
        (L + k_eff positions, k_eff at num_speculative_tokens: the most any step's k drafts); plus the
        drafter's look-ahead (an EAGLE head or MTP layer drafting the next step writes k - 1 positions
        past the verified ones). Never more than limit - 1 (limit = min(M, prompt + max_tokens)): no
        forward reads a position from limit - 1 on — the last step feeds its last token at limit - 2,
        and a draft that could land there is never made (k_eff <= limit - L - 1). A drafter's writes
        past a sequence's blocks go to the trash block. So a sequence never needs more blocks than a
        full-length one, which the cache always holds: alone, it always runs (a look-ahead counted past
        M once asked for more blocks than a minimal cache has, and a sequence preempted itself forever)."""
        written = s.prefill_len if s.in_prefill else s.L + s.k_eff(self.k, self.D)
        return min(written + self.lookahead, s.limit - 1)

    def _grow_running(self, preempt: bool = True) -> int:
        """Give every decoding sequence the blocks this step writes, preempting the newest
        sequences while the pool is short. Returns how many were preempted (-1: one had to be and
        `preempt` is off)."""
        preempted = 0
        i = 0
        while i < len(self.running):
            s = self.running[i]
            need = 0 if s.in_prefill else self.pool.blocks_for(self.kv_positions(s)) - len(s.blocks)
            if need > self.pool.num_free and not preempt:
                return -1
            while need > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is s:
                    break
            if i < len(self.running) and self.running[i] is s:
                if need > 0:
                    s.blocks += self.pool.allocate(need)
                i += 1
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        self.remove(seq)
        seq.target_len = seq.draft_len = seq.committed_blocks = 0
        seq.next_drafts = []
        seq.prefill_len = seq.L - 1 if seq.L > seq.num_prompt else seq.num_prompt
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """A finished sequence leaves: its blocks go back to the pool."""
        self.running.remove(seq)
        self.pool.free(seq.blocks)
        seq.blocks = []

    def abort(self, req_id) -> tuple[bool, Sequence | None]:
        """Drop a request: (found, the running sequence that was dropped, if it was running)."""
        for i, s in enumerate(self.waiting):
            if s.req.id == req_id:
                del self.waiting[i]
                return True, None
        for s in self.running:
            if s.req.id == req_id:
                self.remove(s)
                s.drop_pending()
                return True, s
        return False, None
