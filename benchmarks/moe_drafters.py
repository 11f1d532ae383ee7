"""The MoE demo's drafters as a user would train them for its target (benchmarks/train_moe_pair.py): DeepSeek-V3's
MTP layer applied recursively the way specdp drafts with it, the distillation loss, and how often each drafter
agrees with the target on held-out text.

How specdp's `method: mtp` drafts k tokens after verified position t (runtime/models/deepseek_v3.py's MTPHead,
runtime/drafters/eagle.py): step 1 at position t reads x = eh_proj(cat(enorm(embed(token t+1)), hnorm(h_t))),
h_t the target's last hidden state after its final norm, runs the decoder layer and predicts token t+2 through
shared_head (norm, head); step d >= 2 at position t+d-1 reads (embed(token t+d), y_{d-1}), y_{d-1} step d-1's
decoder-layer output before shared_head.norm, and predicts token t+d+1. Step d's attention reads the layer's KV
cache as it is then: step-1 entries at positions 0..t (every verified position has one) and this chain's own
entries of steps 2..d at t+1..t+d-1. `MTP.chain` runs every chain t of a batch at once: step d's attention
takes the inputs of steps 1..d side by side under a mask that says exactly that (`chain_mask`).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm(h: int) -> nn.Module:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    return DeepseekV3RMSNorm(h, eps=1e-6)


def chain_positions(S: int, D: int, device) -> torch.Tensor:
    """[1, D * S]: step d's entry of chain t sits at position t + d - 1."""
    return torch.cat([torch.arange(S, device=device) + d for d in range(D)]).view(1, -1)


def chain_mask(S: int, D: int, device) -> torch.Tensor:
    """[1, 1, D * S, D * S] additive: step d of chain t attends to step-1 entries 0..t and to its own chain's
    entries of steps 2..d. Its top-left (d * S)^2 block is the mask of d steps."""
    t = torch.arange(S, device=device)
    causal, diag = t[None] <= t[:, None], t[None] == t[:, None]
    none = torch.zeros_like(causal)
    rows = [torch.cat([causal if e == 0 else diag if e <= d else none for e in range(D)], 1) for d in range(D)]
    allowed = torch.cat(rows, 0)
    return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf")).view(1, 1, D * S, D * S)


class MTP(nn.Module):
    """DeepSeek-V3's MTP module around a decoder layer of the model's own class (layer index N: sparse)."""

    def __init__(self, layer: nn.Module, hidden: int, vocab: int):
        super().__init__()
        self.enorm, self.hnorm = rms_norm(hidden), rms_norm(hidden)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer
        self.head_norm = rms_norm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def chain(self, embeds: list[torch.Tensor], hidden: torch.Tensor, rotary) -> list[torch.Tensor]:
        """Logits [B, S, V] of steps 1..D of every chain t < S. embeds[d - 1] [B, S, h]: the embedding of token
        t + d (step d's input); hidden [B, S, h]: the target's h_t; rotary(x, positions [B, L]) -> (cos, sin)."""
        B, S, _ = hidden.shape
        D, lay = len(embeds), self.layer
        cos, sin = rotary(hidden, chain_positions(S, D, hidden.device).expand(B, -1))
        mask = chain_mask(S, D, hidden.device)
        normed, feature, logits = [], hidden, []
        for d, e in enumerate(embeds, 1):
            x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(feature)], -1))
            normed.append(lay.input_layernorm(x))
            L = d * S          # steps 1..d-1's queries are recomputed and dropped: only their keys matter
            a = lay.self_attn(hidden_states=torch.cat(normed, 1), position_embeddings=(cos[:, :L], sin[:, :L]),
                              attention_mask=mask[..., :L, :L])
            x = x + (a[0] if isinstance(a, tuple) else a)[:, -S:]
            feature = x + lay.mlp(lay.post_attention_layernorm(x))      # step d + 1's feature
            logits.append(self.head(self.head_norm(feature)))
        return logits

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {prefix + "enorm.weight": self.enorm.weight, prefix + "hnorm.weight": self.hnorm.weight,
               prefix + "eh_proj.weight": self.eh_proj.weight, prefix + "shared_head.norm.weight": self.head_norm.weight,
               prefix + "shared_head.head.weight": self.head.weight}
        out.update({prefix + k: v for k, v in self.layer.state_dict().items()})
        return out


def chain_logits(mtp: MTP, model, ids: torch.Tensor, hidden: torch.Tensor, D: int) -> list[torch.Tensor]:
    """MTP.chain over the chains t < S = len - D - 1 of `ids` [B, len] (hidden: `model`'s last hidden states):
    step d reads token t + d and predicts token t + d + 1, the target's prediction at position t + d."""
    S = ids.shape[1] - D - 1
    embeds = [model.model.embed_tokens(ids[:, d:S + d]) for d in range(1, D + 1)]
    return mtp.chain(embeds, hidden[:, :S], model.model.rotary_emb)


def kl_to_target(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) of next-token distributions at temperature 1, summed over the vocabulary and
    averaged over positions."""
    t = F.log_softmax(teacher.float(), -1)
    return (t.exp() * (t - F.log_softmax(student.float(), -1))).sum(-1).mean()


@torch.no_grad()
def greedy_continuations(last_logits, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """prompts [B, P] followed by `new` greedy tokens of last_logits(ids) -> [B, V] (no KV cache: the demo's
    target is small)."""
    ids = prompts
    for _ in range(new):
        ids = torch.cat([ids, last_logits(ids).argmax(-1, keepdim=True)], 1)
    return ids


def acceptance(matches: torch.Tensor, ks=(1, 2, 3, 4)) -> dict:
    """matches [B, n, K]: whether draft i of a step starting at each of n positions is the target's greedy
    token (drafts 1..i-1 being right). Per k: the mean acceptance length (1 + drafts accepted in a row, capped
    at k: the tokens a verification step emits) and the acceptance rate (accepted / drafted)."""
    out = {}
    for k in ks:
        if k <= matches.shape[-1]:
            run = matches[..., :k].long().cumprod(-1).sum(-1).float().mean().item()
            out[f"k{k}"] = {"mean_acceptance_length": round(1 + run, 3), "acceptance_rate": round(run / k, 3)}
    return out


@torch.no_grad()
def draft_on_continuations(draft, ids: torch.Tensor, P: int, K: int = 4) -> dict:
    """The draft model on the target's greedy continuations ids [B, P + G] (prompt P): its top-1 agreement
    with the target's next token over the continuation and the acceptance it would see at k = 1..K."""
    right = draft(input_ids=ids).logits[:, :-1].argmax(-1) == ids[:, 1:]        # [B, L - 1]: at position p
    right = right[:, P - 1:]                                                      # predicting a generated token
    starts = right.shape[1] - K + 1
    matches = torch.stack([right[:, i:i + starts] for i in range(K)], -1)
    return {"top1_agree": round(right.float().mean().item(), 4), **acceptance(matches)}


@torch.no_grad()
def mtp_on_continuations(mtp: MTP, model, ids: torch.Tensor, P: int, D: int) -> dict:
    """The MTP layer's chains on the target's greedy continuations ids [B, P + G]: each step's top-1
    agreement with the continuation (its inputs the continuation's tokens, as after accepted drafts) over
    chains reading generated tokens only, and the acceptance at k = 1..D."""
    hidden = model.model(input_ids=ids).last_hidden_state
    S = ids.shape[1] - D - 1
    steps = chain_logits(mtp, model, ids, hidden, D)
    matches = torch.stack([lg.argmax(-1) == ids[:, d + 1:S + d + 1] for d, lg in enumerate(steps, 1)], -1)
    matches = matches[:, P - 1:]
    return {"top1_agree_by_step": [round(v, 4) for v in matches.float().mean((0, 1)).tolist()],
            **acceptance(matches)}
