"""PNG charts of benchmark summaries (matplotlib figures drawn straight to files, no pyplot and no display)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def short_label(row: str) -> str:
    """A row's label for a legend: option values that are file paths shortened to the file's name."""
    return re.sub(r"=([^,;=]*[/\\])([^,;/\\=]+)", r"=\2", row)


def _legend(axes) -> None:
    """The legend beside the plot, where it never hides a bar."""
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _bar_width(series: int) -> float:
    return 0.8 / max(series, 1)


def speedup_chart(speedups: Mapping[str, Mapping[str, float]], categories: Sequence[str], path: str | Path) -> Path:
    """Grouped bars: for each category, each row's speedup over ``ar`` (``speedups[row][category]``)."""
    figure = Figure(figsize=(min(16.0, max(7.0, 0.18 * len(categories) * max(len(speedups), 1) + 4)), 4.5))
    axes = figure.subplots()
    width = _bar_width(len(speedups))
    for index, (row, values) in enumerate(speedups.items()):
        offsets = [position + (index - (len(speedups) - 1) / 2) * width for position in range(len(categories))]
        axes.bar(offsets, [values.get(category, 0.0) for category in categories], width, label=short_label(row))
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_xticks(range(len(categories)), categories, rotation=20, ha="right")
    axes.set_ylabel("speedup over ar (total tokens / total time)")
    axes.set_title("Speedup by category")
    _legend(axes)
    return _save(figure, path)


def acceptance_length_chart(histograms: Mapping[str, Sequence[int]], path: str | Path) -> Path:
    """Grouped bars: share of steps that emitted n tokens, per row (``histograms[row][n]`` counts steps)."""
    longest = max((len(histogram) for histogram in histograms.values()), default=2) - 1
    lengths = list(range(1, max(longest, 1) + 1))
    figure = Figure(figsize=(min(16.0, max(7.0, 0.12 * len(lengths) * max(len(histograms), 1) + 4)), 4.5))
    axes = figure.subplots()
    width = _bar_width(len(histograms))
    for index, (row, histogram) in enumerate(histograms.items()):
        steps = sum(histogram) or 1
        shares = [(histogram[length] if length < len(histogram) else 0) / steps for length in lengths]
        offsets = [length + (index - (len(histograms) - 1) / 2) * width for length in lengths]
        axes.bar(offsets, shares, width, label=short_label(row))
    axes.set_xticks(lengths)
    axes.set_xlabel("tokens accepted in a step (bonus token included)")
    axes.set_ylabel("share of steps")
    axes.set_title("Accepted length per step")
    _legend(axes)
    return _save(figure, path)


def budget_chart(
    series: Mapping[str, Sequence[tuple[int, float]]], baselines: Mapping[str, float], path: str | Path
) -> Path:
    """Tokens/s against the draft budget, one line per method (``series[method]`` = ``(budget, tokens/s)``
    points), with horizontal lines for the baselines."""
    figure = Figure(figsize=(6.5, 4.5))
    axes = figure.subplots()
    for method, points in series.items():
        ordered = sorted(points)
        axes.plot([budget for budget, _ in ordered], [rate for _, rate in ordered], marker="o", label=short_label(method))
    for name, rate in baselines.items():
        axes.axhline(rate, linestyle="--", linewidth=0.9, color="grey")
        axes.annotate(name, (0, rate), xycoords=("axes fraction", "data"), fontsize="small", va="bottom")
    budgets = sorted({budget for points in series.values() for budget, _ in points})
    if budgets and budgets[0] > 0:
        axes.set_xscale("log", base=2)  # budgets are usually swept in powers of two
        axes.minorticks_off()
    axes.set_xticks(budgets, [str(budget) for budget in budgets])
    axes.set_xlabel("draft budget (most draft nodes per step)")
    axes.set_ylabel("tokens/s")
    axes.set_title("Speed against draft budget")
    _legend(axes)
    return _save(figure, path)


def load_chart(runs: Mapping[str, Sequence[Mapping]], path: str | Path) -> Path:
    """Three panels against concurrency, one line per server (``runs[label]``: its loadtest levels): output
    tokens/s; time to first token (median solid, p99 dashed); inter-token latency (median)."""
    figure = Figure(figsize=(13.0, 4.0))
    throughput, first_token, inter_token = figure.subplots(1, 3)
    ticks: set[int] = set()
    for label, levels in runs.items():
        levels = sorted(levels, key=lambda level: level["concurrency"])
        concurrency = [level["concurrency"] for level in levels]
        ticks.update(concurrency)
        metrics = [level["metrics"] for level in levels]
        line = throughput.plot(concurrency, [m["output_tokens_per_second"] for m in metrics], marker="o",
                               label=short_label(label))[0]
        colour = line.get_color()
        ttft = [(c, m["time_to_first_token_ms"]) for c, m in zip(concurrency, metrics) if m["time_to_first_token_ms"]]
        if ttft:
            first_token.plot([c for c, _ in ttft], [d["median"] for _, d in ttft], marker="o", color=colour)
            first_token.plot([c for c, _ in ttft], [d["p99"] for _, d in ttft], linestyle="--", color=colour)
        itl = [(c, m["inter_token_latency_ms"]) for c, m in zip(concurrency, metrics) if m["inter_token_latency_ms"]]
        if itl:
            inter_token.plot([c for c, _ in itl], [d["median"] for _, d in itl], marker="o", color=colour)
    titles = ("output tokens/s", "time to first token, ms (median; p99 dashed)", "inter-token latency, ms (median)")
    for axes, title in zip((throughput, first_token, inter_token), titles):
        axes.set_xscale("log", base=2)
        axes.set_xticks(sorted(ticks), [str(tick) for tick in sorted(ticks)])
        axes.set_xlabel("concurrent requests")
        axes.set_title(title, fontsize="medium")
        axes.grid(alpha=0.3)
        axes.set_ylim(bottom=0)
    first_token.set_yscale("symlog", linthresh=100)
    handles, labels = throughput.get_legend_handles_labels()
    inter_token.legend(handles, labels, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0),
                       borderaxespad=0.0)
    return _save(figure, path)
