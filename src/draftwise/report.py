"""Tables of benchmark summaries."""

from __future__ import annotations

from rich.table import Table

from .bench import OVERALL


def _format(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def summary_tables(summary: dict[str, dict[str, dict]]) -> list[Table]:
    """One table per category and one overall: tok/s, speedups, MAT, exact match against ``ar``."""
    tables = []
    for category in [*(name for name in summary if name != OVERALL), OVERALL]:
        rows = summary[category]
        any_row = next(iter(rows.values()))
        table = Table(title=f"{category} ({any_row['prompts']} prompts)", title_justify="left")
        for column in ("method", "tok/s", "vs ar", "vs hf", "vs ar (mean rate)", "MAT", "exact vs ar"):
            table.add_column(column, justify="left" if column == "method" else "right")
        for method, row in rows.items():
            table.add_row(
                method,
                _format(row["tokens_per_s"], "{:.1f}"),
                _format(row["speedup_vs_ar"], "{:.2f}x"),
                _format(row["speedup_vs_hf"], "{:.2f}x"),
                _format(row["speedup_vs_ar_mean_rate"], "{:.2f}x"),
                _format(row["mat"], "{:.2f}"),
                _format(row["exact_match_vs_ar"], "{:.0%}"),
            )
        tables.append(table)
    return tables
