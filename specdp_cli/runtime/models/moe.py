"""A sparse MLP (mixture of experts): a router picks experts per token, each a gated MLP, their outputs
weighted by the routing weights; under expert parallelism each rank holds a share of the experts, under tensor
parallelism each process a share of every held expert's intermediate columns (models/tensor_parallel.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops
from .quant import FP8Weight, cat_fp8


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return ops.linear(ops.silu_and_mul(ops.linear(x, gate_up)), down)


@dataclass
class SoftmaxTopK:
    """Softmax over the router's logits, then the top k (renormalised when `renormalize`): Mixtral,
    Qwen3-MoE. The weights come back in float32."""
    router: torch.Tensor                 # [E, hidden]
    top_k: int
    renormalize: bool

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            from ..moe_kernels import softmax_topk
            return softmax_topk(router_logits(x, self.router), self.top_k, self.renormalize)
        logits = F.linear(x, self.router)
        probs = torch.softmax(logits.float(), -1)
        w, idx = torch.topk(probs, self.top_k, -1)
        if self.renormalize:
            w = w / w.sum(-1, keepdim=True)
        return w, idx


def router_logits(x: torch.Tensor, router: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear(x, router) (in `dtype`: default x's) on CUDA; for a few tokens moe_kernels' matrix-vector kernel."""
    from ..moe_kernels import ROUTER_MAX_TOKENS, router_logits as gemv
    if x.shape[0] <= ROUTER_MAX_TOKENS:
        return gemv(x, router, dtype)
    return F.linear(x if dtype is None else x.to(dtype), router)


@dataclass
class RoutedPairs:
    """The routed experts' output before each token's sum (CUDA): y [N * top_k, hidden], each token-expert pair's
    weighted output (pair p is token p // top_k), experts [N, top_k] indices into the E held experts (outside:
    held elsewhere, skipped). `sum` gives the MoE's output; `add_to` sums into the residual stream and norms it in
    one kernel (the decoder's join)."""
    y: torch.Tensor
    experts: torch.Tensor
    E: int

    def sum(self) -> torch.Tensor:
        from ..moe_kernels import sum_pairs
        return sum_pairs(self.y, self.experts, self.E)

    def add_to(self, residual: torch.Tensor, norm: torch.Tensor | None, eps: float, quantize: bool = False):
        """residual += the sums (in place); returns the new residual's RMSNorm (`norm` None: the residual), the
        numbers of ops.rms_norm(self.sum(), norm, eps, residual, quantize): `quantize` (where
        ops.fused_quant_wanted for the FP8 linear that alone reads the norm) quantized for it."""
        from ..moe_kernels import sum_add_rms_norm
        out = sum_add_rms_norm(self.y, self.experts, self.E, residual, norm, eps, quantize)
        return residual if out is None else out


@dataclass
class MoE:
    """`route(x)` gives each token's routing weights [N, top_k] (float32) and experts; each expert is a
    SiLU-gated MLP; the output is the weighted sum of the chosen experts', plus the shared experts' output
    where the model has them (DeepSeek). Mixtral and DeepSeek keep the routing weights in float32
    (`float_weights`), Qwen3-MoE casts them to the activations' dtype — as transformers does for each.

    Only the chosen experts run, each once over the tokens that chose it: on CUDA the grouped kernels of
    `moe_kernels.py` (fixed sizes: a CUDA graph holds them), elsewhere `routed_reference`."""
    route: object                        # x [N, hidden] -> (weights [N, top_k] float32, experts [N, top_k])
    gate_up: torch.Tensor                # [E, 2 * inter, hidden]
    down: torch.Tensor                   # [E, hidden, inter]
    float_weights: bool
    experts: range                       # the experts held here (gate_up[j] is expert experts[j])
    ep: object | None = None             # expert parallelism: the DP group that holds the other experts
    shared_gate_up: torch.Tensor | None = None   # the shared experts (one gated MLP), on every rank (TP: its columns)
    shared_down: torch.Tensor | None = None
    tp: object | None = None             # tensor parallelism: the TP group over which each expert's columns split

    def takes_quantized(self, h: torch.Tensor) -> bool:
        """Whether the norm before this MoE hands it h quantized as well as plain (ops.rms_norm's "both"): FP8
        routed experts on CUDA whose kernels read x quantized at h's tokens (moe_kernels.takes_quantized), neither
        expert nor tensor parallelism (their gathers and shares see h only)."""
        top_k = getattr(self.route, "top_k", None)
        if not h.is_cuda or isinstance(self.gate_up, torch.Tensor) or top_k is None or self.ep is not None \
                or self.tp is not None:
            return False
        from ..moe_kernels import takes_quantized
        E, I = self.gate_up.weight.shape[0], self.gate_up.weight.shape[1] // 2
        return takes_quantized(h.shape[0] * top_k, E, I, h.shape[1], h.dtype)

    def __call__(self, h, unsummed: bool = False) -> torch.Tensor | RoutedPairs:
        # Under expert parallelism the ranks' tokens are gathered, each rank adds its experts' share, and a
        # reduce-scatter returns each rank the sum for its own tokens; the shared experts then run on the
        # rank's own tokens only, so they are added once. Under tensor parallelism (with or without experts over
        # the DP ranks: then the gather and reduce-scatter run among the processes of this TP rank) that sum is
        # the share of this process's columns of each expert (and of the shared experts'), all-reduced over the TP
        # group; the router is whole on every process, so all of them route every token alike.
        # `unsummed`: on CUDA, where nothing else adds to the routed experts' sum (none of the above), return their
        # RoutedPairs for the decoder to sum in the kernel of its residual add and next norm.
        # h may come quantized too (`takes_quantized`: an FP8Activation with the values plain): the router and the
        # shared experts read them plain, the routed experts' gate/up kernel quantized.
        x_q = None
        if getattr(h, "plain", None) is not None:
            h, x_q = h.plain, h
        x = h if self.ep is None else self.ep.ep_all_gather(h)
        w, idx = self.route(x)
        # index into the held experts; outside [0, E'): held elsewhere
        held = idx - self.experts.start if self.experts.start else idx
        if x.is_cuda:
            pairs = self.routed_pairs(x, w, held, x_q)
            if unsummed and self.ep is None and self.tp is None and self.shared_gate_up is None:
                return pairs
            out = pairs.sum()
        else:
            out = self.routed_reference(x, w if self.float_weights else w.to(x.dtype), held)
        if self.ep is not None:
            out = self.ep.ep_reduce_scatter(out)
        if self.shared_gate_up is not None:      # under TP: this process's columns' share, summed by the one all-reduce
            out = out + gated_mlp(h, self.shared_gate_up, self.shared_down)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return out

    def routed_pairs(self, x: torch.Tensor, w: torch.Tensor, held: torch.Tensor, x_q=None) -> RoutedPairs:
        """The grouped kernels (CUDA), each pair's output unsummed; w float32, rounded to x's dtype inside unless
        `float_weights`; x_q: x quantized as well (`takes_quantized`)."""
        from ..moe_kernels import routed_pairs
        return RoutedPairs(routed_pairs(x, w, held, self.gate_up, self.down, x_q=x_q, **self.kernel_args()), held,
                           self.gate_up.shape[0])

    def kernel_args(self) -> dict:
        """routed_pairs' keyword arguments of this MoE's experts."""
        return dict(round_weights=not self.float_weights)

    def routed_kernel(self, x: torch.Tensor, w: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """The grouped kernels' sum (CUDA)."""
        return self.routed_pairs(x, w, held).sum()

    def routed_reference(self, x: torch.Tensor, w: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """Each held expert that some token chose, once over those tokens, added in expert order as
        transformers adds them (exact in float32; reads host-side counts, so not for CUDA graphs)."""
        E, K = self.gate_up.shape[0], held.shape[1]
        flat = held.reshape(-1)
        mine = (flat >= 0) & (flat < E)
        order = torch.argsort(torch.where(mine, flat, E), stable=True)      # pairs grouped by expert
        counts = torch.bincount(flat[mine], minlength=E).tolist()
        wflat = w.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for j, n in enumerate(counts):
            if n:
                pairs = order[start:start + n]
                tok = pairs // K
                out.index_add_(0, tok, (self.expert(x[tok], j) * wflat[pairs, None]).to(x.dtype))
                start += n
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
        return _held(fused, mine), _held(get(block + "experts.down_proj"), mine)
    g, u, d = names
    gate_up = _stack([_cat([get(f"{block}experts.{e}.{g}.weight"), get(f"{block}experts.{e}.{u}.weight")])
                      for e in mine])
    down = _stack([get(f"{block}experts.{e}.{d}.weight") for e in mine])
    return gate_up, down


# routed experts' weights are tensors or, kept FP8 for the grouped kernels, FP8Weights
def _held(w, mine: range):
    if isinstance(w, FP8Weight):
        return FP8Weight(w.weight[mine.start:mine.stop].contiguous(), w.scale[mine.start:mine.stop].contiguous(),
                         w.rows, w.dtype)
    return w[mine.start:mine.stop].contiguous()


def _cat(ws: list):
    return cat_fp8(ws) if isinstance(ws[0], FP8Weight) else torch.cat(ws)


def _stack(ws: list):
    return cat_fp8(ws, stack=True) if isinstance(ws[0], FP8Weight) else torch.stack(ws).contiguous()
