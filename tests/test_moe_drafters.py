"""benchmarks/moe_drafters.py, what the MoE demo's MTP layer is trained on: its recursive chain (every chain t of
a batch at once, under one mask) computes, step for step, the logits specdp's `method: mtp` drafter computes
when it drafts over its paged KV cache — step 1 at every verified position, steps 2..3 one position further
each, fed the previous step's output — and the acceptance summary counts drafts accepted in a row."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_util import single_row_runner
from helpers import make_deepseek_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from moe_drafters import MTP, acceptance, chain_logits  # noqa: E402


@pytest.mark.parametrize("q_lora_rank, rope_interleave", [(None, True), (32, False)])
def test_the_trained_chain_is_what_specdp_drafts(tmp_path, models, q_lora_rank, rope_interleave):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from specdp_cli.runtime.models.loader import load_head, load_model

    torch.set_num_threads(1)
    path = make_deepseek_dir(tmp_path / "ds", models["tokenizer"], q_lora_rank=q_lora_rank,
                             rope_interleave=rope_interleave, seed=11)
    cpu, S, D, hidden = torch.device("cpu"), 16, 3, 64
    # transformers loads the MTP layer's decoder layer as a fourth layer when told there are four
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, num_hidden_layers=4).eval()
    w = load_file(str(next(path.glob("*.safetensors"))))
    p = "model.layers.3."
    mtp = MTP(ref.model.layers[3], hidden, ref.config.vocab_size).eval()
    with torch.no_grad():
        for mod, key in ((mtp.enorm, "enorm"), (mtp.hnorm, "hnorm"), (mtp.eh_proj, "eh_proj"),
                         (mtp.head_norm, "shared_head.norm"), (mtp.head, "shared_head.head")):
            mod.weight.copy_(w[p + key + ".weight"])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, ref.config.vocab_size, (1, S + D + 1), generator=g)
    feats = torch.randn(1, S, hidden, generator=g)
    with torch.no_grad():
        ours = chain_logits(mtp, ref, ids, feats, D)            # D x [1, S, V]

    target = load_model(str(path), torch.float32, cpu, 64)
    head = load_head("mtp", str(path), target, torch.float32, cpu, 64)
    runner = single_row_runner(head, S, bs=4)
    zero = torch.zeros(1, dtype=torch.long)
    for t in range(S):
        # step 1 over every position (it rewrites the slots an earlier chain's steps 2..3 took), then the chain
        head.feats = feats[0].clone()
        runner.set_rows(1, ids[:, 1:S + 1], zero, torch.full((1,), S), zero)
        logits = runner.forward(1, S, graphs=False)[0, t]
        torch.testing.assert_close(logits, ours[0][0, t], rtol=1e-4, atol=1e-4)
        feature = runner.hidden[t].clone()
        for d in range(2, D + 1):
            head.feats[:1] = feature
            runner.set_rows(1, ids[:, t + d].view(1, 1), torch.full((1,), t + d - 1), torch.ones(1, dtype=torch.long),
                            zero)
            logits = runner.forward(1, 1, graphs=False)[0, 0]
            torch.testing.assert_close(logits, ours[d - 1][0, t], rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"chain {t} step {d}: {m}")
            feature = runner.hidden[0].clone()
    # the steps differ (a chain that fed step 1's input again would repeat its logits)
    assert not torch.allclose(F.softmax(ours[0], -1), F.softmax(ours[1], -1), atol=1e-3)


def test_acceptance_counts_drafts_right_in_a_row():
    right = torch.tensor([[[True, True, False, True], [False, True, True, True], [True, True, True, True]]])
    a = acceptance(right)
    assert a["k1"]["mean_acceptance_length"] == pytest.approx(1 + 2 / 3, abs=1e-3)
    assert a["k2"]["mean_acceptance_length"] == pytest.approx(1 + (2 + 0 + 2) / 3, abs=1e-3)
    assert a["k4"]["mean_acceptance_length"] == pytest.approx(1 + (2 + 0 + 4) / 3, abs=1e-3)
    assert a["k4"]["acceptance_rate"] == pytest.approx(2 / 4, abs=1e-3)
