"""Benchmark metrics, per category and overall, over the runs that every row completed (formulas as in
:mod:`draftwise.decoding.stats`):

- ``tokens_per_s``: total new tokens / total time of each repeat; the median over repeats, with its min and max.
- ``mean_rate``: Spec-Bench's per-question rate (a question's tokens / its time, turns summed), averaged over
  questions; the median over repeats.
- ``speedup_vs_ar`` / ``speedup_vs_hf``: ratios of ``tokens_per_s``; ``..._mean_rate``: ratios of ``mean_rate``.
- ``mat``: total new tokens / total steps; ``acceptance_rate``: accepted / drafted tokens; per position too.
- ``exact_match_vs_ar``: share of runs whose token ids equal ``ar``'s; ``first_divergence``: the mean index of the
  first differing token over the runs that differ.
- ``time_to_first_token_s``: median over runs.
- ``decode_ms_per_token``: milliseconds a token after each run's first one (its prefill left out): the time that the
  bandwidth floor of :mod:`draftwise.bench.environment` bounds.
- ``peak_memory_bytes``: the largest per-run peak.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .results import OVERALL, Record

BASELINES = ("ar", "hf")


def percentile(values: Sequence[float], percent: float) -> float:
    """The ``percent``-th percentile of ``values`` (linear interpolation; 0 when empty)."""
    if not values:
        return 0.0
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=100, method="inclusive")[round(percent) - 1])


def first_divergence(reference: Sequence[int], ids: Sequence[int]) -> int | None:
    """Index of the first token where ``ids`` differs from ``reference`` (the shorter length when one is a prefix
    of the other); ``None`` when they are equal."""
    for index, (expected, actual) in enumerate(zip(reference, ids)):
        if expected != actual:
            return index
    return None if len(reference) == len(ids) else min(len(reference), len(ids))


def total_rate(records: Iterable[Record]) -> float:
    """Total new tokens / total seconds."""
    records = list(records)
    seconds = sum(record.time_s for record in records)
    return sum(record.new_tokens for record in records) / seconds if seconds > 0 else 0.0


def mean_question_rate(records: Iterable[Record]) -> float:
    """Spec-Bench's mean per-question rate: each question's tokens / its seconds (its turns summed), averaged."""
    by_question: dict[Any, list[Record]] = defaultdict(list)
    for record in records:
        by_question[record.question_id].append(record)
    rates = [total_rate(group) for group in by_question.values()]
    return sum(rates) / len(rates) if rates else 0.0


def per_repeat(records: Iterable[Record], metric: Callable[[list[Record]], float]) -> list[float]:
    """``metric`` of each repeat's records, in repeat order."""
    by_repeat: dict[int, list[Record]] = defaultdict(list)
    for record in records:
        by_repeat[record.repeat].append(record)
    return [metric(by_repeat[repeat]) for repeat in sorted(by_repeat)]


def ratio(value: float | None, baseline: float | None) -> float | None:
    """``value / baseline``, ``None`` when either is missing or the baseline is 0."""
    return value / baseline if value is not None and baseline else None


def position_rates(records: Iterable[Record]) -> list[float]:
    """Acceptance rate at each draft depth: accepts / attempts summed over ``records``."""
    attempts: list[int] = []
    accepts: list[int] = []
    for record in records:
        for position, (tried, taken) in enumerate(zip(record.attempts_per_position, record.accepts_per_position)):
            if position == len(attempts):
                attempts.append(0)
                accepts.append(0)
            attempts[position] += tried
            accepts[position] += taken
    return [taken / tried if tried else 0.0 for taken, tried in zip(accepts, attempts)]


def sum_histograms(histograms: Iterable[Sequence[int]]) -> list[int]:
    """Entry-wise sum of histograms of any lengths."""
    total: list[int] = []
    for histogram in histograms:
        total += [0] * (len(histogram) - len(total))
        for index, count in enumerate(histogram):
            total[index] += count
    return total


def complete_runs(records: Sequence[Record]) -> list[Record]:
    """The measured records of the (question, turn, repeat) runs that every row finished (a partial run leaves some
    rows one prompt behind; comparing rows on different prompts would bias their ratios)."""
    measured = [record for record in records if not record.context_only]
    labels = {record.label for record in measured}
    rows_per_run: dict[tuple[Any, int, int], set[str]] = defaultdict(set)
    for record in measured:
        rows_per_run[(record.question_id, record.turn, record.repeat)].add(record.label)
    return [record for record in measured if rows_per_run[(record.question_id, record.turn, record.repeat)] == labels]


def _row_summary(mine: list[Record], reference: Mapping[tuple[Any, int], list[int]]) -> dict[str, Any]:
    steps = [record.steps for record in mine]
    drafted = [record.drafted_tokens for record in mine]
    accepted = [record.accepted_tokens for record in mine]
    tokens = sum(record.new_tokens for record in mine)
    rates = per_repeat(mine, total_rate)
    compared = [
        (reference.get((record.question_id, record.turn)), record.token_ids) for record in mine
    ]  # a run without an ar run to compare with does not match
    matches = sum(1 for expected, ids in compared if expected is not None and first_divergence(expected, ids) is None)
    diverged = [
        position
        for expected, ids in compared
        if expected is not None and (position := first_divergence(expected, ids)) is not None
    ]
    first_tokens = [record.time_to_first_token_s for record in mine if record.time_to_first_token_s is not None]
    memory = [record.peak_memory_bytes for record in mine if record.peak_memory_bytes is not None]
    decoded = [(record.time_s - record.time_to_first_token_s, record.new_tokens - 1) for record in mine
               if record.time_to_first_token_s is not None and record.new_tokens > 1]
    decoded_tokens = sum(count for _, count in decoded)
    return {
        "method": mine[0].method,
        "budget": mine[0].budget,
        "prompts": len({(record.question_id, record.turn) for record in mine}),
        "questions": len({record.question_id for record in mine}),
        "repeats": len(rates),
        "new_tokens": tokens,
        "time_s": sum(record.time_s for record in mine),
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "mean_rate": statistics.median(per_repeat(mine, mean_question_rate)),
        "mat": tokens / sum(steps) if None not in steps and sum(steps) else None,
        "acceptance_rate": sum(accepted) / sum(drafted) if None not in drafted and sum(drafted) else None,
        "acceptance_per_position": position_rates(mine),
        "accepted_length_histogram": sum_histograms(record.accepted_length_histogram for record in mine),
        "exact_match_vs_ar": matches / len(mine),
        "first_divergence": sum(diverged) / len(diverged) if diverged else None,
        "time_to_first_token_s": statistics.median(first_tokens) if first_tokens else None,
        "decode_ms_per_token": 1000 * sum(seconds for seconds, _ in decoded) / decoded_tokens if decoded_tokens else None,
        "peak_memory_bytes": max(memory) if memory else None,
    }


def summarize(
    records: Sequence[Record], methods: Sequence[str] | None = None
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per category (and ``overall``) per row label: the metrics of this module's docstring.

    ``methods`` orders the rows (default: order of first appearance); only runs every row completed count.
    """
    records = complete_runs(records)
    labels = list(methods) if methods is not None else list(dict.fromkeys(record.label for record in records))
    reference: dict[tuple[Any, int], list[int]] = {}
    for record in sorted(records, key=lambda record: record.repeat):
        if record.label == "ar":
            reference.setdefault((record.question_id, record.turn), record.token_ids)
    categories = sorted({record.category for record in records})
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for category in [*categories, OVERALL]:
        chosen = [record for record in records if category == OVERALL or record.category == category]
        rows: dict[str, dict[str, Any]] = {}
        for label in labels:
            mine = [record for record in chosen if record.label == label]
            if mine:
                rows[label] = _row_summary(mine, reference)
        for row in rows.values():
            for baseline in BASELINES:
                base = rows.get(baseline)
                row[f"speedup_vs_{baseline}"] = ratio(row["tokens_per_s"], base and base["tokens_per_s"])
                row[f"speedup_vs_{baseline}_mean_rate"] = ratio(row["mean_rate"], base and base["mean_rate"])
        summary[category] = rows
    return summary
