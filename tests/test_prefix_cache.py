"""Prefix caching (issue 33): full KV blocks registered under a chained hash of their tokens, shared between
sequences, reference-counted, evicted least-recently-freed first; lossless with every drafter, at dp 1 and dp 2,
with shared prefixes and preemption, and its queries and hits reported."""
import json

import pytest

from dp_util import dp_config, generate_args, run_in_process, selected, write_jsonl
from engine_util import check_against_reference, make_config, make_engine, prompts_of_lengths, run_engine
from helpers import make_eagle_head
from specdp_cli.runtime.block_hash import block_hashes
from specdp_cli.runtime.kv_cache import BlockPool
from specdp_cli.runtime.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)


def shared_prefix_prompts(n=6, prefix=30, seed=3):
    base = prompts_of_lengths([prefix], seed=seed)[0]
    tails = prompts_of_lengths([3 + i % 5 for i in range(n)], seed=seed + 1)
    return [base + t for t in tails]


def test_block_hashes_chain_sha256_over_each_blocks_int64_tokens():
    """The definition the frontend's routing and every rank share: block i's hash is sha256 of block i-1's hash
    and its tokens as little-endian int64; extending known hashes gives the hashes of hashing all at once."""
    import hashlib
    import random
    import struct

    rng = random.Random(5)
    toks = [rng.randrange(200_000) for _ in range(70)]
    prev, want = b"specdp", []
    for i in range(70 // 16):
        prev = hashlib.sha256(prev + struct.pack("<16q", *toks[i * 16:(i + 1) * 16])).digest()
        want.append(prev)
    assert block_hashes(toks, 16, [], 4) == want
    for k in range(5):
        known = block_hashes(toks, 16, [], k)
        assert block_hashes(toks, 16, known, 4) == want and known == want    # extended in place
    assert block_hashes(toks, 16, list(want), 2) == want[:2]


def test_the_frontend_hashes_a_prompt_and_its_rank_takes_the_hashes():
    """With prefix caching on the server's frontend works out a prompt's block hashes (for routing, and so that its
    rank need not: a 1,500-token prompt's cost a served rank a twelfth of its step) and sends them with the request;
    the rank's sequence starts from them and extends them as a rank that hashed the prompt itself would."""
    from specdp_cli.runtime.block_hash import split
    from specdp_cli.runtime.scheduler import Request, Sequence
    from specdp_cli.server.frontend import Frontend
    from specdp_cli.server.metrics import Metrics
    from specdp_cli.server.protocol import GenRequest

    class Link:
        all_up = True

        def __init__(self):
            self.sent = []

        def send(self, rank, msg):
            self.sent.append((rank, msg))
            return True

    prompt = shared_prefix_prompts(1, prefix=45)[0]           # 45 + 3 tokens: two full blocks of 16 before the last
    want = block_hashes(prompt, 16, [], 2)
    sent = {}
    for block_size in (16, None):                              # prefix caching on, off
        fe = Frontend(1, Metrics("tiny", 1, 256), 8, 8, None, block_size)
        fe.link = Link()
        fe.submit(GenRequest(prompt, {"max_tokens": 4, "seed": None}, False, False, False, "tiny"))
        (_, sent[block_size]), = fe.link.sent
        assert sent[block_size][:3] == ("add", sent[block_size][1], prompt)
    assert split(sent[16][5]) == want and sent[None][5] == b""
    given = split(sent[16][5])
    seq = Sequence(Request("r", prompt, SamplingParams(max_tokens=4), None, given), 256)
    assert seq.block_hashes == want and seq.block_hashes is not given
    seq.tokens += [7, 8]                                       # 50 tokens: a third full block
    assert block_hashes(seq.tokens, 16, seq.block_hashes, 3) == block_hashes(seq.tokens, 16, [], 3)


def test_pool_shares_counts_and_evicts_the_least_recently_freed():
    pool = BlockPool(4, 2, prefix_caching=True)
    toks = [5, 6, 7, 8, 9, 10]
    h = block_hashes(toks, 2, [], 3)
    assert block_hashes(toks, 2, h[:1], 3) == h and block_hashes([5, 6, 7, 0], 2, [], 2)[1] != h[1]   # chained
    a = pool.allocate(3)
    for b, x in zip(a, h):
        pool.register(b, x)
    assert pool.cached_prefix(h) == a and pool.cached_prefix(block_hashes([1, 6], 2, [], 1)) == []
    pool.take(a[:2])                                  # a second sequence shares the first two blocks
    pool.free(a)                                      # the first lets go: only its third block is unheld
    assert pool.num_free == 2 and pool.evictable_among(a) == 1
    pool.free(a[:2])                                  # all cached, nobody holds them: free but kept
    assert pool.num_free == 4 and pool.cached_prefix(h) == a
    fresh = pool.allocate(2)                          # the never-used block, then the least recently freed
    assert fresh[0] not in a and fresh[1] == a[2]
    assert pool.cached_prefix(h) == a[:2]
    assert pool.allocate(1) == [a[1]]                 # a sequence's tail goes before its head
    assert pool.cached_prefix(h) == a[:1] and pool.cached_prefix(h[1:]) == []


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_greedy_with_caching_equals_transformers_with_preemption(tmp_path, models, method):
    """Two waves of prompts sharing a 30-token prefix (block 4): the second wave hits the first's blocks; a KV
    cache of 40 blocks for 4 sequences of up to 96 tokens preempts. Outputs equal transformers' greedy ones."""
    draft = models["draft"] if method == "draft_model" else make_eagle_head(tmp_path / "head", models["target"])
    M = 96
    cfg, plan = make_config(models["target"], draft, method=method, k=3, M=M, max_num_seqs=4, max_batched=64,
                            cache={"block_size": 4, "num_blocks": 40})
    engine = make_engine(cfg, plan)
    prompts = shared_prefix_prompts(8)
    first = run_engine(engine, prompts[:4], max_tokens=40)
    pool, counters = engine.pool, engine.counters
    assert pool.hits >= 3 * 28                       # within the wave: the prefix was found by the later three
    hits = pool.hits
    second = {i + 4: s for i, s in run_engine(engine, prompts[4:], max_tokens=40).items()}
    assert pool.hits >= hits + 4 * 28 and counters.preemptions > 0
    done = {**first, **second}
    check_against_reference(models["target"], {i: done[i] for i in range(8)}, prompts, 40, M, label=method)
    assert counters.report(0, 8)["prefix_cache"] == {"queries": pool.queries, "hits": pool.hits}


def test_caching_off_changes_nothing_and_finds_nothing(models):
    prompts = shared_prefix_prompts(4)
    out = {}
    for on in (True, False):
        cfg, plan = make_config(models["target"], models["draft"], k=3, M=96, cache={"block_size": 4,
                                                                                     "enable_prefix_caching": on})
        engine = make_engine(cfg, plan)
        out[on] = [s.generated for half in (prompts[:2], prompts[2:])      # sampled, seeded: the second half hits
                   for s in run_engine(engine, half, max_tokens=20, temperature=0.8, seed=4).values()]
        assert (engine.pool.hits > 0) == on
    assert out[True] == out[False]


def test_a_fully_cached_prompt_still_computes_its_last_token(models):
    cfg, plan = make_config(models["target"], models["draft"], k=3, M=96, cache={"block_size": 4})
    engine = make_engine(cfg, plan)
    p = prompts_of_lengths([32], seed=9)[0]                   # 8 full blocks
    a = run_engine(engine, [p], max_tokens=8)[0]
    b = run_engine(engine, [p], max_tokens=8)[0]
    assert b.cached_tokens == 28 and a.generated == b.generated        # 7 blocks found, the 8th recomputed
    engine.add_request(engine.make_request("x", p, SamplingParams(max_tokens=3), None))
    engine.step()
    seq = engine.scheduler.running[0]
    assert all(blk not in seq.blocks[7:] for blk in a.blocks)         # a block of its own from the last token on


@pytest.fixture(scope="module", autouse=True)
def cache_jobs(request, tmp_path_factory, models, launches) -> dict:
    """The dp 2 commands of `test_dp2_with_caching_equals_dp1_and_keeps_its_hit_rate`, started when this module
    starts (while the in-process tests run): {method: (run directory, input, drafter)}."""
    jobs = {}
    for p in selected(request, "test_dp2_with_caching_equals_dp1_and_keeps_its_hit_rate"):
        method, tmp = p["method"], tmp_path_factory.mktemp("cache_job")
        draft = models["draft"] if method == "draft_model" else make_eagle_head(tmp / "head", models["target"])
        prompts = [g[i] for i in range(4) for g in (shared_prefix_prompts(4, seed=s) for s in (3, 5, 7, 9))]
        inp = write_jsonl(tmp / "in.jsonl", [{"prompt": p, "max_tokens": 12} for p in prompts])
        cfg = dp_config(tmp, models["target"], draft, method=method, dp=2, M=96, cache={"block_size": 4},
                        max_num_seqs=2)
        jobs[method] = (tmp, inp, draft)
        launches.start(method, *generate_args(tmp, inp, cfg))
    return jobs


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_dp2_with_caching_equals_dp1_and_keeps_its_hit_rate(models, cache_jobs, launches, method):
    """Four groups of four prompts, each group sharing a 30-token prefix, interleaved in the input: dp 2 groups
    them by prefix when it splits the inputs, so it finds ≥ 90 % of what dp 1 finds; outputs equal caching off."""
    tmp_path, inp, draft = cache_jobs[method]
    ref_cfg = dp_config(tmp_path, models["target"], draft, method=method, dp=1, M=96, name="ref.yaml",
                        cache={"enable_prefix_caching": False})
    run_in_process(ref_cfg, inp, tmp_path / "ref.jsonl")
    one = dp_config(tmp_path, models["target"], draft, method=method, dp=1, M=96, name="one.yaml", cache={"block_size": 4},
                    max_num_seqs=2)
    run_in_process(one, inp, tmp_path / "one.jsonl", "--summary-json", tmp_path / "one.json")
    r, _ = launches.result(method)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = [json.loads(x)["token_ids"] for x in open(tmp_path / "ref.jsonl")]
    for out in ("one.jsonl", "out.jsonl"):
        assert [json.loads(x)["token_ids"] for x in open(tmp_path / out)] == ref
    dp1, dp2 = (json.load(open(tmp_path / f))["prefix_cache"] for f in ("one.json", "s.json"))
    assert dp1["hits"] >= 4 * 2 * 28 and dp2["hit_rate"] >= 0.9 * dp1["hit_rate"], (dp1, dp2)


def test_routing_sends_a_prefix_where_it_is_cached_while_the_load_allows():
    from specdp_cli.server.routing import PrefixIndex, pick_rank, prompt_hashes

    index = PrefixIndex(3)
    a, b = shared_prefix_prompts(6, seed=3), shared_prefix_prompts(6, seed=8)
    load = [0, 0, 0]

    def send(p, cost=50):
        r = pick_rank(load, cost, index, prompt_hashes(p, 4))
        load[r] += cost
        return r

    assert send(a[0]) == 0 and send(b[0]) == 1            # nothing cached: the least loaded
    assert send(a[1]) == 0                                 # rank 0 holds a's prefix and is within one request
    assert send(a[2]) == 2                                 # rank 0 is two requests ahead: the least loaded
    assert send(b[1]) == 1 and send(a[3]) in (0, 2)
    assert pick_rank(load, 50, None, prompt_hashes(a[4], 4)) == min(range(3), key=lambda r: (load[r], r))


def test_a_draft_model_reads_cached_blocks_only_with_their_drafter_kv(models):
    """A request that drafts nothing (max_tokens 1) does not feed the draft model: its blocks are cached without
    drafter KV. A drafting request does not take them (it recomputes, and its blocks replace them); the next one
    takes those. Their drafts — hence their acceptance counts — equal those with caching off (the target drafts for
    itself here: with its KV in place every draft is accepted; garbage drafter KV would be seen)."""
    prompts = shared_prefix_prompts(3, seed=11)
    stats = {}
    for on in (True, False):
        cfg, plan = make_config(models["target"], models["target"], k=3, M=96, cache={"block_size": 4,
                                                                                     "enable_prefix_caching": on})
        engine = make_engine(cfg, plan)
        run_engine(engine, prompts[:1], max_tokens=1)
        hits = [engine.pool.hits]
        stats[on] = []
        for p in prompts[1:]:
            s = run_engine(engine, [p], max_tokens=16)[0]
            stats[on].append((s.generated, s.stats.num_draft_tokens, s.stats.num_accepted_tokens))
            hits.append(engine.pool.hits)
        if on:
            assert hits[1] == hits[0] and hits[2] - hits[1] >= 28, hits
    assert stats[True] == stats[False] and all(a == d > 0 for _, d, a in stats[True])
