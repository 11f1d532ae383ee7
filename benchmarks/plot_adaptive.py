"""docs/adaptive_k.png and the table of issue 14 from adaptive_k.py results: for each model, tok/s
against batch size for every fixed k and for adaptive k, and adaptive / best fixed k per batch size.

Several JSON files may hold parts of one model's table (batch sizes, k values or repeats measured in
different calls or on different GPUs): a row's runs are pooled by (label, batch, k) and its figure is
the median of all of them.

Usage: python benchmarks/plot_adaptive.py OUT_PNG RESULT.json [RESULT.json ...]   (needs matplotlib)
"""
import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def merged_rows(paths: list[str]) -> dict:
    rows = {}
    for p in paths:
        for r in json.load(open(p))["rows"]:
            key = (r["label"], r["batch"], str(r["k"]))
            runs = rows[key]["runs"] + r["runs"] if key in rows else list(r["runs"])
            rows[key] = {**r, "runs": runs, "tok_s": statistics.median(runs)}
    return rows


def main() -> None:
    out, paths = sys.argv[1], sys.argv[2:]
    rows = merged_rows(paths)
    labels = list(dict.fromkeys(label for label, _, _ in rows))
    fig, axes = plt.subplots(1, len(labels), figsize=(6.5 * len(labels), 4.5), squeeze=False)
    print(f"{'model':<10}{'batch':>6}" + "".join(f"{'k=' + str(k):>9}" for k in range(7))
          + f"{'adaptive':>10}{'best k':>7}{'ratio':>7}")
    for ax, label in zip(axes[0], labels):
        batches = sorted({b for lab, b, _ in rows if lab == label})
        ks = sorted({int(k) for lab, _, k in rows if lab == label and k.isdigit()})     # not adaptive, replay
        for k in ks:
            pts = [(b, rows[(label, b, str(k))]["tok_s"]) for b in batches if (label, b, str(k)) in rows]
            ax.plot([b for b, _ in pts], [v for _, v in pts], "-", marker=".", alpha=0.6, label=f"k = {k}")
        pts = [(b, rows[(label, b, "adaptive")]["tok_s"]) for b in batches if (label, b, "adaptive") in rows]
        ax.plot([b for b, _ in pts], [v for _, v in pts], "k-", marker="o", linewidth=2.5, label="adaptive")
        for b in batches:
            fixed = {k: rows[(label, b, str(k))]["tok_s"] for k in ks if (label, b, str(k)) in rows}
            ad = rows.get((label, b, "adaptive"))
            if not fixed or ad is None:
                continue
            best = max(fixed, key=fixed.get)
            ratio = ad["tok_s"] / fixed[best]
            ax.annotate(f"{ratio:.2f}", (b, ad["tok_s"]), textcoords="offset points", xytext=(0, -14),
                        ha="center", fontsize=8)
            print(f"{label:<10}{b:>6}" + "".join(f"{fixed[k]:>9.0f}" if k in fixed else f"{'-':>9}" for k in range(7))
                  + f"{ad['tok_s']:>10.0f}{best:>7}{ratio:>7.3f}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("max_num_seqs (256 requests x 128 new tokens)")
        ax.set_ylabel("tok/s (median of runs)")
        ax.set_title(f"{label}: adaptive k vs fixed k (labels: adaptive / best fixed)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
