"""Benchmark summaries for people: rich tables in the terminal, and ``draftwise report``, a markdown report with
PNG charts made from one or several results files (``draftwise bench --out``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from rich.table import Table

from ..errors import InvalidRequestError
from .metrics import summarize
from .plots import acceptance_length_chart, budget_chart, speedup_chart
from .results import OVERALL, Record, read_results

Summary = dict[str, dict[str, dict[str, Any]]]
#: Draft positions shown in the acceptance-per-position table.
POSITIONS_SHOWN = 8


def _format(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _spread(row: Mapping[str, Any]) -> str:
    if row.get("repeats", 1) < 2:
        return "-"
    return f"{row['tokens_per_s_min']:.1f}-{row['tokens_per_s_max']:.1f}"


def _megabytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _milliseconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


#: Column name -> cell text of a summary row, shared by the terminal tables and the markdown report.
COLUMNS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "tok/s": lambda row: _format(row["tokens_per_s"], "{:.1f}"),
    "tok/s range": _spread,
    "vs ar": lambda row: _format(row["speedup_vs_ar"], "{:.2f}x"),
    "vs hf": lambda row: _format(row["speedup_vs_hf"], "{:.2f}x"),
    "vs ar (mean rate)": lambda row: _format(row["speedup_vs_ar_mean_rate"], "{:.2f}x"),
    "vs hf (mean rate)": lambda row: _format(row["speedup_vs_hf_mean_rate"], "{:.2f}x"),
    "MAT": lambda row: _format(row["mat"], "{:.2f}"),
    "accept": lambda row: _format(row.get("acceptance_rate"), "{:.0%}"),
    "exact vs ar": lambda row: _format(row["exact_match_vs_ar"], "{:.0%}"),
    "1st div": lambda row: _format(row.get("first_divergence"), "{:.1f}"),
    "TTFT ms": lambda row: _milliseconds(row.get("time_to_first_token_s")),
    "peak MB": lambda row: _megabytes(row.get("peak_memory_bytes")),
}


def _categories_overall_last(summary: Mapping[str, Any]) -> list[str]:
    return [*(name for name in summary if name != OVERALL), OVERALL]


def _title(category: str, rows: Mapping[str, Mapping[str, Any]]) -> str:
    any_row = next(iter(rows.values()))
    prompts, questions = any_row["prompts"], any_row.get("questions", any_row["prompts"])
    counted = f"{prompts} prompt{'s' if prompts != 1 else ''}"
    if questions != prompts:
        counted += f" from {questions} question{'s' if questions != 1 else ''}"
    return f"{category} ({counted})"


def summary_tables(summary: Summary, by_category: bool = False) -> list[Table]:
    """The overall table, with the columns of :data:`COLUMNS` that have a value; with ``by_category``, one table per
    category before it."""
    tables = []
    for category in _categories_overall_last(summary) if by_category else [OVERALL]:
        if category not in summary:
            continue
        rows = summary[category]
        cells = {label: {column: cell(row) for column, cell in COLUMNS.items()} for label, row in rows.items()}
        shown = [column for column in COLUMNS if any(values[column] != "-" for values in cells.values())]
        table = Table(title=_title(category, rows), title_justify="left")
        table.add_column("method", no_wrap=True)
        for column in shown:
            table.add_column(column, justify="right")
        for label, values in cells.items():
            table.add_row(label, *(values[column] for column in shown))
        tables.append(table)
    return tables


def interleave_table(rounds: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], max_new_tokens: int) -> Table:
    """The A/B comparison of ``draftwise bench --interleave``: one line per round (its
    :meth:`~draftwise.bench.interleave.InterleaveRound.summary`) and the medians (the result's
    :meth:`~draftwise.bench.interleave.InterleaveResult.summary`)."""
    greedy = summary["identical_ids"] is not None
    title = (f"A = {summary['a']}, B = {summary['b']}: {summary['rounds']} rounds over {summary['prompts']} prompts, "
             f"{max_new_tokens} new tokens each")
    table = Table(title=title, title_justify="left", min_width=len(title))  # (the title on one line)
    for column in ("round", "first", "A tok/s", "B tok/s", "B/A", *(["same ids"] if greedy else [])):
        table.add_column(column, justify="right")
    for line in rounds:
        same = [f"{line['identical_ids']}/{line['prompts']}"] if greedy else []
        table.add_row(str(line["round"]), line["first"], f"{line['a_tokens_per_s']:.1f}",
                      f"{line['b_tokens_per_s']:.1f}", f"{line['ratio']:.3f}x", *same)
    same = [f"{summary['identical_ids']}/{summary['compared_runs']}"] if greedy else []
    table.add_section()
    table.add_row("median", "", f"{summary['a_tokens_per_s']:.1f}", f"{summary['b_tokens_per_s']:.1f}",
                  f"{summary['ratio']:.3f}x", *same)
    return table


def interleave_line(summary: Mapping[str, Any]) -> str:
    """The comparison's result in one line: the median ratio B/A over the rounds with its spread."""
    line = (f"B/A ({summary['b']} over {summary['a']}): median {summary['ratio']:.3f}x over {summary['rounds']} "
            f"rounds, interquartile {summary['ratio_q1']:.3f}-{summary['ratio_q3']:.3f}x, "
            f"min-max {summary['ratio_min']:.3f}-{summary['ratio_max']:.3f}x")
    if summary["identical_ids"] is not None:
        line += f"; identical ids in {summary['identical_ids']} of {summary['compared_runs']} runs"
    return line


def floor_line(summary: Summary, environment: Mapping[str, Any]) -> str | None:
    """How far plain decoding (``ar``, overall) is from the machine's bandwidth floor (every weight read once a
    token, see :func:`draftwise.bench.environment.bandwidth_floor`), with its prompts' prefills and, where the runs
    timed their first tokens, without them (what the floor bounds); ``None`` without both."""
    floor = environment.get("floor_ms_per_token")
    plain = summary.get(OVERALL, {}).get("ar")
    if not floor or not plain or not plain.get("tokens_per_s"):
        return None
    per_token = 1000 / plain["tokens_per_s"]
    line = (f"bandwidth floor: {floor:.1f} ms a token ({environment['weights_mb']:.0f} MB of weights at "
            f"{environment['read_gb_per_s']:.0f} GB/s read); ar: {per_token:.1f} ms a token, {per_token / floor:.2f}x "
            "the floor")
    decoding = plain.get("decode_ms_per_token")
    if decoding:
        line += f"; {decoding:.1f} ms a token after the first (prefills left out), {decoding / floor:.2f}x"
    return line


# ---------------------------------------------------------------------------------------------------------------
# draftwise report


@dataclass
class Run:
    """One results file: its name in the report, header (config and environment), records and summary."""

    name: str
    path: Path
    header: dict[str, Any]
    records: list[Record]
    summary: Summary


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    """Read and summarise results files; each is named by its file stem (made unique)."""
    if not paths:
        raise InvalidRequestError("give one or more results files (written by draftwise bench --out)")
    runs: list[Run] = []
    for path in map(Path, paths):
        header, records = read_results(path)
        summary = summarize(records)
        if not summary.get(OVERALL):
            raise InvalidRequestError(f"{path} holds no finished runs yet")
        name = path.stem
        taken = {run.name for run in runs}
        suffix = 2
        while name in taken:
            name, suffix = f"{path.stem}-{suffix}", suffix + 1
        runs.append(Run(name, path, header, records, summary))
    return runs


def _row_name(run: Run, label: str, several: bool) -> str:
    return f"{run.name}: {label}" if several else label


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _category_names(runs: Sequence[Run]) -> list[str]:
    names = sorted({name for run in runs for name in run.summary if name != OVERALL})
    return [OVERALL, *names]


def _run_description(run: Run) -> list[str]:
    config, env = run.header.get("config", {}), run.header.get("environment", {})
    sha = env.get("model_sha256")
    lines = [
        f"### {run.name} (`{run.path}`)",
        "",
        f"- model: {env.get('model')} (sha256 {sha[:12] + '...' if sha else 'unknown'}, of the "
        f"{env.get('model_sha256_of') or '-'}), {env.get('dtype')} on {env.get('device')}",
        f"- machine: {env.get('cpu')}, {env.get('threads')} threads; torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}, draftwise {env.get('draftwise')}",
    ]
    if env.get("draft_model"):
        lines.append(f"- draft model: {env['draft_model']} (sha256 {str(env.get('draft_model_sha256'))[:12]}...)")
    settings = ", ".join(
        f"{key} {config[key]}"
        for key in ("dataset", "data", "max_new_tokens", "turns", "repeats", "sweep_budgets", "chat_template")
        if config.get(key) is not None
    )
    if settings:
        lines.append(f"- settings: {settings}")
    if config.get("sampling"):
        lines.append(f"- sampling: {config['sampling']}")
    lines.append(f"- peak memory: {env.get('peak_memory', '-')}")
    floor = floor_line(run.summary, env)
    if floor:
        lines.append(f"- {floor}")
    return lines


def markdown_report(runs: Sequence[Run], charts: Sequence[Path] = ()) -> str:
    """The report: the runs, a table per category (overall first), acceptance by position, the charts."""
    several = len(runs) > 1
    lines = ["# draftwise benchmark report", "", "## Runs", ""]
    for run in runs:
        lines += [*_run_description(run), ""]
    for category in _category_names(runs):
        table_rows = []
        for run in runs:
            for label, row in run.summary.get(category, {}).items():
                table_rows.append([_row_name(run, label, several), *(cell(row) for cell in COLUMNS.values())])
        if not table_rows:
            continue
        titles = [_title(category, run.summary[category]) for run in runs if run.summary.get(category)]
        lines += [f"## {' / '.join(dict.fromkeys(titles))}", ""]
        lines += _markdown_table(["method", *COLUMNS], table_rows)
        lines.append("")
    lines += _acceptance_section(runs, several)
    if charts:
        lines += ["## Charts", ""]
        lines += [f"![{chart.stem}]({chart.name})" for chart in charts]
        lines.append("")
    lines += [
        "## Metrics",
        "",
        "tok/s: new tokens / generation time (median over repeats of each repeat's total; range: min-max). "
        "vs ar / vs hf: ratio of tok/s; mean rate: Spec-Bench's ratio of mean per-question rates. "
        "MAT: new tokens / steps (bonus token included). accept: accepted / drafted tokens. "
        "exact vs ar: share of runs whose token ids equal ar's; 1st div: mean index of the first differing token "
        "over the runs that differ. TTFT: median time to the first token. peak MB: largest per-run peak memory "
        "(see the run's peak memory line for what it measures). Only runs that every row finished count.",
        "",
    ]
    return "\n".join(lines)


def _acceptance_section(runs: Sequence[Run], several: bool) -> list[str]:
    rows = []
    width = 0
    for run in runs:
        for label, row in run.summary[OVERALL].items():
            rates = row.get("acceptance_per_position") or []
            if rates:
                width = max(width, min(len(rates), POSITIONS_SHOWN))
                rows.append((_row_name(run, label, several), rates))
    if not rows:
        return []
    table = [[name, *(f"{rates[index]:.0%}" if index < len(rates) else "-" for index in range(width))]
             for name, rates in rows]
    return [
        "## Acceptance by draft position (overall)",
        "",
        "Share of draft tokens accepted at depth k among steps whose draft reached depth k with the shallower "
        "tokens accepted.",
        "",
        *_markdown_table(["method", *(str(position) for position in range(1, width + 1))], table),
        "",
    ]


def _summary_speedups(
    summary: Summary, categories: Sequence[str], name: Callable[[str], str] = str
) -> dict[str, dict[str, float]]:
    """Each row's speedup over ``ar`` by category (``ar`` itself and rows without one left out), rows named by
    ``name``."""
    speedups: dict[str, dict[str, float]] = {}
    for category in categories:
        for label, row in summary.get(category, {}).items():
            if label != "ar" and row.get("speedup_vs_ar") is not None:
                speedups.setdefault(name(label), {})[category] = row["speedup_vs_ar"]
    return speedups


def _speedups(runs: Sequence[Run], categories: Sequence[str], several: bool) -> dict[str, dict[str, float]]:
    speedups: dict[str, dict[str, float]] = {}
    for run in runs:
        name = partial(_row_name, run, several=several)
        speedups.update(_summary_speedups(run.summary, categories, name))
    return speedups


def write_speedup_chart(summary: Summary, path: str | Path) -> Path | None:
    """The speedup chart of one bench run's summary (each row's speedup over ``ar``, overall and per category) as a
    PNG at ``path``; ``None`` when no row has a speedup over ``ar`` to show."""
    categories = [OVERALL, *sorted(name for name in summary if name != OVERALL)]
    speedups = _summary_speedups(summary, categories)
    return speedup_chart(speedups, categories, path) if speedups else None


def _histograms(runs: Sequence[Run], several: bool) -> dict[str, list[int]]:
    """Accepted-length histograms of the rows that draft (plain decoding always accepts 1)."""
    return {
        _row_name(run, label, several): row["accepted_length_histogram"]
        for run in runs
        for label, row in run.summary[OVERALL].items()
        if len(row.get("accepted_length_histogram") or []) > 2
    }


def _budget_series(runs: Sequence[Run], several: bool) -> tuple[dict[str, list[tuple[int, float]]], dict[str, float]]:
    series: dict[str, list[tuple[int, float]]] = {}
    baselines: dict[str, float] = {}
    for run in runs:
        for label, row in run.summary[OVERALL].items():
            if row.get("budget") is not None:
                series.setdefault(_row_name(run, row["method"], several), []).append(
                    (row["budget"], row["tokens_per_s"])
                )
            elif label in ("ar", "hf"):
                baselines[_row_name(run, label, several)] = row["tokens_per_s"]
    return {method: points for method, points in series.items() if len(points) > 1}, baselines


def write_report(paths: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write ``report.md`` and its PNG charts into ``out_dir``; returns the files written (report first).

    Charts: speedup over ``ar`` per category (grouped bars), the accepted-length histogram of the drafting rows,
    and tokens/s against the draft budget when a run swept it.
    """
    runs = load_runs(paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    several = len(runs) > 1
    categories = _category_names(runs)
    charts: list[Path] = []
    speedups = _speedups(runs, categories, several)
    if speedups:
        charts.append(speedup_chart(speedups, categories, out / "speedup.png"))
    histograms = _histograms(runs, several)
    if histograms:
        charts.append(acceptance_length_chart(histograms, out / "accepted_lengths.png"))
    series, baselines = _budget_series(runs, several)
    if series:
        charts.append(budget_chart(series, baselines, out / "budget.png"))
    report = out / "report.md"
    report.write_text(markdown_report(runs, charts), encoding="utf-8")
    return [report, *charts]
