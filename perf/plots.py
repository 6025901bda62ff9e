"""PNG plots from perf/serving.py's samples: served throughput vs concurrency, and TTFT / inter-token latency
CDFs per concurrency. Needs matplotlib (`.venv/bin/pip install -e '.[perf]'`).

    .venv/bin/python perf/serving.py && .venv/bin/python perf/plots.py
"""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common import OUT_DIR  # noqa: E402

FIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")


def cdf(ax, values, label):
    xs = sorted(1000 * v for v in values)
    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def main() -> None:
    with open(os.path.join(OUT_DIR, "serving_samples.json")) as f:
        levels = json.load(f)
    os.makedirs(FIG_DIR, exist_ok=True)
    model = levels[0]["model"]

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([lv["concurrency"] for lv in levels], [lv["output_tokens_per_s"] for lv in levels], marker="o")
    ax.set(xlabel="concurrent streams (gRPC)", ylabel="output tokens/s", xscale="log",
           title=f"pagedllm through Triton: {model}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(FIG_DIR, "throughput_vs_concurrency.png"), dpi=120)

    for key, name in (("ttft_s", "time to first token"), ("itl_s", "inter-token latency")):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for lv in levels:
            cdf(ax, lv[key], f"concurrency {lv['concurrency']}")
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of samples", xscale="log", title=f"{name} CDF: {model}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(FIG_DIR, f"{key.split('_')[0]}_cdf.png"), dpi=120)
    print(f"wrote {FIG_DIR}/throughput_vs_concurrency.png, ttft_cdf.png, itl_cdf.png")


if __name__ == "__main__":
    main()
