"""Where lockstep's cost goes: 2 ranks, each with half of N cut prompts x NEW tokens at max_num_seqs 32,
stepping as `generate` does; per rank it prints steps, wall time, time inside the step sync (waiting for
the peer included; split into latency = first exit - last entry, and this rank's wait for the peer), the
mean time of steps with and without prompt chunks ("wide"). Modes, in the same processes, twice (the
first round pays warm-up): never, always (the step sync over Unix datagrams, as on one machine), and
always-nccl (the step sync through the NCCL/gloo collective, as across machines). Then the bare step
sync back to back over each transport.

Usage: PAIR=.bench/codepair [N=256] [NEW=128] torchrun --nproc_per_node 2 benchmarks/lockstep_probe.py
(one JSON line per rank and mode; CPU + gloo when there is no GPU, for a dry run with small N)."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformers import AutoTokenizer  # noqa: E402

from specdp_cli.config import validate  # noqa: E402
from specdp_cli.preflight import run_preflight  # noqa: E402
from specdp_cli.runtime.dist import DPGroup  # noqa: E402
from specdp_cli.runtime.engine import Engine, RankCounters  # noqa: E402
from specdp_cli.runtime.sampling import SamplingParams  # noqa: E402
from specdp_cli.runtime.status import StatusBoard  # noqa: E402
from workloads import cut_prompts  # noqa: E402


def main() -> None:
    P = os.environ.get("PAIR", ".bench/codepair")
    N, NEW = int(os.environ.get("N", 256)), int(os.environ.get("NEW", 128))
    rank = int(os.environ["RANK"])
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    tok = AutoTokenizer.from_pretrained(f"{P}/tokenizer")
    prompts = [tok(t)["input_ids"] for t in cut_prompts(P, 4, N)][rank::2]
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    dp = DPGroup.from_env("nccl" if cuda else "gloo", True, 60, False, dev, StatusBoard(None, rank))
    spent = {"sync": 0.0, "wide": 0}
    stamps: list[tuple[str, float, float]] = []     # (what, entry, exit): CLOCK_MONOTONIC, one clock per machine
    plain_sync = dp._sync

    def timed_sync(fields, step, what):        # the step sync and the vote, waiting for the peer included
        t = time.perf_counter()
        try:
            return plain_sync(fields, step, what)
        finally:
            t_exit = time.perf_counter()
            spent["sync"] += t_exit - t
            stamps.append((what, t, t_exit))

    dp._sync = timed_sync
    local = dp.local
    for mode in ("never", "always", "always-nccl", "never", "always", "always-nccl"):
        dp.local = local if mode == "always" else None     # always-nccl: the step sync through the collective
        cfg = validate({"model": f"{P}/target", "tokenizer": f"{P}/tokenizer",
                        "dtype": "bfloat16" if cuda else "float32", "device": "cuda" if cuda else "cpu",
                        "max_model_len": 2048, "cache": {"num_blocks": 8192},
                        "speculative": {"method": "draft_model", "model": f"{P}/draft", "num_speculative_tokens": 4},
                        "parallel": {"data_parallel_size": 2, "dp_sync": mode[:6]},
                        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 16384}})
        plan = run_preflight(cfg).plan
        dp.lockstep = plan.lockstep
        eng = Engine(cfg, plan, dp, dev)
        plain_agree = eng.agree

        def agree(fields, step, _agree=plain_agree, _eng=eng):
            sz = _agree(fields, step)
            if sz is not None:
                spent["wide"] += sz.T == _eng.T_chunk
                spent["last_wide"] = sz.T == _eng.T_chunk
            return sz

        eng.agree = agree
        for warm in (True, False):
            batch = prompts[:16] if warm else prompts
            for i, p in enumerate(batch):
                eng.add_request(eng.make_request(f"{warm}{i}", p, SamplingParams(max_tokens=16 if warm else NEW), None))
            eng.counters = RankCounters()
            spent.update(sync=0.0, wide=0, wide_s=0.0, narrow_s=0.0, last_wide=False)
            stamps.clear()
            torch.distributed.barrier()
            t = time.perf_counter()
            while dp.lockstep or eng.has_work:
                t_step = time.perf_counter()
                if eng.step() is None:
                    break
                spent["wide_s" if spent["last_wide"] else "narrow_s"] += time.perf_counter() - t_step
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t
        c = eng.counters
        split = split_sync_time(stamps, rank) if dp.lockstep else {}
        print(json.dumps({"mode": mode, "rank": rank, "steps": c.steps, "wide_steps": spent["wide"],
                          "wall_s": round(wall, 3), "sync_s": round(spent["sync"], 3),
                          "ms_per_step": round(wall / c.steps * 1e3, 3),
                          "sync_ms_per_step": round(spent["sync"] / c.steps * 1e3, 3),
                          "wide_ms": round(spent["wide_s"] / max(spent["wide"], 1) * 1e3, 3),
                          "narrow_ms": round(spent["narrow_s"] / max(c.steps - spent["wide"], 1) * 1e3, 3),
                          "tok_s": round(c.generated_tokens / wall), **split}), flush=True)
        del eng
    for dp.local in (local, None):                  # the bare step sync, back to back, GPU idle
        t = time.perf_counter()
        for i in range(500):
            plain_sync([i, 1, 2, 3, 4, 5], i, "bare")
        print(json.dumps({"rank": rank, "transport": "local" if dp.local else "collective",
                          "bare_sync_us": round((time.perf_counter() - t) / 500 * 1e6, 1)}), flush=True)
    torch.distributed.destroy_process_group()


def split_sync_time(stamps, rank) -> dict:
    """Per collective: latency = first exit - last entry (both ranks inside); this rank's wait = last
    entry - its entry (the peer was late). Means in µs, by collective."""
    every: list = [None, None]
    torch.distributed.all_gather_object(every, stamps)
    out = {}
    for what in ("step sync",):
        lat, wait = [], []
        for per_rank in zip(*every):
            if per_rank[0][0] != what:
                continue
            last_in = max(e for _, e, _ in per_rank)
            lat.append(min(x for _, _, x in per_rank) - last_in)
            wait.append(last_in - per_rank[rank][1])
        key = what.replace(" ", "_")
        out[f"{key}_latency_us"] = round(sum(lat) / max(len(lat), 1) * 1e6, 1)
        out[f"{key}_wait_us"] = round(sum(wait) / max(len(wait), 1) * 1e6, 1)
    return out


if __name__ == "__main__":
    main()
