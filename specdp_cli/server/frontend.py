"""The frontend's view of the ranks: requests in flight, routing, and events from the ranks put in each
request's mailbox."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field

from ..runtime.block_hash import joined
from .link import RankLink
from .metrics import Metrics
from .protocol import APIError, GenRequest
from .routing import PrefixIndex, pick_rank, prompt_hashes

log = logging.getLogger("specdp.server")


@dataclass
class Event:
    new_tokens: list[int]
    finish_reason: str | None = None     # stop | length | abort | error | disconnect (the client left: app.py)
    stop_text_end: int | None = None     # finished by a stop string: where it starts in the generated text
    stats: dict | None = None
    error: str | None = None
    status: int = 503                    # the HTTP status of an error: 503 a lost rank or an abort, 500 a failed request
    logprobs: list | None = None         # per new token (its log-probability, [(id, log-probability)]) when asked


class Mailbox:
    """A request's events, for the one coroutine that reads them: a list and, while that coroutine waits, a future.
    The reader takes every event that has arrived at once; an asyncio.Queue handed them over one at a time (its
    calls were a fifth of a saturated frontend's time under cProfile, `benchmarks/frontend_bench.py --profile`;
    without the profiler the frontend spends about 3 % less CPU a token)."""

    __slots__ = ("events", "waiter")

    def __init__(self):
        self.events: list[Event] = []
        self.waiter: asyncio.Future | None = None

    def put(self, ev: Event) -> None:
        self.events.append(ev)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> list[Event]:
        """Every event arrived so far, in order; waits for one when there is none."""
        while not self.events:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        events, self.events = self.events, []
        return events

    def put_back(self, events: list[Event]) -> None:
        """Events taken but not used yet: read first next time."""
        self.events[:0] = events


@dataclass
class Inflight:
    id: str
    req: GenRequest
    rank: int
    cost: int
    mailbox: Mailbox
    created: float = field(default_factory=time.monotonic)
    first_token_t: float | None = None
    last_token_t: float | None = None
    n_tokens: int = 0
    done: bool = False


@functools.lru_cache(maxsize=8)
def text_decoder(tokenizer):
    """`tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`, for a fast
    tokenizer as one call into its Rust tokenizer: transformers' wrapper (argument checks, a conversion of every
    id) cost as much as the decode itself, and a stream decodes twice a chunk (the frontend at 58k tok/s: 14 %
    of its samples in decode, half of them the wrapper). Used only where it gives the wrapper's text on a probe
    of the vocabulary."""
    def slow(ids):
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return slow

    def fast(ids):
        return backend.decode(ids, skip_special_tokens=True)

    probe = list(range(min(len(tokenizer), 1024)))
    try:
        same = fast(probe) == slow(probe) and all(fast(probe[i:i + 3]) == slow(probe[i:i + 3]) for i in range(0, len(probe), 97))
    except Exception:  # noqa: BLE001 - any difference in the API: the wrapper it is
        same = False
    return fast if same else slow


class IncrementalText:
    """Text deltas for streaming: the decoded text minus a held-back tail that may still turn out to
    be (the start of) a stop string or an unfinished UTF-8 character, so what was sent is always a
    prefix of the final text.

    Decoding is incremental, as vLLM's detokenizer does it: each call decodes only a window of the
    last few tokens (from `prefix` on) and keeps what it adds beyond the window's already-read part,
    so a chunk costs the same at token 10 and at token 10,000. The window keeps a token's leading
    space (SentencePiece) and a character split over tokens (byte-level BPE) right."""

    def __init__(self, tokenizer, stops: list[str]):
        self._decode = text_decoder(tokenizer)
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.prefix = self.read = 0          # the window starts at `prefix`; tokens before `read` are in `text`
        self.text = ""
        self.sent = 0

    def _advance(self, flush: bool = False) -> None:
        window = self.tokens[self.prefix:]
        before = self._decode(self.tokens[self.prefix:self.read]) if self.read > self.prefix else ""
        after = self._decode(window)
        if len(after) > len(before) and (flush or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)

    def add(self, tokens: list[int]) -> str:
        self.tokens += tokens
        self._advance()
        text = self.text
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent:safe], safe
        return out

    def finish(self, tokens: list[int], stop_text_end: int | None) -> str:
        """The last tokens' text and everything not sent yet, cut where a stop string begins (the rank's
        `stop_text_end`)."""
        self.tokens += tokens
        self._advance(flush=True)
        final = self.text if stop_text_end is None else self.text[:stop_text_end]
        out = final[self.sent:]
        self.sent = max(self.sent, len(final))
        return out


class Frontend:
    def __init__(self, world: int, metrics: Metrics, max_queue: int, max_num_seqs: int,
                 prefix_index: PrefixIndex | None = None, hash_block_size: int | None = None):
        self.world = world
        self.prefix_index = prefix_index        # prefix-aware routing (prefix caching on); None: least loaded
        # prefix caching on: the KV block size a prompt's block hashes are worked out for, here (for routing too) and
        # not in its rank's step loop, whose time sets a served step's (a 1,500-token prompt's: about 90 µs)
        self.hash_block_size = hash_block_size
        self.metrics = metrics
        self.max_queue = max_queue
        self.max_num_seqs = max_num_seqs
        self.inflight: dict[str, Inflight] = {}
        self.rank_cost = [0] * world
        self.link: RankLink | None = None
        self.failed: str | None = None
        self.draining = False

    # -- on the event loop ----------------------------------------------------------------------

    def on_message(self, rank: int, msg) -> None:
        if msg[0] == "out":
            if len(msg) > 2:
                self.metrics.rank_report(rank, *msg[2:])
            self._dispatch(msg[1])

    def on_lost(self, rank: int) -> None:
        self.rank_lost(rank, f"rank {rank} stopped answering")

    def _dispatch(self, events) -> None:
        """events: (request id, new tokens, finish reason or None, where a stop string starts in the text (for
        "error" the reason), stats, log-probabilities or None) from a rank's step."""
        for rid, tokens, finish, end, stats, logprobs in events:
            inf = self.inflight.get(rid)
            if inf is None:
                continue
            if finish == "error":          # the engine failed the request (its progress guard): a bug to report
                log.error("request %s failed on rank %d: %s", rid, inf.rank, end)
                inf.mailbox.put(Event(tokens, finish, error=end, status=500))
            else:
                inf.mailbox.put(Event(tokens, finish, end, stats, logprobs=logprobs))

    def rank_lost(self, rank: int, why: str) -> None:
        if self.draining and self.failed is None and not self.inflight:
            return                       # an orderly shutdown
        if self.failed is None:
            self.failed = why
        for inf in list(self.inflight.values()):
            inf.mailbox.put(Event([], "error", error=f"the server lost a rank ({why}); request aborted"))

    @property
    def healthy(self) -> bool:
        return self.failed is None and self.link is not None and self.link.all_up

    def submit(self, req: GenRequest) -> Inflight:
        if self.failed is not None or self.link is None or not self.link.all_up:
            raise APIError(503, f"the server is not ready or lost a rank: {self.failed or 'starting'}")
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if len(self.inflight) >= self.max_queue:
            raise APIError(429, f"the server has {len(self.inflight)} requests in flight (server.max_queue); "
                                f"retry shortly", headers={"Retry-After": "1"})
        # by outstanding work (prompt + max_tokens) and where the prompt's prefix is cached (routing.py)
        cost = len(req.prompt_ids) + req.max_tokens
        hashes = prompt_hashes(req.prompt_ids, self.hash_block_size) if self.hash_block_size else []
        rank = pick_rank(self.rank_cost, cost, self.prefix_index, hashes)
        rid = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        inf = Inflight(rid, req, rank, cost, Mailbox())
        self.inflight[rid] = inf
        self.rank_cost[rank] += cost
        msg = ("add", rid, req.prompt_ids, req.params, req.params["seed"], joined(hashes))
        if not self._send_waking_all(rank, msg):
            self.release(inf)
            raise APIError(503, f"rank {rank} is not reachable")
        return inf

    def _send_waking_all(self, rank: int, msg) -> bool:
        """Send msg to one rank and a wake to every other: a lockstep rank that gets any message
        steps once, and all of them must (see server/rank.py), or one would step alone."""
        ok = self.link.send(rank, msg)
        for r in range(self.world):
            if r != rank:
                self.link.send(r, ("wake",))
        return ok

    def note_tokens(self, inf: Inflight, n: int) -> None:
        now = time.monotonic()
        if n:
            self.metrics.tokens_arrived(inf, n, now)
        if n and inf.first_token_t is None:
            inf.first_token_t = now
        if n:
            inf.last_token_t = now
            inf.n_tokens += n

    def release(self, inf: Inflight, outcome: str | None = None, stats: dict | None = None) -> None:
        if self.inflight.pop(inf.id, None) is None:
            return
        self.rank_cost[inf.rank] -= inf.cost
        inf.done = True
        if outcome is not None:
            self.metrics.finished(inf, outcome, stats, time.monotonic())

    def abort(self, inf: Inflight) -> None:
        if not inf.done and self.link is not None:
            self._send_waking_all(inf.rank, ("abort", inf.id))
        self.release(inf, "abort")
