"""The serving loop of one rank: requests arrive from the frontend over the link, tokens go back
after every step.

Waiting for work is a blocking wait on this rank's links — no collective, no timeout, no spinning.
With `dp_sync: always` the ranks step together while any of them has work: each step's sync says
whether some rank has, and when none has every rank goes back to waiting. The frontend sends every
rank one message per event (the request or abort to its rank, a "wake" to the others), so every
rank receives the same number of messages. The step sync carries each rank's count, and the ranks
go back to waiting only when the counts agree: a message that is late to one rank (its partners
already consumed theirs) is then stepped for by everyone, never by its rank alone.

With several API server processes (`server.api_server_count`) the rank holds a link to each: a request's
tokens go back to the process that sent it, the rank's state (/metrics) to the first only, and the count
above is over all of them (each process sends every rank one message per event of its own).

The links are read on the loop's own thread, at the start of each step (a poll of their sockets, then one read
of what has arrived on each ready one) or, with nothing to run, in a blocking wait on all of them. A reader thread
would need the GIL from the step loop, which holds it nearly all the time in a host-bound step: its message waited
up to the interpreter's 5 ms switch interval, and with it a new request's admission (as the frontend's link does,
link.py).

The rank's state for /metrics (`_state`, and the steps per k) rides on a step's message at most every
STATE_EVERY_S while the rank has work, and always on the message of the step after which it has none (and on
answers to the frontend): a served step at 1 ms built, sent and read it every step (on an H200 host about 15 µs of
the rank's loop a step, and the frontend's prometheus updates for each).
"""
from __future__ import annotations

import os
import select
import time
from multiprocessing.connection import Client

from ..runtime.block_hash import split
from ..runtime.engine import RequestError
from ..runtime.heap import collections_since_startup
from ..runtime.sampling import SamplingParams
from .link import Frames, link_address, no_delay, send_message

LINK_LOST = ("shutdown", "link lost")
STATE_EVERY_S = 0.02


def serve_rank(engine, dp, job: dict) -> None:
    engine.fail_stalled = True        # a stall fails its requests (a 500 each); the server goes on
    conns = []
    for spec in job["links"]:            # one per API server process
        address, authkey = link_address(spec)
        conn = Client(address, authkey=authkey)
        no_delay(conn)
        send_message(conn, ("hello", dp.rank))
        conns.append(conn)
    # the links not lost yet, by socket, with what has arrived of their next message: one poll object for the whole
    # run (a poll a step costs one system call)
    open_links = {conn.fileno(): (api, Frames()) for api, conn in enumerate(conns)}
    poller = select.poll()
    for fd in open_links:
        poller.register(fd, select.POLLIN)

    def receive(block: bool) -> list[tuple[int, tuple]]:
        """(API server, message) of every whole message that has arrived; with `block`, waiting for one."""
        msgs: list[tuple[int, tuple]] = []
        while open_links:
            for fd, _ in poller.poll(None if block else 0):
                api, frames = open_links[fd]
                try:
                    data = os.read(fd, 1 << 20)      # what has arrived (readable: no wait)
                except OSError:
                    data = b""
                if data:
                    msgs += [(api, m) for m in frames.feed(data)]
                else:                                # an API server is gone
                    poller.unregister(fd)
                    del open_links[fd]
                    msgs.append((api, LINK_LOST))
            if msgs or not block:              # blocking: until a whole message (a part of one may come first)
                break
        return msgs

    def send(api: int, msg) -> None:
        try:
            send_message(conns[api], msg)
        except OSError:
            pass                 # that API server is gone: the poll finds its link closed (LINK_LOST)

    # A step's tokens go out while the device runs a step: at once when `engine.step` returned with its step still
    # on the device (async scheduling), else while the next one runs (`while_device_runs`), off the step's critical
    # path; sooner when no next step follows at once, and before any other message (an abort's answer must not
    # overtake the tokens before it).
    pending: list[tuple[int, tuple]] = []
    owner: dict[str, int] = {}        # request id -> the API server that sent it

    def flush() -> None:
        for api, msg in pending:
            send(api, msg)
        pending.clear()

    def reply(api: int, events: list) -> None:   # an answer to a frontend message, after the tokens already due
        flush()
        state = _state(engine, busy_s(), step_s)
        send(api, ("out", events, {}, state) if api == 0 else ("out", events))
        if api:
            send(0, ("out", [], {}, state))

    shutting_down = False
    active = False            # lockstep: stepping together until a step finds no work on any rank
    received = 0              # messages from the frontend (see the module docstring)
    sent_k: dict[int, int] = {}   # steps per k already reported to the frontend (/metrics)
    state_due = 0.0               # when a step's message carries the state again (STATE_EVERY_S)
    told_idle = False             # the state since the rank ran out of work has gone out
    idle_s = 0.0                  # seconds spent waiting for requests with nothing to run
    step_s = 0.0                  # seconds in engine steps (/metrics: the rest of the busy seconds is this loop's own)
    started = time.perf_counter()

    def busy_s(now: float | None = None) -> float:    # /metrics: the seconds the rank was not waiting for requests
        return (time.perf_counter() if now is None else now) - started - idle_s
    while True:
        if not active and not engine.has_work:
            flush()
            if shutting_down:
                break
            dp.publish(engine.step_no, "waiting for requests")
            t_wait = time.perf_counter()
            msgs = receive(block=True)       # blocks: idle ranks do not spin and hold no collective
            idle_s += time.perf_counter() - t_wait
        else:
            msgs = receive(block=False)
        received += sum(1 for _, m in msgs if m != LINK_LOST)
        for api, msg in msgs:
            kind = msg[0]
            if kind == "add":
                _, req_id, prompt_ids, params, seed, hashes = msg
                try:
                    engine.add_request(engine.make_request(req_id, prompt_ids, SamplingParams.from_dict(params),
                                                           seed, split(hashes)))
                    owner[req_id] = api
                except RequestError as e:            # that request fails (a 500 naming why); the rank goes on
                    reply(api, [(req_id, [], "error", str(e), None, None)])
            elif kind == "abort":
                if engine.abort(msg[1]):
                    owner.pop(msg[1], None)
                    reply(api, [(msg[1], [], "abort", None, None, None)])
            elif kind == "shutdown":
                shutting_down = True
        if shutting_down and not dp.lockstep:
            for seq in list(engine.scheduler.running):
                engine.abort(seq.req.id)
            break
        if not dp.lockstep and not engine.has_work:
            active = False                    # wait for the next message (above), not spin
            continue
        t_step = time.perf_counter()
        outs = engine.step(received, while_device_runs=flush)
        step_s += time.perf_counter() - t_step
        active = outs is not None
        if outs is None:
            flush()
            continue
        # the frontend detokenizes (link.py): a finished request's text is its tokens', cut where a stop string starts
        events = [[] for _ in conns]         # each API server's requests'
        for o in outs:
            if o.finished:
                seq = o.seq
                rid = seq.req.id
                events[owner.pop(rid, 0)].append((rid, o.new_tokens, seq.finish_reason,
                                                  seq.error or seq.stop_text_end, _stats(seq), o.logprobs))
            elif o.new_tokens:
                rid = o.seq.req.id
                events[owner.get(rid, 0)].append((rid, o.new_tokens, None, None, None, o.logprobs))
        # the rank's state and steps to the first API server (/metrics): with a step's tokens now and then, and
        # after the step that leaves the rank without work
        now, idle_after = time.perf_counter(), not engine.has_work
        if now >= state_due or (idle_after and not told_idle):
            state_due, told_idle = now + STATE_EVERY_S, idle_after
            used = engine.spec_len.used
            delta = {k: n - sent_k.get(k, 0) for k, n in used.items() if n != sent_k.get(k, 0)}
            sent_k = dict(used)
            pending.append((0, ("out", events[0], delta, _state(engine, busy_s(now), step_s))))
        elif events[0]:
            pending.append((0, ("out", events[0])))
        told_idle = told_idle and idle_after
        pending += [(api, ("out", ev)) for api, ev in enumerate(events) if api and ev]
        if engine.step_in_flight:
            flush()
    flush()
    engine.stop_followers()      # tensor parallelism: the followers' loops end
    for api in range(len(conns)):
        send(api, ("bye", dp.rank))


def _state(engine, busy_s: float, step_s: float) -> tuple:
    """(running, waiting, KV cache usage 0..1; preemptions, prefix cache queries and hits, steps planned ahead,
    steps with prompt chunks, seconds not waiting for requests and seconds in engine steps so far, the process's
    garbage collections and their seconds since start-up): what /metrics shows of this rank."""
    sc, pool, c, gc = engine.scheduler, engine.pool, engine.counters, collections_since_startup()
    return (len(sc.running), len(sc.waiting), 1 - pool.num_free / pool.num_blocks, c.preemptions,
            pool.queries, pool.hits, c.planned_ahead, c.chunk_steps, round(busy_s, 4), round(step_s, 4),
            gc["gc_collections"], gc["gc_pause_s"])


def _stats(seq) -> dict:
    s, now = seq.stats, time.monotonic()
    scheduled = seq.scheduled_t or now
    first = seq.first_token_t or now
    return {"prompt_tokens": seq.num_prompt, "completion_tokens": len(seq.generated), "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens, "num_accepted_tokens": s.num_accepted_tokens,
            "accepted_per_pos": list(s.accepted_per_pos), "preemptions": seq.preemptions,
            # on this rank: waiting to be scheduled, then to the first token, then to the end (vLLM's phases)
            "queue_s": scheduled - seq.arrived_t, "prefill_s": first - scheduled, "decode_s": now - first}
