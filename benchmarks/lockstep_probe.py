"""Where lockstep's cost goes: 2 ranks, each with half of N cut prompts x NEW tokens at max_num_seqs 32,
stepping as `generate` does; per rank it prints steps, wall time, time inside the step collectives (sync and
vote, waiting for the peer included) and steps with prompt chunks. Runs dp_sync never, always, never, always
in the same processes (the first two pay warm-up).

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
    dp = DPGroup.from_env("nccl" if cuda else "gloo", True, 60, False, dev, StatusBoard(None, rank))
    spent = {"sync": 0.0, "wide": 0}
    plain_sync = dp._sync

    def timed_sync(fields, step, what):        # the step sync and the vote, waiting for the peer included
        t = time.perf_counter()
        try:
            return plain_sync(fields, step, what)
        finally:
            spent["sync"] += time.perf_counter() - t

    dp._sync = timed_sync
    for mode in ("never", "always", "never", "always"):
        cfg = validate({"model": f"{P}/target", "tokenizer": f"{P}/tokenizer",
                        "dtype": "bfloat16" if cuda else "float32", "device": "cuda" if cuda else "cpu",
                        "max_model_len": 2048, "cache": {"num_blocks": 8192},
                        "speculative": {"method": "draft_model", "model": f"{P}/draft", "num_speculative_tokens": 4},
                        "parallel": {"data_parallel_size": 2, "dp_sync": mode},
                        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 16384}})
        plan = run_preflight(cfg).plan
        dp.lockstep = plan.lockstep
        eng = Engine(cfg, plan, dp, dev)
        plain_agree = eng.agree

        def agree(fields, step, _agree=plain_agree, _eng=eng):
            sz = _agree(fields, step)
            spent["wide"] += sz.T == _eng.T_chunk
            return sz

        eng.agree = agree
        for warm in (True, False):
            batch = prompts[:16] if warm else prompts
            for i, p in enumerate(batch):
                eng.add_request(eng.make_request(f"{warm}{i}", p, SamplingParams(max_tokens=16 if warm else NEW), None))
            eng.counters = RankCounters()
            spent.update(sync=0.0, wide=0)
            torch.distributed.barrier()
            t = time.perf_counter()
            while dp.lockstep or eng.has_work:
                eng.step()
                if dp.lockstep and not dp.vote(eng.has_work, eng.step_no):
                    break
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t
        c = eng.counters
        print(json.dumps({"mode": mode, "rank": rank, "steps": c.steps, "wide_steps": spent["wide"],
                          "wall_s": round(wall, 3), "sync_s": round(spent["sync"], 3),
                          "ms_per_step": round(wall / c.steps * 1e3, 3),
                          "sync_ms_per_step": round(spent["sync"] / c.steps * 1e3, 3),
                          "tok_s": round(c.generated_tokens / wall)}), flush=True)
        del eng
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
