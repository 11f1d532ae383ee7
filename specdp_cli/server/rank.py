"""The serving loop of one rank: requests arrive from the frontend over the link, tokens go back
after every step.

Waiting for work is a blocking read of this rank's inbox — no collective, no timeout, no spinning.
With `dp_sync: always` the ranks step together while any of them has work: each step's sync says
whether some rank has, and when none has every rank goes back to waiting. The frontend sends every
rank one message per event (the request or abort to its rank, a "wake" to the others), so every
rank receives the same number of messages. The step sync carries each rank's count, and the ranks
go back to waiting only when the counts agree: a message that is late to one rank (its partners
already consumed theirs) is then stepped for by everyone, never by its rank alone.
"""
from __future__ import annotations

import queue
import threading
import time
from multiprocessing.connection import Client

from ..runtime.engine import RequestError
from ..runtime.sampling import SamplingParams
from .link import link_address, no_delay


def serve_rank(engine, dp, job: dict) -> None:
    engine.fail_stalled = True        # a stall fails its requests (a 500 each); the server goes on
    address, authkey = link_address(job["link"])
    conn = Client(address, authkey=authkey)
    no_delay(conn)
    conn.send(("hello", dp.rank))
    inbox: queue.Queue = queue.Queue()
    send_lock = threading.Lock()

    def reader() -> None:
        try:
            while True:
                inbox.put(conn.recv())
        except (EOFError, OSError):
            inbox.put(("shutdown", "link lost"))     # the frontend is gone (not one of its messages)

    threading.Thread(target=reader, daemon=True, name="specdp-link").start()

    def send(msg) -> None:
        with send_lock:
            conn.send(msg)

    # A step's tokens go out while the device runs the next step (`engine.step`'s `while_device_runs`),
    # off the step's critical path; sooner when no next step follows at once, and before any other message
    # (an abort's answer must not overtake the tokens before it).
    pending = []

    def flush() -> None:
        while pending:
            send(pending.pop(0))

    def reply(msg) -> None:             # an answer to a frontend message, after the tokens already due
        flush()
        send(msg)

    shutting_down = False
    active = False            # lockstep: stepping together until a step finds no work on any rank
    received = 0              # messages from the frontend (see the module docstring)
    sent_k: dict[int, int] = {}   # steps per k already reported to the frontend (/metrics)
    sent_state = None             # the scheduler state last reported (/metrics): sent again when it changes
    while True:
        if not active and not engine.has_work:
            flush()
            if shutting_down:
                break
            dp.publish(engine.step_no, "waiting for requests")
            msgs = [inbox.get()]              # blocks: idle ranks do not spin and hold no collective
        else:
            msgs = []
        while True:
            try:
                msgs.append(inbox.get_nowait())
            except queue.Empty:
                break
        received += sum(1 for m in msgs if m != ("shutdown", "link lost"))
        for msg in msgs:
            kind = msg[0]
            if kind == "add":
                _, req_id, prompt_ids, params, seed = msg
                try:
                    engine.add_request(engine.make_request(req_id, prompt_ids, SamplingParams.from_dict(params),
                                                           seed))
                except RequestError as e:            # that request fails (a 500 naming why); the rank goes on
                    reply(("out", [(req_id, [], "error", str(e), None, None)], {}, _state(engine)))
            elif kind == "abort":
                if engine.abort(msg[1]):
                    sent_state = _state(engine)
                    reply(("out", [(msg[1], [], "abort", None, None, None)], {}, sent_state))
            elif kind == "shutdown":
                shutting_down = True
        if shutting_down and not dp.lockstep:
            for seq in list(engine.scheduler.running):
                engine.abort(seq.req.id)
            break
        if not dp.lockstep and not engine.has_work:
            active = False                    # wait for the next message (above), not spin
            continue
        outs = engine.step(received, while_device_runs=flush)
        active = outs is not None
        if outs is None:
            flush()
            continue
        # the frontend detokenizes (link.py): a finished request's text is its tokens', cut where a stop string starts
        events = [(o.seq.req.id, o.new_tokens, o.seq.finish_reason if o.finished else None,
                   (o.seq.error or o.seq.stop_text_end) if o.finished else None,
                   _stats(o.seq) if o.finished else None, o.logprobs) for o in outs if o.new_tokens or o.finished]
        state = _state(engine)
        if events or state != sent_state:
            used = engine.spec_len.used
            delta = {k: n - sent_k.get(k, 0) for k, n in used.items() if n != sent_k.get(k, 0)}
            sent_k, sent_state = dict(used), state
            pending.append(("out", events, delta, state))
    flush()
    engine.stop_followers()      # tensor parallelism: the followers' loops end
    send(("bye", dp.rank))


def _state(engine) -> tuple[int, int, float, int, int, int, int, int]:
    """(running, waiting, KV cache usage 0..1; preemptions, prefix cache queries and hits, steps planned ahead and
    steps with prompt chunks so far): what /metrics shows of this rank."""
    sc, pool, c = engine.scheduler, engine.pool, engine.counters
    return (len(sc.running), len(sc.waiting), 1 - pool.num_free / pool.num_blocks, c.preemptions,
            pool.queries, pool.hits, c.planned_ahead, c.chunk_steps)


def _stats(seq) -> dict:
    s, now = seq.stats, time.monotonic()
    scheduled = seq.scheduled_t or now
    first = seq.first_token_t or now
    return {"prompt_tokens": seq.num_prompt, "completion_tokens": len(seq.generated), "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens, "num_accepted_tokens": s.num_accepted_tokens,
            "accepted_per_pos": list(s.accepted_per_pos), "preemptions": seq.preemptions,
            # on this rank: waiting to be scheduled, then to the first token, then to the end (vLLM's phases)
            "queue_s": scheduled - seq.arrived_t, "prefill_s": first - scheduled, "decode_s": now - first}
