"""A sparse MLP (mixture of experts): a router picks experts per token, each a gated MLP, their outputs
weighted by the routing weights; under expert parallelism each rank holds a share of the experts."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(ops.silu_and_mul(F.linear(x, gate_up)), down)


@dataclass
class SoftmaxTopK:
    """Softmax over the router's logits, then the top k (renormalised when `renormalize`): Mixtral,
    Qwen3-MoE. The weights come back in float32."""
    router: torch.Tensor                 # [E, hidden]
    top_k: int
    renormalize: bool

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.router).float(), -1)
        w, idx = torch.topk(probs, self.top_k, -1)
        if self.renormalize:
            w = w / w.sum(-1, keepdim=True)
        return w, idx


@dataclass
class MoE:
    """`route(x)` gives each token's routing weights [N, top_k] (float32) and experts; each expert is a
    SiLU-gated MLP; the output is the weighted sum of the chosen experts', plus the shared experts' output
    where the model has them (DeepSeek). Mixtral and DeepSeek keep the routing weights in float32
    (`float_weights`), Qwen3-MoE casts them to the activations' dtype — as transformers does for each."""
    route: object                        # x [N, hidden] -> (weights [N, top_k] float32, experts [N, top_k])
    gate_up: torch.Tensor                # [E, 2 * inter, hidden]
    down: torch.Tensor                   # [E, hidden, inter]
    float_weights: bool
    experts: range                       # the experts held here (gate_up[j] is expert experts[j])
    ep: object | None = None             # expert parallelism: the DP group that holds the other experts
    shared_gate_up: torch.Tensor | None = None   # the shared experts (one gated MLP), on every rank whole
    shared_down: torch.Tensor | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        # every expert over every token, weighted by its routing weight (0 where not chosen): fixed
        # shapes, so a CUDA graph holds it; the experts are added in index order, as transformers does.
        # Under expert parallelism the ranks' tokens are gathered, each rank adds its experts' share, and
        # a reduce-scatter returns each rank the sum for its own tokens; the shared experts then run on
        # the rank's own tokens only, so they are added once.
        x = h if self.ep is None else self.ep.ep_all_gather(h)
        w, idx = self.route(x)
        if not self.float_weights:
            w = w.to(x.dtype)
        out = torch.zeros_like(x)
        for j, e in enumerate(self.experts):
            we = (w * (idx == e)).sum(-1, keepdim=True)
            out += (self.expert(x, j) * we).to(x.dtype)
        if self.ep is not None:
            out = self.ep.ep_reduce_scatter(out)
        if self.shared_gate_up is not None:
            out = out + gated_mlp(h, self.shared_gate_up, self.shared_down)
        return out

    def expert(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """The j-th held expert's MLP over x."""
        return gated_mlp(x, self.gate_up[j], self.down[j])

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def load_experts(get, block: str, num_experts: int, names: tuple[str, str, str], mine: range):
    """The held experts' gate_up [E', 2I, H] and down [E', H, I], read as stored per expert
    ({block}experts.{e}.{gate}/{up}/{down}.weight) or fused as transformers 5 holds them
    ({block}experts.gate_up_proj [E, 2I, H], {block}experts.down_proj)."""
    fused = get(block + "experts.gate_up_proj", False)
    if fused is not None:
        return (fused[mine.start:mine.stop].contiguous(),
                get(block + "experts.down_proj")[mine.start:mine.stop].contiguous())
    g, u, d = names
    gate_up = torch.stack([torch.cat([get(f"{block}experts.{e}.{g}.weight"), get(f"{block}experts.{e}.{u}.weight")])
                           for e in mine]).contiguous()
    down = torch.stack([get(f"{block}experts.{e}.{d}.weight") for e in mine]).contiguous()
    return gate_up, down
