"""The PNG figures of a run (matplotlib, no display needed), after FastGen's:

throughput_latency.png    request throughput (x) against E2E latency (y), mean and P90, one
                          point per load point, labelled with it (FastGen's Figures 4 and 5)
effective_throughput.png  effective throughput under each generation SLA against the load
                          points: clients for a sweep (FastGen's Figure 6)
token_latency.png         P50 / P90 / P95 / P99 of the inter-token latency per load point
                          (FastGen's Figure 7), with TTFT's beside it
"""

from __future__ import annotations

from pathlib import Path

from conveyor.bench.results import PERCENTILES, ServeMetrics


def write_plots(points: list[ServeMetrics], plot_dir: str | Path, title: str = "") -> list[Path]:
    """Write the three figures into `plot_dir` (created); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in (
        ("throughput_latency.png", _throughput_latency),
        ("effective_throughput.png", _effective_throughput),
        ("token_latency.png", _token_latency),
    ):
        fig = draw(plt, points)
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)
    return paths


def _throughput_latency(plt, points: list[ServeMetrics]):
    fig, ax = plt.subplots(figsize=(6, 4.5))
    x = [m.request_throughput for m in points]
    ax.plot(x, [m.e2e["mean"] for m in points], "o-", label="mean")
    ax.plot(x, [m.e2e["p90"] for m in points], "s--", label="P90")
    for m in points:
        ax.annotate(m.label, (m.request_throughput, m.e2e["mean"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("end-to-end latency (s)")
    ax.set_title("throughput vs latency")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _effective_throughput(plt, points: list[ServeMetrics]):
    fig, ax = plt.subplots(figsize=(6, 4.5))
    closed = all(m.num_clients is not None for m in points)
    x = [m.num_clients for m in points] if closed else list(range(len(points)))
    for sla in points[0].effective_throughput:
        ax.plot(x, [m.effective_throughput[sla] for m in points], "o-", label=f"generation >= {sla:g} tokens/s")
    ax.plot(x, [m.request_throughput for m in points], "k:", label="all completed requests")
    if closed:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(n) for n in x])
        ax.set_xlabel("clients")
    else:
        ax.set_xticks(x, [m.label for m in points])
        ax.set_xlabel("load")
    ax.set_ylabel("effective throughput (requests/s)")
    ax.set_title("effective throughput (prompt >= 512 tokens/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _token_latency(plt, points: list[ServeMetrics]):
    fig, (itl_ax, ttft_ax) = plt.subplots(1, 2, figsize=(10, 4.5))
    width = 0.8 / len(PERCENTILES)
    for ax, key, unit, scale in ((itl_ax, "itl", "ms", 1e3), (ttft_ax, "ttft", "s", 1.0)):
        for j, p in enumerate(PERCENTILES):
            xs = [i + (j - (len(PERCENTILES) - 1) / 2) * width for i in range(len(points))]
            ax.bar(xs, [getattr(m, key)[f"p{p}"] * scale for m in points], width, label=f"P{p}")
        ax.set_xticks(range(len(points)), [m.label for m in points], fontsize=8)
        ax.set_ylabel(f"{key.upper()} ({unit})")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    itl_ax.set_title("inter-token latency percentiles")
    ttft_ax.set_title("time to first token percentiles")
    return fig
