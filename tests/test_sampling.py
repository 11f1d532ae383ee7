"""The rejection sampler keeps the target's distribution; the counter-based RNG is uniform."""
import pytest
import torch

from specdp_cli.runtime.sampling import (SamplingParams, probabilities, row_tensors, sample_from, uniforms,
                                         verify)

V = 10


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def simulate(p_pos: torch.Tensor, q_pos: torch.Tensor | None, k: int, rows: int, n_tokens: int,
             draft_fixed: torch.Tensor | None = None) -> torch.Tensor:
    """Speculative decoding of `rows` sequences whose target distribution at position t is p_pos[t]
    (independent of the prefix) and whose drafter draws from q_pos[t] (or always proposes
    draft_fixed[t], an ngram-like one-hot q). Returns the first n_tokens tokens of every row."""
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=1.0, seed=1000 + r) for r in range(rows)]
    rt = row_tensors(params, "cpu")
    logits_pos = p_pos.log()
    out = torch.full((rows, n_tokens + k + 1), -1, dtype=torch.long)
    n = torch.zeros(rows, dtype=torch.long)
    while bool((n < n_tokens).any()):
        live = torch.nonzero(n < n_tokens).squeeze(1)
        sub = {key: (v[live] if isinstance(v, torch.Tensor) else v) for key, v in rt.items()}
        R, nl = live.numel(), n[live]
        pos = nl.view(-1, 1) + torch.arange(k + 1).view(1, -1)                   # [R, k+1]
        tl = logits_pos[pos]                                                     # [R, k+1, V]
        if draft_fixed is not None:
            drafts, q = draft_fixed[pos[:, :k]], None
        else:
            q = q_pos[pos[:, :k]]                                                # [R, k, V]
            drafts = sample_from(q, torch.rand(R, k, generator=g))
        toks, n_out = verify(tl, drafts, torch.full((R,), k), q, sub, nl)
        for j in range(k + 1):
            m = j < n_out
            out[live[m], nl[m] + j] = toks[m, j]
        n[live] += n_out
    return out[:, :n_tokens]


def random_dists(T, seed, sharp=1.5):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(T, V, generator=g) * sharp, -1)


@pytest.mark.parametrize("seed,k", [(1, 1), (2, 3), (3, 2)])
def test_rejection_sampler_keeps_target_distribution(seed, k):
    T = 4
    p, q = random_dists(T + 2 * k + 2, seed), random_dists(T + 2 * k + 2, seed + 100)
    toks = simulate(p, q, k, rows=20000, n_tokens=T)
    for t in range(T):
        counts = torch.bincount(toks[:, t], minlength=V).float()
        assert tv(counts, p[t]) < 0.02, (t, tv(counts, p[t]))


def test_one_hot_drafts_keep_target_distribution():
    T, k = 3, 2
    p = random_dists(T + 2 * k + 2, 7)
    fixed = torch.randint(0, V, (T + 2 * k + 2,), generator=torch.Generator().manual_seed(8))
    toks = simulate(p, None, k, rows=20000, n_tokens=T, draft_fixed=fixed)
    for t in range(T):
        assert tv(torch.bincount(toks[:, t], minlength=V).float(), p[t]) < 0.02


def test_drafter_equal_to_target_accepts_all():
    p = random_dists(6, 9)
    R, k = 500, 3
    rt = row_tensors([SamplingParams(temperature=1.0, seed=r) for r in range(R)], "cpu")
    drafts = sample_from(p[:k].expand(R, k, V), torch.rand(R, k, generator=torch.Generator().manual_seed(1)))
    _, n_out = verify(p[: k + 1].log().expand(R, k + 1, V), drafts, torch.full((R,), k), p[:k].expand(R, k, V),
                      rt, torch.zeros(R, dtype=torch.long))
    assert bool((n_out == k + 1).all())


def test_greedy_rows_take_argmax_prefix():
    logits = torch.randn(3, 4, V)
    arg = logits.argmax(-1)
    drafts = arg[:, :3].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % V          # row 1 rejected at its second draft
    rt = row_tensors([SamplingParams()] * 3, "cpu")
    toks, n_out = verify(logits, drafts, torch.tensor([3, 3, 1]), None, rt, torch.zeros(3, dtype=torch.long))
    assert n_out.tolist() == [4, 2, 2]
    assert toks[0].tolist() == arg[0].tolist() and toks[1, :2].tolist() == arg[1, :2].tolist()


def test_uniforms_are_uniform_and_keyed():
    seeds = torch.arange(1000)
    u = uniforms(seeds, torch.arange(100).view(1, -1).expand(1000, 100), 1)
    assert 0 < u.min() and u.max() < 1
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert bool(((hist - 0.1).abs() < 0.005).all())
    assert torch.equal(u, uniforms(seeds, torch.arange(100).view(1, -1).expand(1000, 100), 1))
    assert not torch.equal(u, uniforms(seeds, torch.arange(100).view(1, -1).expand(1000, 100), 2))


def test_top_k_top_p():
    logits = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0]]])
    params = [SamplingParams(temperature=1.0, top_k=2)]
    p = probabilities(logits, row_tensors(params, "cpu"))[0, 0]
    assert (p > 0).sum() == 2 and p[0] > p[1] > 0
    probs = torch.softmax(logits, -1)[0, 0]
    params = [SamplingParams(temperature=1.0, top_p=float(probs[0] + 1e-3))]
    p = probabilities(logits, row_tensors(params, "cpu"))[0, 0]
    assert (p > 0).sum() == 2          # the first token alone is short of top_p: two are kept
    params = [SamplingParams(temperature=1.0, top_p=float(probs[0] - 1e-3))]
    assert (probabilities(logits, row_tensors(params, "cpu"))[0, 0] > 0).sum() == 1


def test_ngram_lookup_matches_a_plain_scan():
    """The packed-bytes search finds what a plain scan finds: the latest earlier occurrence of the
    longest suffix n-gram (n_max down to n_min), and the tokens that followed it."""
    import random

    from specdp_cli.runtime.drafters.ngram import lookup

    def scan(tokens, n_min, n_max, k):
        L = len(tokens)
        for n in range(min(n_max, L - 1), n_min - 1, -1):
            suffix = tokens[L - n:]
            for i in range(L - 1 - n, -1, -1):
                if tokens[i:i + n] == suffix:
                    return tokens[i + n:i + n + k]
        return []

    rng = random.Random(0)
    for trial in range(3000):
        vocab = rng.choice([3, 5, 50, 70000, 2**31 - 1])     # large ids: bytes that can match off-boundary
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        if vocab > 1000 and tokens and trial % 2:              # plant repeats of big ids
            tokens += tokens[rng.randrange(len(tokens)):][:rng.randrange(1, 6)]
        n_min = rng.randrange(1, 4)
        n_max = n_min + rng.randrange(0, 4)
        k = rng.randrange(1, 6)
        assert lookup(tokens, n_min, n_max, k) == scan(tokens, n_min, n_max, k), (tokens, n_min, n_max, k)
    assert lookup([256, 0, 1], 1, 1, 2) == []       # bytes 01 00 00 00 straddle 256 and 0: no token 1 there
