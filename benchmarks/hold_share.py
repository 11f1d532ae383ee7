"""Session 40 experiment (reverted after it): the offline closed-loop shared-prefix run (codepair, draft_model,
1,500-token prefix, 32 new tokens, 32 in flight) with HOLD_SHARE 0.25, 1 and 0.5 in turn, ROUNDS times on one
engine: tok/s, steps, steps planned ahead, and how many steps held more than HOLD_SHARE of the batch.
Served, the rank reads SPECDP_HOLD_SHARE (this commit only): run_h200.sh s40hold.

Usage: [DEV=cuda] [N=256] [ROUNDS=3] [HS=0.25,1,0.5] python benchmarks/hold_share.py OUT.json"""
import sys, os, time, collections, json, statistics  # noqa: E401
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prefix_cache as pc, torch
import specdp_cli.runtime.engine as em
dev = os.environ.get("DEV", "cuda")
a = type("A", (), dict(pair=".bench/codepair", device=dev, method=os.environ.get("METHOD", "draft_model"), prefix=1500,
                       requests=int(os.environ.get("N", "256")), max_tokens=32, max_num_seqs=32,
                       max_batched_tokens=2048, async_scheduling=True))()
e = pc.build(a, True)
batch = pc.prompts(e, a)
pc.run(e, batch[:1], 2, "warm")
reasons = collections.Counter()
orig = em.Engine._plan
def plan(self):
    sc = self.scheduler
    if self._inflight is None:
        reasons["no_inflight"] += 1
    else:
        hold = {s for s in sc.running if s.pending and not (sc.settled(s) and self.drafter.feeds_on_device(s))}
        uns = sum(1 for s in sc.running if s.pending and not sc.settled(s))
        reasons["unsettled_sum"] += uns; reasons["hold_sum"] += len(hold); reasons["running_sum"] += len(sc.running)
        if len(hold) > em.HOLD_SHARE * len(sc.running):
            reasons["hold_over"] += 1
    return orig(self)
em.Engine._plan = plan
out = []
for rnd in range(int(os.environ.get("ROUNDS", "3"))):
    for hs in [float(x) for x in os.environ.get("HS", "0.25,1,0.5").split(",")]:
        em.HOLD_SHARE = hs
        reasons.clear()
        steps = {"chunks": [], "decode": []}
        ah, s0 = e.counters.planned_ahead, e.step_no
        _, secs, tokens, acc = pc.run(e, batch, 32, f"r{rnd}h{hs}-", steps, 32)
        n = e.step_no - s0
        row = dict(hs=hs, rnd=rnd, tok_s=tokens / secs, steps=n, ahead=e.counters.planned_ahead - ah, acc=acc,
                   chunk_steps=len(steps["chunks"]), ms_chunk=statistics.median(steps["chunks"]) if steps["chunks"] else None,
                   ms_decode=statistics.median(steps["decode"]) if steps["decode"] else None, **reasons)
        print(json.dumps(row), flush=True); out.append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
