"""Hit rate against cache capacity, one line per policy, with the optimal and the ceiling."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .report import OPTIMAL, ReplayReport, human_tokens


def check_plot_path(path: str | Path) -> None:
    """Refuse, before any replay runs, a plot file that cannot be written: ValueError."""
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"--plot {path}: the folder {folder} does not exist")
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in kinds:
        raise ValueError(f"--plot {path}: unsupported file type {path.suffix or '(none)'!r}; "
                         f"use one of {', '.join('.' + k for k in sorted(kinds))}")


def plot_curve(report: ReplayReport, path: str | Path) -> None:
    """Write the hit-rate curve of a sweep to ``path`` (format from its suffix)."""
    import matplotlib  # lazy: only --plot pays for it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for p in report.points:
        if p.capacity_tokens is not None:
            series[p.policy].append((p.capacity_tokens, p.token_hit_rate))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for policy in sorted(series, key=lambda name: name == OPTIMAL):  # given order, optimal last
        xs, ys = zip(*sorted(series[policy]))
        if policy == OPTIMAL:
            ax.plot(xs, ys, "k--", marker="s", markersize=4, label="optimal (Belady)")
        else:
            ax.plot(xs, ys, marker="o", markersize=4, label=policy.upper())
    ax.axhline(report.ceiling.token_hit_rate, color="grey", linestyle=":",
               label=f"ceiling, unbounded ({report.ceiling.token_hit_rate:.1%})")
    caps = [c for pts in series.values() for c, _ in pts]
    if caps and max(caps) > 20 * min(caps):
        ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human_tokens(int(x))))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, min(1.0, report.ceiling.token_hit_rate * 1.15 + 0.02))
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("token hit rate (prefill saved)")
    ax.set_title(f"{Path(report.trace).name}: {report.requests} requests, "
                 f"page size {report.page_size}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_cluster(report, path: str | Path) -> None:
    """Token hit rate against replicas, one line per router, and the single replica holding
    the same total capacity (dashed); one panel per (capacity per replica, policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    panels = list(dict.fromkeys((p.capacity_tokens, p.policy) for p in report.points))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), dpi=120,
                             squeeze=False)
    for ax, (cap, policy) in zip(axes[0], panels):
        points = [p for p in report.points if (p.capacity_tokens, p.policy) == (cap, policy)]
        routers = list(dict.fromkeys(p.router for p in points))
        styles = ["-o", "--^", "-.v", ":s", "-D"]      # overlapping lines stay visible
        for k, router in enumerate(routers):
            xs, ys = zip(*sorted((p.replicas, p.token_hit_rate) for p in points
                                 if p.router == router))
            ax.plot(xs, ys, styles[k % len(styles)], markersize=5, alpha=0.85,
                    label=router)
        ns = sorted({p.replicas for p in points})
        ax.plot(ns, [report.single[n * cap, policy].token_hit_rate for n in ns], "k:",
                linewidth=2.5, label="one replica, same total capacity")
        if len(ns) > 1 and max(ns) > 8 * min(ns):
            ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_ylim(0, 1.0)
        ax.set_xlabel("replicas")
        ax.set_ylabel("cluster token hit rate")
        ax.set_title(f"{human_tokens(cap)} tokens per replica, {policy.upper()}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(report.trace).name}: {report.requests:,d} requests", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_tiers(report, path: str | Path) -> None:
    """Token hit rate against first-tier capacity, stacked by the tier that served it; one
    panel per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    from .tiers import tier_levels

    policies = list(dict.fromkeys(p.policy for p in report.points))
    fig, axes = plt.subplots(1, len(policies), figsize=(6.5 * len(policies), 4.5), dpi=120,
                             squeeze=False)
    t = report.tiers
    names = {"gpu": "first tier (KV pool)",
             "host": f"host ({human_tokens(t.host_capacity_tokens)} tokens)",
             "disk": f"disk ({human_tokens(t.disk_capacity_tokens)} tokens)"}
    for ax, policy in zip(axes[0], policies):
        points = sorted((p for p in report.points if p.policy == policy),
                        key=lambda p: p.capacity_tokens)
        xs = [p.capacity_tokens for p in points]
        levels = tier_levels(points[0])
        ax.stackplot(xs, *[[p.hit_rate(level) for p in points] for level in levels],
                     labels=[names[level] for level in levels], alpha=0.8)
        if len(xs) > 1 and max(xs) > 20 * min(xs):
            ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human_tokens(int(x))))
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_ylim(0, 1.0)
        ax.set_xlabel("first-tier capacity (tokens)")
        ax.set_ylabel("token hit rate, by the tier that served it")
        ax.set_title(policy.upper(), fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"{Path(report.trace).name}: {report.requests:,d} requests", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
