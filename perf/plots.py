"""PNG plots from perf/serving.py's last run: output tokens/s and TTFT (p50, p99) against concurrency for
each engine, and TTFT / inter-token latency CDFs of pagedllm per concurrency. Needs matplotlib
(`.venv/bin/pip install -e '.[perf]'`).

    .venv/bin/python perf/serving.py --with-vllm && .venv/bin/python perf/plots.py
"""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common import OUT_DIR  # noqa: E402

FIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")


def against_concurrency(summary, keys_labels, ylabel, title, name):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for engine in sorted({row["engine"] for row in summary}):
        rows = sorted((r for r in summary if r["engine"] == engine), key=lambda r: r["concurrency"])
        for key, label, style in keys_labels:
            ax.plot([r["concurrency"] for r in rows], [r[key] for r in rows], style, marker="o",
                    label=f"{engine}{label}")
    ax.set(xlabel="concurrent streams", ylabel=ylabel, xscale="log", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, name), dpi=120)


def cdf(ax, values, label):
    xs = sorted(1000 * v for v in values)
    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def main() -> None:
    with open(os.path.join(OUT_DIR, "serving_samples.json")) as f:
        run = json.load(f)
    os.makedirs(FIG_DIR, exist_ok=True)
    summary = run["summary"]
    model = summary[0]["model"]
    against_concurrency(summary, [("output_tokens_per_s", "", "-")], "output tokens/s",
                        f"served throughput: {model}", "throughput_vs_concurrency.png")
    against_concurrency(summary, [("ttft_p50_ms", " p50", "--"), ("ttft_p99_ms", " p99", "-")], "TTFT (ms)",
                        f"time to first token: {model}", "ttft_vs_concurrency.png")
    for key, name in (("ttft_s", "time to first token"), ("itl_s", "inter-token latency")):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for level in run["samples"]:
            if level["engine"] == "pagedllm-triton":
                cdf(ax, level[key], f"concurrency {level['concurrency']}")
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of requests", xscale="log",
               title=f"pagedllm {name} CDF: {model}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(FIG_DIR, f"{key.split('_')[0]}_cdf.png"), dpi=120)
    print(f"wrote {FIG_DIR}/throughput_vs_concurrency.png, ttft_vs_concurrency.png, ttft_cdf.png, itl_cdf.png")


if __name__ == "__main__":
    main()
