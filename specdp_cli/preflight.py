"""Preflight: check a configuration and its model directories (no weights loaded) and report on the
Plan `plan.resolve` derives from it (settings left on `auto`, the skip / dummy policy, D, memory).

The result is a `Report`: one row per check (ok / warn / error) plus the Plan, which the checks read
and never change; the launcher and the ranks read it instead of re-deriving anything. Definitions (M,
k, D, the no-draft window, lockstep) follow the contract in DESIGN.md.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from .config import Config
from .methods import METHODS
from .modeldir import (ModelDir, ModelDirError, UnsupportedModel, architecture_of, aux_layer_ids, eagle_layout,
                       expert_split, family_of, has_tokenizer_files, load_tokenizer)
from .plan import Plan, async_method, resolve

STATUS_ORDER = {"ok": 0, "warn": 1, "error": 2}


@dataclass
class Check:
    name: str
    status: str
    detail: str


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    plan: Plan = field(default_factory=Plan)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    kv_cache: Optional[dict] = None          # block_size, num_blocks, tokens, sequences (see _memory)

    @property
    def ok(self) -> bool:
        return not self.errors

    def add(self, name: str, findings: list[tuple[str, str]]) -> None:
        """Record a check from its findings [(status, sentence)]; the row shows the worst status."""
        status = max((s for s, _ in findings), key=STATUS_ORDER.__getitem__, default="ok")
        self.checks.append(Check(name, status, " ".join(msg for _, msg in findings)))
        for s, msg in findings:
            if s == "error":
                self.errors.append(f"{name}: {msg}")
            elif s == "warn":
                self.warnings.append(f"{name}: {msg}")

    def to_json(self) -> dict:
        p = self.plan
        return {
            "ok": self.ok,
            "policy": p.policy,
            "dp_sync": p.dp_sync,
            "async_scheduling": p.async_scheduling,
            "drafter_max_model_len": p.drafter_max_model_len,
            "no_draft_window": p.no_draft_window,
            "speculation": p.speculation,
            "kv_cache": self.kv_cache,
            "weights_per_token": (p.memory or {}).get("weights_per_token"),
            "layout": {"data_parallel_size": p.data_parallel_size, "tensor_parallel_size": p.tensor_parallel_size,
                       "draft_tensor_parallel_size": p.draft_tensor_parallel_size or None,
                       "processes": p.data_parallel_size * p.tensor_parallel_size,
                       "processes_per_machine": p.ranks_per_machine * p.tensor_parallel_size,
                       "gpus_per_machine": p.gpus if p.device == "cuda" else None,
                       "weight_bytes_per_gpu": (p.memory or {}).get("weight_bytes"),
                       "kv_bytes_per_token_per_gpu": (p.memory or {}).get("kv_bytes_per_token")},
            "quantization": (p.memory or {}).get("quantization"),
            "checks": [asdict(c) for c in self.checks],
            "errors": list(self.errors),
            "warnings": list(self.warnings),
        }


def schema_failure(problems: list[str], check: str = "schema") -> Report:
    """A report of a configuration that never reached the checks: its problems under `check` ("schema": the file's
    values; "config": the file itself — missing, unreadable)."""
    r = Report(plan=Plan(dtype="", backend="", device=""))
    r.add(check, [("error", p) for p in problems])
    return r


def run_preflight(cfg: Config) -> Report:
    report = Report()
    spec = cfg.speculative
    k = spec.num_speculative_tokens
    meth = METHODS[spec.method]
    uses_drafter_model = meth.loads is not None

    # 1. files ---------------------------------------------------------------------------------
    findings: list[tuple[str, str]] = []
    target = drafter = None
    tokenizer = drafter_tokenizer = None
    try:
        target = ModelDir.open(cfg.model, "target model")
        if not target.weight_files:
            findings.append(("error", f"target directory {target.path} has no weights (*.safetensors or *.bin)."))
        else:
            findings.append(_supported("target", target))
    except ModelDirError as e:
        findings.append(("error", f"{e}."))
    if uses_drafter_model:
        try:
            drafter = ModelDir.open(spec.model or "", f"{meth.loads} (speculative.model)")
            if not drafter.weight_files:
                findings.append(("error", f"{meth.loads} directory {drafter.path} has no weights."))
            elif meth.separate_lm:
                findings.append(_supported("drafter", drafter))
            else:
                findings.extend(_eagle_head(target, drafter, spec.method))
        except ModelDirError as e:
            hint = f" (method {spec.method} needs it; or use method: ngram)" if not spec.model else ""
            findings.append(("error", f"{e}{hint}."))
    elif spec.model:
        findings.append(("warn", f"speculative.model is set but method is {spec.method}: it is not used"
                                 + (" (the drafter is the target's own MTP layer)." if meth.in_target else ".")))
    if meth.in_target and target is not None and target.weight_files:
        findings.extend(_mtp_layer(target))
    try:
        tokenizer = load_tokenizer(cfg.tokenizer_path)
        findings.append(("ok", f"tokenizer loads ({len(tokenizer)} tokens)."))
    except ModelDirError as e:
        findings.append(("error", f"{e}."))
    if drafter is not None and meth.separate_lm and has_tokenizer_files(drafter.path) and cfg.tokenizer is None:
        try:
            drafter_tokenizer = load_tokenizer(drafter.path)
        except ModelDirError as e:
            findings.append(("error", f"drafter {e}."))
    if cfg.chat_template and "{" not in cfg.chat_template and not os.path.isfile(cfg.chat_template):
        findings.append(("error", f"chat_template file not found: {cfg.chat_template}."))
    report.add("files", findings)
    plan = report.plan = resolve(cfg, (target, drafter))

    # 2. lengths -------------------------------------------------------------------------------
    if target is not None:
        report.add("lengths", _lengths(cfg, plan, target, drafter))

    # 3. vocab -----------------------------------------------------------------------------------
    if meth.separate_lm and target is not None and drafter is not None:
        report.add("vocab", _vocab(target, drafter, tokenizer, drafter_tokenizer))

    # 4. parallel --------------------------------------------------------------------------------
    report.add("parallel", _parallel(cfg, plan, target, drafter))

    # 5. policy ----------------------------------------------------------------------------------
    report.add("policy", _policy(cfg, plan))

    report.add("speculation length", _speculation(cfg, plan))

    # 6. memory ----------------------------------------------------------------------------------
    if plan.memory is not None:
        report.add("memory", _memory(cfg, plan, report))

    # 7. scheduler -------------------------------------------------------------------------------
    s = cfg.scheduler
    per_seq = (k + 1) if meth.drafts else 1
    if s.max_num_batched_tokens < s.max_num_seqs * per_seq:
        budget = ("warn", f"max_num_batched_tokens ({s.max_num_batched_tokens}) < max_num_seqs x (k + 1) = "
                          f"{s.max_num_seqs} x {per_seq}: a full batch's verification step exceeds the token budget; "
                          f"new prompts wait until sequences finish.")
    else:
        budget = ("ok", f"max_num_seqs {s.max_num_seqs}, max_num_batched_tokens {s.max_num_batched_tokens} (prompts "
                        f"longer than that are prefilled in chunks).")
    report.add("scheduler", [budget, _async_scheduling(cfg, plan)])
    return report


def _async_scheduling(cfg: Config, plan: Plan) -> tuple[str, str]:
    asked, method = cfg.scheduler.async_scheduling, cfg.speculative.method
    if asked and not async_method(method):
        return ("error", f"scheduler.async_scheduling: true does not run with speculative.method {method}: it drafts "
                         f"from the sequence's tokens on the host, which reads them before it plans the next step. "
                         f"Set async_scheduling to false or leave it unset.")
    if asked and cfg.parallel.tensor_parallel_size > 1:
        return ("error", "scheduler.async_scheduling: true does not run with tensor_parallel_size > 1 yet; set it to "
                         "false or leave it unset.")
    if plan.async_scheduling:
        return ("ok", "async scheduling: the host plans and stages each step while the device runs the one before "
                      "(a step's tokens are read one step later).")
    why = ("off (scheduler.async_scheduling: false)" if asked is False else
           f"off: method {method} drafts from the sequence's tokens on the host" if not async_method(method) else
           "off under tensor parallelism (not yet)" if cfg.parallel.tensor_parallel_size > 1 else
           "off on CPU (there the host runs the forwards itself; set scheduler.async_scheduling: true to use it)")
    return ("ok", f"async scheduling {why}.")


def _eagle_head(target: ModelDir | None, head: ModelDir, method: str) -> list[tuple[str, str]]:
    """An EAGLE head directory: its layout (from the tensor names) is the method's, and it fits the target."""
    names = head.tensor_headers
    if not names:
        return [("error", f"EAGLE head {head.path}: no safetensors weights to read its layout from.")]
    layout = eagle_layout(names)
    if layout is None:
        return [("error", f"{head.path} is not an EAGLE head: an EAGLE-1 head holds fc.weight [h, 2h], fc.bias and "
                          f"one decoder layer layers.0.* (without input_layernorm); an EAGLE-3 head midlayer.*, "
                          f"fc.weight [h, 3h], norm, lm_head and d2t.")]
    if layout != method:
        kind = "EAGLE-3 (midlayer.*, d2t)" if layout == "eagle3" else "EAGLE-1 (fc, layers.0.*)"
        return [("error", f"{head.path} has the {kind} layout: use speculative.method: {layout}.")]
    h = head.get("hidden_size")
    th = target.get("hidden_size") if target is not None else None
    out = []
    if th and h and th != h:
        out.append(("error", f"EAGLE head {head.path} has hidden_size {h} but the target's is {th}: the head reads "
                             f"the target's hidden states, so it must be trained for this target."))
    fc = names["fc.weight"][1]
    if layout == "eagle":
        if len(fc) != 2 or fc[1] != 2 * fc[0] or (h and fc[0] != h):
            out.append(("error", f"EAGLE head {head.path}: fc.weight has shape {fc}, expected [hidden, 2 x hidden] "
                                 f"with hidden = {h}."))
        detail = "EAGLE-1 layout"
    else:
        n = target.num_layers if target is not None else 0
        aux = aux_layer_ids(head.config, n)
        if target is not None and any(not 0 <= i <= n for i in aux):
            out.append(("error", f"EAGLE-3 head {head.path} reads target layers {list(aux)} but the target has {n} "
                                 f"(0..{n}): set eagle_aux_hidden_state_layer_ids in its config.json."))
        if h and fc != [h, len(aux) * (th or h)]:
            out.append(("error", f"EAGLE-3 head {head.path}: fc.weight has shape {fc}, expected "
                                 f"[{h}, {len(aux)} x {th or h}] ({len(aux)} target layers)."))
        lm = names.get("lm_head.weight", (None, []))[1]
        d2t = names.get("d2t", (None, []))[1]
        if not lm or (d2t and d2t[0] != lm[0]):
            out.append(("error", f"EAGLE-3 head {head.path}: lm_head.weight {lm or 'missing'} and d2t {d2t or '-'} "
                                 f"do not describe one draft vocabulary."))
        detail = (f"EAGLE-3 layout, target layers {list(aux)}"
                  + ("" if "eagle_aux_hidden_state_layer_ids" in head.config else " (vLLM's default)")
                  + f", draft vocabulary {lm[0] if lm else '?'}")
    if not out:
        uses = ("the target's embedding and LM head" if layout == "eagle" else
                "the target's embedding" if "embed_tokens.weight" not in names else "its own embedding")
        out.append(("ok", f"EAGLE head {head.path} ({detail}, {head.stored_dtype} tensors; it uses {uses})."))
    return out


def _mtp_layer(target: ModelDir) -> list[tuple[str, str]]:
    """method mtp: the target's config counts multi-token-prediction layers and its weights hold the first
    (DeepSeek-V3's layout: model.layers.{num_hidden_layers}.{enorm, hnorm, eh_proj, shared_head.*} and a
    decoder layer)."""
    N, n, names = target.num_layers, target.mtp_layers, target.tensor_headers
    other = "use method ngram or draft_model"
    if not n:
        return [("error", f"method mtp drafts with the target's multi-token-prediction layer, but {target.path}'s "
                          f"config.json sets no num_nextn_predict_layers: {other}.")]
    prefix = "model." if f"model.layers.{N}.eh_proj.weight" in names else ""
    p = f"{prefix}layers.{N}."
    if p + "eh_proj.weight" not in names:
        return [("error", f"{target.path}: config.json says num_nextn_predict_layers {n}, but the weights hold no "
                          f"model.layers.{N}.eh_proj.weight (conversions for transformers often drop the MTP "
                          f"layer): {other}, or a checkpoint that keeps it.")]
    h, eh = target.get("hidden_size"), names[p + "eh_proj.weight"][1]
    if h and eh != [h, 2 * h]:
        return [("error", f"{target.path}: {p}eh_proj.weight has shape {eh}, expected [{h}, {2 * h}].")]
    embed = "its own embedding" if p + "embed_tokens.weight" in names else "the target's embedding"
    head = "its shared_head.head" if p + "shared_head.head.weight" in names else "the target's LM head"
    first = f"; the first of {n} drafts all k tokens" if n > 1 else ""
    return [("ok", f"MTP layer model.layers.{N}.* in the target's checkpoint ({embed}, {head}{first}).")]


def _supported(role: str, md: ModelDir) -> tuple[str, str]:
    try:
        arch = architecture_of(md.config)
        q = md.quantization
        return "ok", f"{role} {md.path} ({arch}{'; ' + q.describe() if q else ''})."
    except UnsupportedModel as e:
        return "error", f"{role} {md.path}: {e}."


def _parallel(cfg: Config, plan: Plan, target: ModelDir | None, drafter: ModelDir | None = None) -> list[tuple[str, str]]:
    par = cfg.parallel
    out: list[tuple[str, str]] = []
    dp, machines, tp = par.data_parallel_size, par.num_machines, par.tensor_parallel_size
    if dp < 1:
        out.append(("error", f"data_parallel_size must be >= 1 (got {dp})."))
    elif dp % machines:
        out.append(("error", f"data_parallel_size ({dp}) must be a multiple of num_machines ({machines}): "
                             f"every machine runs the same number of ranks."))
    if tp < 1:
        out.append(("error", f"tensor_parallel_size must be >= 1 (got {tp})."))
        tp = 1
    per_machine = plan.ranks_per_machine * tp
    gpus = plan.gpus
    if plan.device == "cuda":
        if gpus == 0:
            out.append(("error", "device is cuda but no GPU is visible (check CUDA_VISIBLE_DEVICES, or set device: cpu)."))
        elif tp > 1 and gpus % tp:
            out.append(("error", f"tensor_parallel_size {tp} does not divide the {gpus} GPUs of a machine: a DP rank's "
                                 f"TP group takes {tp} GPUs of one machine; choose a divisor of {gpus}."))
        elif per_machine > gpus:
            what = "ranks" if tp == 1 else f"processes ({plan.ranks_per_machine} DP ranks x tensor_parallel_size {tp})"
            out.append(("error", f"{per_machine} {what} per machine need {per_machine} GPUs, but {gpus} are visible: "
                                 f"lower data_parallel_size{' or tensor_parallel_size' if tp > 1 else ''} or raise "
                                 f"num_machines."))
    if plan.backend == "nccl" and plan.device != "cuda":
        out.append(("error", "backend nccl needs device cuda; use backend gloo (or auto) on CPU."))
    moe = bool(target and target.is_moe)
    if par.dp_sync == "auto":
        why = ("a mixture-of-experts model: ranks step in lockstep" if moe
               else "a dense model: ranks step independently")
    else:
        why = "as configured"
        if moe and par.dp_sync == "never":
            out.append(("warn", "dp_sync is never on a mixture-of-experts model: expert-parallel engines need "
                                "lockstep (dp_sync: always); fine only while experts are not sharded across ranks."))
    if par.enable_expert_parallel:
        out += _expert_parallel(cfg, target, moe)
    if tp > 1:
        out += _tensor_parallel(cfg, target, tp)
    out += _draft_tensor_parallel(cfg, plan, drafter, tp)
    layout = (f"{dp} rank(s)" if tp == 1 else
              f"layout {dp} x {tp}: {dp} DP rank(s) of {tp} tensor-parallel processes ({dp * tp} processes)")
    out.insert(0, ("ok", f"{layout} on {machines} machine(s), {per_machine} per machine, "
                         f"device {plan.device}, backend {plan.backend}, dtype {plan.dtype}; "
                         f"dp_sync {plan.dp_sync} ({why})."))
    return out


TP_METHODS = ("none", "ngram", "draft_model", "eagle", "eagle3", "mtp")


def _tensor_parallel(cfg: Config, target: ModelDir | None, tp: int) -> list[tuple[str, str]]:
    """parallel.tensor_parallel_size > 1: what this step of tensor parallelism runs (dense decoders split by heads
    and MLP columns, mixture-of-experts decoders by each expert's columns too, latent attention by heads, block-FP8
    weights with their block scales where every split falls on a block boundary, a replicated EAGLE head, or
    DeepSeek-V3's MTP layer split as its target; a draft model's layout: _draft_tensor_parallel) and the target's
    shape allows."""
    from .runtime.models.registry import families
    from .runtime.models.tensor_parallel import (expert_intermediate, fp8_refusal, is_latent, refusal,
                                                 shared_intermediate)

    out: list[tuple[str, str]] = []
    method = cfg.speculative.method
    if method not in TP_METHODS:
        out.append(("error", f"tensor_parallel_size {tp} with speculative.method {method} is not supported yet "
                             f"(supported: {', '.join(TP_METHODS)}: a draft model replicated on every process or split "
                             f"as the target, an EAGLE head replicated, DeepSeek-V3's MTP layer split as its target): set "
                             f"tensor_parallel_size: 1 or another method."))
    if target is None:
        return out
    supported = sorted(a for a, f in families().items() if f.tensor_parallel)
    try:
        fam = family_of(target.config)
    except UnsupportedModel:
        return out                           # the files check says why
    if not fam.tensor_parallel:
        out.append(("error", f"tensor_parallel_size {tp}: the target's {fam.architecture} cannot be split over a "
                             f"TP group yet (supported: {', '.join(supported)}): set tensor_parallel_size: 1."))
        return out
    why = refusal(target.config, tp) or fp8_refusal(target.tensor_headers, target.config, tp)
    if why:
        out.append(("error", why))
        return out
    H = int(target.get("num_attention_heads"))
    KV = int(target.get("num_key_value_heads") or H)
    kv = (f"its {KV} KV heads {KV // tp} per process" if tp <= KV else
          f"its {KV} KV head(s) replicated: each process holds the one its query heads read ({tp // KV} copies each)")
    if is_latent(target.config):
        kv = ("latent attention by heads (q_b_proj / q_proj, kv_b_proj, o_proj; the latents' projections "
              "replicated), each process caching its heads' keys and values")
    notes = (" The MTP layer is split as the target." if METHODS[method].in_target else
             " The EAGLE head is replicated on every process (it reads the target's split embedding and LM head "
             "through the target's collectives; its own are whole)." if METHODS[method].after_verify else
             "")                                  # a draft model's layout: _draft_tensor_parallel
    if target.quantization is not None:
        b = target.quantization.block
        notes += (f" The FP8 weights are split with their {b[0]}x{b[1]} block scales (every split on a block "
                  f"boundary: each process holds whole blocks).")
    elif cfg.quantization == "fp8":
        notes += (" With quantization: fp8 each process quantizes its slice of a linear layer as it loads "
                  "(128x128 blocks of the slice: the unsplit model's blocks where the splits fall on multiples of 128).")
    field, inter = expert_intermediate(target.config)
    experts = (f"; each routed expert's {inter} columns ({field}) split {inter // tp} per process, the router "
               f"replicated" if inter else "")
    shared = shared_intermediate(target.config)
    experts += f"; the shared experts' {shared} columns split {shared // tp} per process" if shared else ""
    V = int(target.get("vocab_size") or 0)
    vocab = (f"embedding and LM head split by vocabulary ({V} rows, {-(-V // tp)} per process)" if V else
             "embedding and LM head replicated")
    out.append(("ok", f"tensor parallel: the target's {H} query heads split {H // tp} per process, {kv}; MLP columns "
                      f"split{experts}; {vocab}; every decision is made by each TP group's first "
                      f"process and sent to the others each step.{notes}"))
    return out


def _draft_tensor_parallel(cfg: Config, plan: Plan, drafter: ModelDir | None, tp: int) -> list[tuple[str, str]]:
    """speculative.draft_tensor_parallel_size (vLLM's name): 1, the drafter replicated on every process of a DP
    rank's TP group, or tensor_parallel_size, split over it as a target of its family is. A draft model may be
    either; an EAGLE head is replicated (1); the MTP layer is split as its target (tensor_parallel_size); n-gram
    and none have no drafter model. With tp > 1 the drafter's layout is reported."""
    from .runtime.models.registry import families
    from .runtime.models.tensor_parallel import Shard, fp8_refusal, refusal

    spec, meth = cfg.speculative, METHODS[cfg.speculative.method]
    key, given, dtp = "speculative.draft_tensor_parallel_size", spec.draft_tensor_parallel_size, plan.draft_tensor_parallel_size
    if given is not None and not meth.forward:
        return [("error", f"{key} is set but method {spec.method} has no drafter model to replicate or split: remove "
                          f"it.")]
    allowed = "1 (the drafter replicated on every process)" + (f" or tensor_parallel_size ({tp}: split over the TP "
                                                                f"group as the target)" if tp > 1 else "")
    if given is not None and given not in (1, tp):
        return [("error", f"{key} {given}: the allowed values are {allowed}.")]
    if meth.after_verify and not meth.in_target and dtp > 1:
        return [("error", f"{key} {dtp} with method {spec.method}: the EAGLE head is replicated on every process "
                          f"(one decoder layer; it reads the target's split embedding and LM head through the target's "
                          f"collectives): set {key}: 1, or leave it unset.")]
    if meth.in_target and tp > 1 and dtp != tp:
        return [("error", f"{key} {dtp} with method mtp: the MTP layer lives in the target's checkpoint and is split "
                          f"over the TP group as the target is: set {key}: {tp} (tensor_parallel_size), or leave it "
                          f"unset.")]
    if tp == 1 or not meth.separate_lm:
        return []
    if dtp == 1:
        return [("ok", "The draft model is replicated on every process of a TP group (each runs it whole over the "
                       f"same rows; {key}: {tp} splits it as the target).")]
    if drafter is None:
        return []
    instead = f"set {key}: 1 (the drafter replicated on every process)"
    try:
        fam = family_of(drafter.config)
    except UnsupportedModel:
        return []                            # the files check says why
    if not fam.tensor_parallel:
        supported = ", ".join(sorted(a for a, f in families().items() if f.tensor_parallel))
        return [("error", f"{key} {dtp}: the drafter's {fam.architecture} cannot be split over a TP group yet "
                          f"(supported: {supported}): {instead}.")]
    why = (refusal(drafter.config, dtp, key, "drafter", instead)
           or fp8_refusal(drafter.tensor_headers, drafter.config, dtp, key, instead))
    V = int(drafter.get("vocab_size") or 0)
    rows = next((shape[0] for name, (_, shape) in drafter.tensor_headers.items()
                 if shape and Shard.is_vocab(name) and shape[0] != V), None) if V else None
    if why is None and rows is not None:
        why = (f"{key} {dtp}: the drafter's embedding or LM head has {rows} rows but its config.json's vocab_size is "
               f"{V}, and a split drafter is split by vocab_size: {instead}.")
    if why:
        return [("error", why)]
    H, KV = int(drafter.get("num_attention_heads")), int(drafter.get("num_key_value_heads") or drafter.get("num_attention_heads"))
    kv = (f"its {KV} KV heads {KV // dtp} per process" if dtp <= KV else
          f"its {KV} KV head(s) replicated ({dtp // KV} copies each)")
    return [("ok", f"The draft model is split over the TP group as the target ({key} {dtp}): its {H} query heads "
                   f"{H // dtp} per process, {kv} (its KV cache per process shrinks with them), MLP columns split, "
                   f"embedding and LM head by vocabulary ({V} rows, {-(-V // dtp)} per process); its forwards all-reduce "
                   f"over the TP group." + (" speculative.quantization: fp8 quantizes each process's slice as it loads."
                                            if spec.quantization else ""))]


def _expert_parallel(cfg: Config, target: ModelDir | None, moe: bool) -> list[tuple[str, str]]:
    """parallel.enable_expert_parallel: every MoE layer's forward exchanges tokens between the ranks, so
    they must step in lockstep (and pad idle ranks' drafter forwards: see the policy check)."""
    dp = cfg.parallel.data_parallel_size
    if target is None:
        return []
    if not moe:
        return [("error", f"enable_expert_parallel needs a mixture-of-experts target; {target.path} is dense: "
                          f"remove it (each rank holds the whole model).")]
    if cfg.parallel.dp_sync == "never":
        return [("error", "enable_expert_parallel with dp_sync never would hang: every forward of a mixture-of-experts "
                          "layer gathers the tokens of all ranks and sends each its experts' results, so a rank that "
                          "steps alone waits for the others forever. Set dp_sync: always (or auto).")]
    experts = target.num_experts
    if dp > experts:
        return [("error", f"enable_expert_parallel over {dp} ranks needs at least as many experts ({experts}): lower "
                          f"data_parallel_size or turn expert parallelism off.")]
    split = ", ".join(f"rank {r}: {len(expert_split(experts, dp, r))}" for r in range(dp))
    return [("ok", f"expert parallel: {experts} experts per layer over {dp} ranks ({split}); ranks step in lockstep.")]


def _lengths(cfg: Config, plan: Plan, target: ModelDir, drafter: ModelDir | None) -> list[tuple[str, str]]:
    spec = cfg.speculative
    k, M = spec.num_speculative_tokens, cfg.max_model_len
    out: list[tuple[str, str]] = []
    mpe = target.max_position_embeddings
    if mpe is not None and M > mpe:
        if target.rope_scaling:
            out.append(("warn", f"max_model_len {M} exceeds the target's max_position_embeddings {mpe}; "
                                f"its rope scaling ({target.rope_scaling.get('rope_type') or target.rope_scaling.get('type')}) "
                                f"is meant to extend it, but quality past {mpe} is the model's own business."))
        else:
            out.append(("error", f"max_model_len {M} exceeds the target's max_position_embeddings {mpe}: "
                                 f"set max_model_len <= {mpe}."))
    if METHODS[spec.method].drafts and k + 1 >= M:
        out.append(("error", f"num_speculative_tokens + 1 = {k + 1} must be below max_model_len {M}."))
    if spec.max_model_len is not None and spec.max_model_len > M:
        out.append(("error", f"speculative.max_model_len {spec.max_model_len} is above max_model_len {M}: "
                             f"it may only lower the drafter's limit."))
    if not METHODS[spec.method].drafts:
        out.insert(0, ("ok", f"M = {M} (no drafter)."))
        return out
    limits = {"max_model_len": M}
    if spec.max_model_len is not None:
        limits["speculative.max_model_len"] = spec.max_model_len
    if drafter is not None and drafter.max_position_embeddings:
        limits["drafter max_position_embeddings"] = drafter.max_position_embeddings
    D = plan.drafter_max_model_len
    which = min(limits, key=limits.get)
    detail = f"M = {M}, k = {k}, D = {D} (from {which})."
    if plan.no_draft_window:
        lo, hi = plan.no_draft_window
        detail += (f" No-draft window [{lo}, {hi}]: a sequence whose length (prompt + generated) reaches {lo} no "
                   f"longer fits the drafter (L + k > D) and gains one token per step from then on;")
        detail += (" the policy below says what its rank does then." if cfg.parallel.data_parallel_size > 1
                   else " nothing else changes.")
    out.insert(0, ("ok", detail))
    if D < M:
        out.append(("warn", f"the drafter's limit D = {D} is below max_model_len {M}: sequences longer than "
                            f"{D - k} tokens decode without speculation."))
    if D < k + 2:
        out.append(("warn", f"D = {D} leaves no room for k = {k} drafts: the drafter never runs."))
    return out


def _vocab(target: ModelDir, drafter: ModelDir, tok, dtok) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if tok is not None and dtok is not None:
        if tok.get_vocab() != dtok.get_vocab():
            a, b = tok.get_vocab(), dtok.get_vocab()
            diff = len(set(a.items()) ^ set(b.items()))
            return [("error", f"the drafter's tokenizer differs from the target's ({len(a)} vs {len(b)} tokens, "
                              f"{diff} entries differ): draft tokens would mean different text. Use a drafter "
                              f"trained with the target's tokenizer, or method: ngram.")]
        specials = lambda t: (t.eos_token_id, t.bos_token_id, t.pad_token_id, sorted(t.all_special_tokens))  # noqa: E731
        if specials(tok) != specials(dtok):
            return [("error", "the drafter's special tokens (eos/bos/pad) differ from the target's: "
                              "use a drafter that shares the target's tokenizer.")]
        out.append(("ok", f"drafter and target share one tokenizer ({len(tok)} tokens)."))
    else:
        out.append(("ok", "the drafter directory has no tokenizer of its own; it uses the target's."))
    tv, dv = target.vocab_size, drafter.vocab_size
    if tv and dv and tv != dv:
        out.append(("warn", f"embedding tables differ in size (target {tv}, drafter {dv}) over one tokenizer "
                            f"(padded vocabularies); only the shared ids are drafted."))
    if tok is not None and tv and len(tok) > tv:
        out.append(("error", f"the tokenizer has {len(tok)} tokens but the target's embedding has {tv} rows."))
    return out


def _policy(cfg: Config, plan: Plan) -> list[tuple[str, str]]:
    spec = cfg.speculative
    if not METHODS[spec.method].drafts:
        return [("ok", "method none: no drafter, no policy.")]
    dp = cfg.parallel.data_parallel_size
    drafter_forward = METHODS[spec.method].forward
    need_dummy = dp > 1 and plan.dp_sync == "always" and drafter_forward
    if need_dummy and plan.policy == "skip":
        return [("error", f"policy skip with dp_sync always and {dp} ranks would hang: a rank with nothing to draft "
                          f"would run no drafter forward while the others run {spec.num_speculative_tokens}, so ranks "
                          f"issue different collective sequences and wait for each other forever (vLLM PR #40589). "
                          f"Use policy: dummy (or auto), or dp_sync: never.")]
    if need_dummy:
        why = (f"{dp} ranks in lockstep with a model drafter: a rank with nothing to draft runs the drafter's "
               f"{spec.num_speculative_tokens} forwards over a padding batch, so every rank issues the same collectives.")
    elif plan.policy == "dummy":
        why = "as configured; not required here (no DP collective in drafter forwards), so dummy steps only cost time."
    elif not drafter_forward:
        why = "the ngram drafter runs no model forward, so skipping it cannot unbalance collectives."
    elif dp == 1:
        why = "one rank: skipping the drafter when nothing fits cannot make ranks disagree."
    else:
        why = "dp_sync never: ranks do not talk while stepping, so a rank may skip its drafter."
    return [("ok", f"{plan.policy}: {why}")]


def _speculation(cfg: Config, plan: Plan) -> list[tuple[str, str]]:
    """The schedule of the step's k (`runtime/spec_length.py`)."""
    spec = cfg.speculative
    k, ranges = spec.num_speculative_tokens, spec.num_speculative_tokens_per_batch_size
    if not METHODS[spec.method].drafts:
        if ranges or spec.adaptive:
            return [("warn", "method none drafts nothing: num_speculative_tokens_per_batch_size / adaptive are unused.")]
        return [("ok", "method none: k = 0.")]
    lock = (" In lockstep every rank uses the k chosen for the largest batch among the ranks, agreed in the "
            "step sync (it applies from the next step)." if plan.lockstep else
            " Each rank chooses for its own batch." if cfg.parallel.data_parallel_size > 1 else "")
    window = " The no-draft window does not depend on the step's k (a sequence fits the drafter when L + k <= D)."
    if spec.adaptive:
        return [("ok", f"adaptive: each step drafts k in 0..{k}, the k that maximises expected tokens per second "
                       f"(acceptance per position as running averages; target and drafter forward costs timed at "
                       f"start-up and corrected by measured step times).{lock}{window}")]
    if ranges:
        parts = ", ".join(f"{a}-{b} running: k {kk}" for a, b, kk in sorted(ranges))
        unused = [r for r in ranges if r[0] > cfg.scheduler.max_num_seqs]
        out = [("ok", f"per batch size: {parts}; any other batch size: k {k}.{lock}{window}")]
        if unused:
            out.append(("warn", f"ranges {unused} start above max_num_seqs ({cfg.scheduler.max_num_seqs}): a rank "
                                f"never runs that many sequences, so they are never used."))
        return out
    return [("ok", f"fixed: k = {k} every step.")]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n}"


def _fp8_finding(role: str, key: str, q: dict, plan: Plan) -> tuple[str, str]:
    """How a block-FP8 model (plan.memory's quantization) loads: kept FP8 (W8A8) on a GPU with FP8, else
    dequantized (a GPU without FP8 is warned for an FP8 checkpoint, refused for `quantization: fp8`)."""
    high = f"{', '.join(q['high_precision']) or 'nothing'} stay{'s' if len(q['high_precision']) == 1 else ''} in high precision"
    what = (f"FP8 weights ({q['weight_block_size'][0]}x{q['weight_block_size'][1]} blocks)" if q["source"] == "checkpoint"
            else "linear layers, quantized to FP8 (128x128 blocks) at load,")
    dtype = plan.dtype
    if q["loaded_as"] == "float8_e4m3fn":
        return "ok", (f"The {role}'s {what} stay FP8 on the GPU and compute as W8A8 (activations quantized per token "
                      f"and 128 columns; counted above at one byte a weight plus the block scales); {high}.")
    no_fp8 = (f"this GPU (compute capability {q['gpu_capability']}) has no FP8 (8.9+ needed: Ada, Hopper)"
              if q.get("gpu_capability") else f"FP8 compute needs bfloat16 or float16, not {dtype}")
    if q["source"] == "checkpoint":
        if plan.device == "cuda":
            return "warn", (f"The {role}'s {what} are dequantized to {dtype} at load: {no_fp8}, so they take "
                            f"{dtype}'s memory (counted above) and speed; {high}.")
        return "ok", (f"The {role}'s {what} are dequantized to {dtype} at load (FP8 compute needs a CUDA GPU with "
                      f"compute capability 8.9+; counted above in {dtype}); {high}.")
    if plan.device == "cuda":
        return "error", (f"{key}: fp8 quantizes the {role} to FP8 at load, but {no_fp8}: remove {key}"
                         + (" (or set dtype: bfloat16)." if not q.get("gpu_capability") else "."))
    return "ok", (f"The {role}'s {what} are dequantized to {dtype} again (the CPU has no FP8: outputs show the "
                  f"quantization's effect, memory and speed are {dtype}'s); {high}.")


def _memory(cfg: Config, plan: Plan, report: Report) -> list[tuple[str, str]]:
    """Weights and the paged KV cache's capacity, in tokens and in full-length sequences (plan.memory)."""
    m = plan.memory
    M, n, bs = cfg.max_model_len, cfg.scheduler.max_num_seqs, m["block_size"]
    weights, per_token, blocks, per_seq = m["weight_bytes"], m["kv_bytes_per_token"], m["num_blocks"], m["sequence_blocks"]
    with_mtp = " with the MTP layer" if METHODS[cfg.speculative.method].in_target else ""
    how = {"config": "cache.num_blocks", "cpu": f"max_num_seqs ({n}) full-length sequences"}.get(
        m["source"], f"gpu_memory_utilization {cfg.cache.gpu_memory_utilization} of {_fmt_bytes(m['device_total'] or 0)}")
    tokens = blocks * bs
    seqs = blocks // per_seq
    report.kv_cache = {"block_size": bs, "num_blocks": blocks, "tokens": tokens, "sequences": seqs}
    tp = m.get("tensor_parallel_size", 1)
    over_dp = ", experts over the DP ranks" if plan.expert_parallel else ""
    if tp > 1 and METHODS[cfg.speculative.method].separate_lm:
        over_dp += "; the draft model's too" if plan.draft_tensor_parallel_size > 1 else "; the draft model whole"
    per = (f" per GPU (tensor_parallel_size {tp}: attention and MLP split{over_dp})" if tp > 1 else
           " per rank (experts split)" if plan.expert_parallel else "")
    numbers = (f"weights {_fmt_bytes(weights)}{with_mtp}{per}; "
               f"KV cache{' per GPU' if tp > 1 else ''} {blocks} blocks of {bs} tokens = {tokens} tokens "
               f"({_fmt_bytes(per_token)} per token{with_mtp}, {_fmt_bytes(tokens * per_token)}; from {how}): "
               f"{seqs} sequences of max_model_len {M} at once; prefix caching "
               f"{'on' if cfg.cache.enable_prefix_caching else 'off'}")
    if blocks < per_seq:
        return [("error", f"{numbers}; not even one sequence of max_model_len {M} fits ({per_seq} blocks): raise "
                          f"cache.num_blocks or cache.gpu_memory_utilization, or lower max_model_len.")]
    where = ("estimate only: no GPU to compare with" if m["source"] == "cpu" or m["device_total"] is None
             else "an estimate; the engine measures it at start")
    out = [("ok", f"{numbers} ({where}).")]
    for role, key, q in (("target", "quantization", m.get("quantization")),
                         ("drafter", "speculative.quantization", m.get("drafter_quantization"))):
        if q:
            out.append(_fp8_finding(role, key, q, plan))
    read = m.get("weights_per_token")
    if read:
        how = f" (routed experts: {read['routed']})" if read["routed"] else ""
        out.append(("ok", f"A decoded token reads {_fmt_bytes(read['active_bytes'])} of the target's "
                          f"{_fmt_bytes(read['total_bytes'])} of weights{how}: at batch 1 decode speed is bounded by "
                          f"the device's memory bandwidth over the first."))
    if seqs < n:
        out.append(("ok", f"Fewer than max_num_seqs ({n}) sequences fit at full length: sequences take blocks "
                          f"as they grow, and when none is free the newest is preempted and recomputed later."))
    return out
