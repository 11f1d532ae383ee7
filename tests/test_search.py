"""The randomized search of `search.py` (seeded, time-boxed): at dp 1, 2 and 3, over every drafter, k
schedule, policy, dp_sync, async scheduling (method none), max_num_seqs 1-6, KV caches from the minimum up, prefix
caching on and off with prompts that share prefixes, a Qwen3-MoE target, and prompts at the edges of M and D, every
job ends and its greedy float32 output equals transformers' target-only output (up to tokens whose logits tie
within float32's last bits, `engine_util.greedy_up_to_ties`). `--search-seconds` / `--search-seed` run it longer or elsewhere."""
import random

import pytest
import torch

from engine_util import greedy_up_to_ties, hf_reference, reference_model
from helpers import make_deepseek_dir, make_eagle3_head, make_eagle_head, make_moe_dir
from search import check_outputs, run_launched, run_scenarios, scenario, summary

SECONDS = {1: 4, 2: 4, 3: 4}       # per DP size, in the test suite (2 CPU cores; --search-seconds for more)
SEED = 20261201


@pytest.fixture(scope="module")
def search_models(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("search")
    return {"target": str(models["target"]), "mtp": str(make_deepseek_dir(root / "mtp", models["tokenizer"], seed=7)),
            "moe": str(make_moe_dir(root / "moe", models["tokenizer"], family="qwen3_moe", seed=11)),
            "drafters": {"draft_model": str(models["draft"]),
                         "eagle": str(make_eagle_head(root / "eagle", models["target"])),
                         "eagle3": str(make_eagle3_head(root / "eagle3", models["target"]))}}


def budget(request, world):
    s = request.config.getoption("--search-seconds")
    return SECONDS[world] if s is None else s


def seed(request):
    s = request.config.getoption("--search-seed")
    return SEED if s is None else s


def test_search_one_rank(request, tmp_path, search_models):
    from specdp_cli.runtime.dist import DPGroup

    n = run_scenarios(DPGroup.solo(), search_models, tmp_path, seed(request), budget(request, 1))
    print(f"dp 1: {n} scenarios; {summary(tmp_path, search_models)}")
    assert check_outputs(tmp_path, n) == []


@pytest.mark.parametrize("world", [2, 3])
def test_search_launched(request, tmp_path, search_models, world):
    seconds = budget(request, world)
    n = run_launched(search_models, tmp_path, world, seed(request), seconds, timeout=seconds + 90)
    print(f"dp {world}: {n} scenarios; {summary(tmp_path, search_models)}")
    assert n >= 2
    assert check_outputs(tmp_path, n) == []


def test_the_output_check_takes_either_of_tied_tokens_and_nothing_else(search_models):
    """A prompt the search met (seed 4141, dp 2, scenario 2588, request 5): transformers' logits for two tokens tie
    within float32's last bits, `generate` picks one and the engine the other. The check takes both continuations —
    transformers' own and the one taking the first best token of a full forward at each step — and refuses one with
    a token that is not a best choice, one token too many, and one that stops short without eos."""
    sc = scenario(random.Random("4141/2/2588"), search_models, 2)
    prompt, n = sc["requests"][5]["prompt_ids"], 5
    ref = hf_reference(sc["target"], prompt, n)
    model, alt = reference_model(sc["target"]), []
    with torch.no_grad():
        for _ in range(n):
            alt.append(int(model(torch.tensor([prompt + alt])).logits[0, -1].argmax()))
    for tokens in (ref, alt):
        assert greedy_up_to_ties(sc["target"], prompt, tokens, n) is None, tokens
    with torch.no_grad():
        worst = int(model(torch.tensor([prompt + alt[:-1]])).logits[0, -1].argmin())
    assert "token 4" in greedy_up_to_ties(sc["target"], prompt, alt[:-1] + [worst], n)
    assert "not 5" in greedy_up_to_ties(sc["target"], prompt, alt + [alt[-1]], n)
    assert "not 5" in greedy_up_to_ties(sc["target"], prompt, alt[:-1], n, eos=None)
    assert greedy_up_to_ties(sc["target"], prompt, alt[:-1], n) is not None      # short, and the next is not eos
