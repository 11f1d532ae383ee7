"""The speculative methods specdp runs: one table read by the config, preflight, the job fingerprint
and the engine (no method names spread over them as string checks).

A method either drafts on the host (`ngram`) or runs a model of its own (`draft_model`, `eagle`, `eagle3`,
`mtp`); the latter is what lockstep must pad on idle ranks. An EAGLE head or an MTP layer drafts from the
target's hidden states, so it proposes *after* verification (vLLM's order: verify -> accept -> propose),
and the drafts reach the next step with that step's results. `mtp`'s drafter lives in the target's own
checkpoint, so `speculative.model` is not used and the target's fingerprint covers it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    loads: str | None            # what `speculative.model` names ("drafter", "EAGLE head"), None: unused
    forward: bool                # runs model forwards (lockstep pads them on idle ranks: policy dummy)
    after_verify: bool = False   # proposes the next step's drafts after this step's verification
    separate_lm: bool = False    # the drafter is a causal LM of its own (architecture, tokenizer, vocabulary)
    drafts: bool = True          # False: plain decoding (k = 0)
    prompt_lookup: bool = False  # drafts by n-gram lookup in the sequence itself (prompt_lookup_min/max)
    in_target: bool = False      # the drafter is stored in the target's checkpoint (DeepSeek-V3's MTP layer)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none", None, False, drafts=False),
    Method("ngram", None, False, prompt_lookup=True),
    Method("draft_model", "drafter", True, separate_lm=True),
    Method("eagle", "EAGLE head", True, after_verify=True),
    Method("eagle3", "EAGLE-3 head", True, after_verify=True),
    Method("mtp", None, True, after_verify=True, in_target=True),
)}
