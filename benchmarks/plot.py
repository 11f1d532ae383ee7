"""docs/benchmarks.png from benchmarks/results/: tok/s against batch size, specdp and Hugging Face.
Usage: python benchmarks/plot.py [RESULTS_JSON] [OUT_PNG]   (needs matplotlib)"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results", "2026-11-29-h200-offline-codepair.json")
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(HERE, "..", "docs", "benchmarks.png")
    d = json.load(open(src))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, style in (("draft_model", "o-"), ("ngram", "s-"), ("none", "^-")):
        rows = sorted((r for r in d["specdp"] if r["method"] == method), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in rows], [r["tok_s"] for r in rows], style, label=f"specdp {method}")
    hf = {r["case"]: r["tok_s"] for r in d["hf"] if "tok_s" in r}
    static = sorted((int(k.rsplit("bs", 1)[1]), v) for k, v in hf.items() if k.startswith("hf_generate_bs"))
    ax.plot([b for b, _ in static], [v for _, v in static], "x--", color="gray", label="HF generate (static batch)")
    for case, marker in (("hf_assisted_draft_k4_const_bs1", "D"), ("hf_prompt_lookup_bs1", "P")):
        if case in hf:
            ax.plot([1], [hf[case]], marker, color="black", label=case.replace("_", " ").replace("hf ", "HF "))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (sequences in flight)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("codepair, 32 prompts x 128 tokens, greedy, bf16, one H200")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
