"""`specdp generate`: an offline batch job over N data-parallel ranks.

Rank side (`run_rank`): gather earlier results, split the remaining inputs over the machines, serve
them, append each finished result to this rank's part file, and bring every result to rank 0,
which writes the output in input order.

Splitting, by a fixed rule: inputs taken by cost (prompt tokens + max_tokens), largest first, ties in
input order, each to the rank (in lockstep) or machine (dp_sync never) with the least cost so far,
ties to the lower one; a rank serves its inputs in input order. In lockstep the ranks step together,
so a fixed split loses nothing to unequal hosts and which rank serves what stays reproducible.
Without lockstep a machine's ranks take its inputs in input order from one pool (`work_pool.py`)
whenever they have free batch slots: a faster rank serves more and the ranks end together.
"""
from __future__ import annotations

from ..runtime.engine import RequestError
from ..runtime.sampling import SamplingParams
from .inputs import JobRequest, id_key
from .results import (PartWriter, error_record, load_prior, part_path, remove_parts, success_record,
                      summarize, write_output)
from .work_pool import WorkPool


def assign_shards(requests: list[JobRequest], world: int, by_prefix: bool = False) -> list[list[JobRequest]]:
    """The inputs of each of `world` shards, of about equal cost (prompt + max_tokens). by_prefix (prefix
    caching): the inputs in the order of their prompts' tokens, cut into contiguous runs, so prompts sharing a
    prefix sit side by side on one shard (a group spans two only where a cut falls in it) and run one after
    another there, while their blocks are cached; otherwise the largest first onto the least loaded, each shard
    in input order."""
    if by_prefix:
        ordered = sorted(requests, key=lambda r: (r.prompt_ids, r.line))
        total, shards, acc = sum(r.cost for r in ordered), [[] for _ in range(world)], 0
        for req in ordered:           # each input to the shard its cost's midpoint falls in
            shards[min(world - 1, (2 * acc + req.cost) * world // max(2 * total, 1))].append(req)
            acc += req.cost
        return shards
    load = [0] * world
    shards: list[list[JobRequest]] = [[] for _ in range(world)]
    for req in sorted(requests, key=lambda r: (-r.cost, r.line)):
        r = min(range(world), key=lambda w: (load[w], w))
        shards[r].append(req)
        load[r] += req.cost
    for s in shards:
        s.sort(key=lambda q: q.line)
    return shards


def serve_requests(engine, dp, pool: WorkPool, writer: PartWriter, on_result=None) -> list[dict]:
    """Run requests taken from `pool` to the end, taking more whenever the batch has free slots. In
    lockstep every rank keeps stepping (over padding batches once its own work is done) until a step
    finds no work on any rank."""
    records: list[dict] = []
    fingerprints = {}
    finished = []            # the last step's finished sequences: recorded while the next step's device work runs

    def record(rec: dict) -> None:
        writer.write(rec)
        records.append(rec)
        if on_result:
            on_result(rec)

    def top_up() -> None:
        for r in pool.take(engine.free_slots):
            fingerprints[id_key(r.id)] = r.fingerprint
            try:
                engine.add_request(engine.make_request(r.id, r.prompt_ids, SamplingParams.from_dict(r.params),
                                                       r.params.get("seed")))
            except RequestError as e:            # this line's error; the job goes on
                r.error = f"line {r.line}: {e}"
                record(error_record(r))
        engine.drain_to_finish = pool.empty

    def record_finished() -> None:
        for seq in finished:
            rec = success_record(seq, engine.output.text(seq))
            rec["fingerprint"] = fingerprints[id_key(seq.req.id)]
            record(rec)
        finished.clear()

    while True:
        top_up()
        if not (dp.lockstep or engine.has_work):
            break
        outs = engine.step(while_device_runs=record_finished)
        if outs is None:
            break
        finished.extend(out.seq for out in outs if out.finished)
    record_finished()
    return records


def run_rank(engine, dp, output: str, retry_errors: bool, requests: list[JobRequest] | None,
             local_leader: bool, on_result=None, pool_path: str | None = None) -> dict | None:
    """The generate job on one rank; returns the summary on rank 0 (None elsewhere). `pool_path`: the
    claim counter the ranks of this machine share (in its run directory; None with one rank)."""
    shared = not dp.lockstep and pool_path is not None and dp.world > 1   # the same on every rank
    per = engine.plan.ranks_per_machine if shared else 1       # shared: a machine's ranks share its list
    prior = load_prior(output, retry_errors) if local_leader else {}
    priors = dp.gather_objects(prior, "gathering earlier results")
    shards = errors_now = done = None
    if dp.rank == 0:
        # earlier results count only when the same job made them (the CLI refuses a changed job on
        # machine 0; this also guards the part files of the other machines)
        wanted = {r.key: r.fingerprint for r in requests}
        done = {}
        for p in priors:
            done.update({k: rec for k, rec in p.items() if k in wanted and rec.get("fingerprint") == wanted[k]})
        errors_now = [r for r in requests if r.error and r.key not in done]
        todo = [r for r in requests if not r.error and r.key not in done]
        groups = assign_shards(todo, max(1, dp.world // per), engine.cfg.cache.enable_prefix_caching)
        shards = [groups[r // per] for r in range(dp.world)]
    mine = dp.scatter_objects(shards, "sending inputs")
    pool = WorkPool(mine, pool_path if shared else None, per)

    writer = PartWriter(part_path(output, dp.rank))
    try:
        if dp.rank == 0:
            for r in errors_now:
                rec = error_record(r)
                writer.write(rec)
                if on_result:
                    on_result(rec)
        records = serve_requests(engine, dp, pool, writer, on_result)
    finally:
        writer.close()
        pool.close()
    engine.stop_followers()      # tensor parallelism: the followers' part is over; they leave before the last waits
    if not dp.lockstep:
        dp.wait_for_all("waiting for the other ranks to finish")
    report = {**engine.counters.report(dp.rank, pool.taken), "startup": engine.startup, "launch": engine.launch,
              "graphs": engine.graphs}
    gathered = dp.gather_objects((records, report), "gathering results")

    summary = None
    if dp.rank == 0:
        new_records = [error_record(r) for r in errors_now] + [rec for recs, _ in gathered for rec in recs]
        merged = dict(done)
        merged.update({id_key(rec["id"]): rec for rec in new_records})
        write_output(output, requests, merged)
        summary = summarize([rep for _, rep in gathered], new_records, None, resumed=len(done),
                            weights_per_token=(engine.plan.memory or {}).get("weights_per_token"))
    dp.wait_for_all("output written")
    if local_leader:
        remove_parts(output)
    return summary
