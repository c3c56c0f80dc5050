"""The benchmark: prompts, runs of every method side by side, metrics, results files, reports and charts.

- :mod:`.prompts`: Spec-Bench, HumanEval and prompt files.
- :mod:`.run`: rows, drafters, one timed run per row and prompt, a whole benchmark (:class:`~.run.Benchmark`).
- :mod:`.interleave`: two configurations compared round by round in one process (``--interleave "A;B"``).
- :mod:`.results`: run records, the resumable results file and the JSON summary.
- :mod:`.metrics`: speedups, MAT, acceptance, exact match, per category and overall.
- :mod:`.environment`: what a run was measured on.
- :mod:`.report` and :mod:`.plots`: tables, a markdown report and charts.
"""

from .anchors import ANCHOR_ROWS
from .environment import PeakMemoryMeter, environment, model_digest
from .interleave import InterleaveResult, InterleaveRound, parse_interleave, run_interleaved
from .metrics import (
    BASELINES,
    complete_runs,
    first_divergence,
    mean_question_rate,
    per_repeat,
    position_rates,
    ratio,
    sum_histograms,
    summarize,
    total_rate,
)
from .results import OVERALL, Record, ResultsWriter, read_results, results_header, row_label, write_json
from .run import (
    EXTERNAL_ROWS,
    HF_ROWS,
    Benchmark,
    BenchSettings,
    Measurement,
    Row,
    RowTimer,
    build_drafters,
    measure_draftwise,
    measure_hf,
    parse_methods,
    parse_sweep,
    plan_rows,
    planned_runs,
    run_bench,
    validate_methods,
)

__all__ = [
    "ANCHOR_ROWS",
    "BASELINES",
    "EXTERNAL_ROWS",
    "HF_ROWS",
    "OVERALL",
    "BenchSettings",
    "Benchmark",
    "InterleaveResult",
    "InterleaveRound",
    "Measurement",
    "PeakMemoryMeter",
    "Record",
    "ResultsWriter",
    "Row",
    "RowTimer",
    "build_drafters",
    "complete_runs",
    "environment",
    "first_divergence",
    "mean_question_rate",
    "measure_draftwise",
    "measure_hf",
    "model_digest",
    "parse_interleave",
    "parse_methods",
    "parse_sweep",
    "per_repeat",
    "plan_rows",
    "planned_runs",
    "position_rates",
    "ratio",
    "read_results",
    "results_header",
    "row_label",
    "run_bench",
    "run_interleaved",
    "sum_histograms",
    "summarize",
    "total_rate",
    "validate_methods",
    "write_json",
]
