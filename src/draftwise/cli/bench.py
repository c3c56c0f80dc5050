"""``draftwise bench`` (every method, plain decoding and the engines users would pick instead, side by side; or an
interleaved A/B comparison; or batched runs) and ``draftwise report`` (a report with charts from its results)."""

from __future__ import annotations

import argparse
import sys

from ..bench.interleave import DEFAULT_ROUNDS
from ..bench.prompts import DATASETS
from ..bench.run import DEFAULT_METHODS, DEFAULT_PER_CATEGORY, BenchSettings
from ..errors import InvalidRequestError
from . import common
from .common import add_model_arguments, add_sampling_arguments, load_options, sampling_options, settle_heap

BENCH_DEFAULTS = BenchSettings(methods=[], model="")


def add_parsers(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="methods side by side with transformers' generate")
    bench.add_argument("--methods", default=None,
                       help="methods separated by ',' or ';' (ar, pld, aded, recycling..., hf, hf-pld, hf-assisted, "
                            "llama.cpp, llama.cpp-pld, llama.cpp-draft:model=M, llama.cpp-ngram); a spec's own options continue it: "
                            f"ar,pld:max_ngram=4,draft_length=6,recycling (default {DEFAULT_METHODS})")
    bench.add_argument("--method", action="append", default=None, help="one more method spec (repeatable)")
    bench.add_argument("--dataset", default=BENCH_DEFAULTS.dataset, choices=DATASETS)
    bench.add_argument("--data", default=BENCH_DEFAULTS.data,
                       help="jsonl prompt file: one {\"prompt\": ...}, {\"messages\": [...]} or {\"turns\": [...]} per "
                       "line (default: the Spec-Bench questions that ship with draftwise)")
    bench.add_argument("--per-category", type=int, default=DEFAULT_PER_CATEGORY,
                       help=f"prompts of each category (default {DEFAULT_PER_CATEGORY})")
    bench.add_argument("--prompts", type=int, default=BENCH_DEFAULTS.max_prompts, metavar="N",
                       help="at most N of the selected prompts, the categories taken in turn (default: all)")
    bench.add_argument("--seed-prompts", type=int, default=BENCH_DEFAULTS.seed_prompts,
                       help="sample each category's prompts with this seed (default: the first ones)")
    bench.add_argument("--categories", default=None,
                       help="comma-separated categories (or MT-Bench sub-categories: coding, math, ...) to keep")
    bench.add_argument("--turns", choices=["1", "2", "both"], default="1",
                       help="user turns to measure; later turns follow ar's answer to the first (default 1)")
    bench.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text (first turns only)")
    bench.add_argument("--max-new-tokens", type=int, default=BENCH_DEFAULTS.max_new_tokens,
                       help=f"most tokens each answer gets (default {BENCH_DEFAULTS.max_new_tokens})")
    bench.add_argument("--repeats", type=int, default=BENCH_DEFAULTS.repeats,
                       help="timed passes over the prompts, each with fresh drafters (medians reported; with "
                       "--batch-size, each batch size's rows run in turn N times)")
    bench.add_argument("--sweep", default=None, help="run each drafting method at several draft budgets: budget=4,8,16")
    bench.add_argument("--draft-model", default=None,
                       help="draft model of the hf-assisted row (preset, GGUF or folder)")
    bench.add_argument("--out", default=None, help="append each run to this jsonl results file as it finishes")
    bench.add_argument("--resume", action="store_true", help="continue the --out file of an interrupted run")
    bench.add_argument("--json", default=None, help="write the summary and every record as JSON here")
    bench.add_argument("--by-category", action="store_true", help="a table per category besides the overall one")
    bench.add_argument("--plot", default=None, metavar="PNG",
                       help="draw each row's speedup over ar, overall and per category, into this PNG file")
    bench.add_argument("--interleave", default=None, metavar="A;B",
                       help="A/B comparison instead, in one process: each of --rounds rounds runs every prompt under "
                       "A and under B (alternating which goes first) and reports B/A's median over the rounds with "
                       "its spread. A and B are method specs, optionally at a draft budget: \"ar;aded\", "
                       "\"pld@8;pld@16\", \"aded;aded:max_depth=4\"; \"aded;aded\" measures the machine's noise. "
                       "A dtype, backend or source tree needs a process of its own: alternate short runs of the two "
                       "(A, B, A, B...) and compare medians, or each tree's interleaved ratio over ar")
    bench.add_argument("--rounds", type=int, default=None,
                       help=f"rounds of --interleave (default {DEFAULT_ROUNDS})")
    bench.add_argument("--batch-size", default=None, metavar="N[,N...]",
                       help="batched run instead: all prompts submitted at once, decoded N at a time (aggregate "
                       "tokens/s, per-request latency, exact match vs batch size 1, which always runs)")
    add_sampling_arguments(bench)
    add_model_arguments(bench)
    bench.set_defaults(handler=run_bench)

    report = commands.add_parser("report", help="markdown report and charts from bench results files")
    report.add_argument("results", nargs="+", help="results files written by draftwise bench --out")
    report.add_argument("--out", required=True, help="folder for report.md and the PNG charts")
    report.set_defaults(handler=run_report)


def settings_of(args: argparse.Namespace, methods: list[str]) -> BenchSettings:
    """The bench flags as :class:`~draftwise.bench.BenchSettings` (the model flags as its ``load`` options)."""
    from ..api import sampling_params
    from ..bench import parse_sweep

    return BenchSettings(
        methods=methods,
        model=args.model,
        draft_model=args.draft_model,
        load=load_options(args),
        threads=args.threads,
        budgets=parse_sweep(args.sweep) if args.sweep else None,
        dataset=args.dataset,
        data=args.data,
        categories=args.categories.split(",") if args.categories else None,
        per_category=args.per_category,
        seed_prompts=args.seed_prompts,
        max_prompts=args.prompts,
        turns={"1": [1], "2": [2], "both": [1, 2]}[args.turns],
        repeats=args.repeats,
        max_new_tokens=args.max_new_tokens,
        chat_template=not args.no_chat_template,
        sampling=sampling_params(sampling_options(args)),
        out=args.out,
        resume=args.resume,
    )


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..bench import Benchmark, parse_methods, write_json
    from ..bench.batched import parse_batch_sizes
    from ..bench.interleave import parse_interleave
    from ..bench.report import floor_line, summary_tables, write_speedup_chart

    pair = parse_interleave(args.interleave) if args.interleave else None
    check_modes(args)
    if pair is not None:
        methods = [row.method for row in pair]
    else:
        methods = parse_methods(args.methods or DEFAULT_METHODS)
        methods += [spec for text in args.method or [] for spec in parse_methods(text)]
    settings = settings_of(args, methods)
    console = Console(stderr=True)
    batch_sizes = parse_batch_sizes(args.batch_size) if args.batch_size else None
    benchmark = Benchmark.prepare(settings, load_target=lambda: common.load(args, settings.load))
    settle_heap()  # (once the anchors' models, loaded after the target, are in too)
    if batch_sizes:
        return _run_batched(args, benchmark, batch_sizes, console)
    if pair is not None:
        return _run_interleaved(args, benchmark, pair, console)
    try:
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        ) as progress:
            task = progress.add_task("warming up", total=benchmark.planned_runs)

            def on_progress(label, prompt, rate):
                description = f"{label:>12} q{prompt.question_id} {prompt.category:<15} {rate:6.1f} tok/s"
                progress.update(task, advance=1, description=description)

            records = benchmark.run(on_progress, on_start=lambda done: progress.update(task, completed=done))
    except KeyboardInterrupt:
        if args.out:
            console.print(f"interrupted: finished runs are saved in {args.out}; continue with --resume")
        raise
    summary = benchmark.summary(records)
    output = Console() if sys.stdout.isatty() else Console(width=200)  # a file or pipe needs no wrapping
    for table in summary_tables(summary, by_category=args.by_category):
        output.print(table)
    floor = floor_line(summary, benchmark.environment)
    if floor:
        output.print(floor)
    if not args.by_category and len(summary) > 2:  # (categories besides overall: more than one)
        console.print("a table per category: add --by-category")
    if args.out:
        console.print(f"runs saved in {args.out} (draftwise report {args.out} --out DIR for a report with charts)")
    if args.json:
        write_json(args.json, summary, records, benchmark.environment,
                   {**benchmark.config, "prompts": len(benchmark.prompts)})
        console.print(f"results written to {args.json}")
    if args.plot:
        chart = write_speedup_chart(summary, args.plot)
        console.print(f"speedup chart written to {chart}" if chart else
                      "no chart: no row besides ar to compare with it")
    return 0


def check_modes(args: argparse.Namespace) -> None:
    """Refuse options of ``draftwise bench`` that its mode (--interleave, --batch-size or the side-by-side table)
    does not use, before anything slow starts."""
    if args.interleave:
        others = {
            "--methods": args.methods is not None, "--method": bool(args.method), "--batch-size": bool(args.batch_size),
            "--sweep": bool(args.sweep), "--turns": args.turns != "1", "--repeats": args.repeats != 1,
            "--out": bool(args.out), "--resume": args.resume, "--plot": bool(args.plot),
            "--by-category": args.by_category,
        }
        given = [name for name, present in others.items() if present]
        if given:
            raise InvalidRequestError(f"--interleave names its two configurations and runs first turns once a round: "
                                      f"drop {', '.join(given)}")
        if args.rounds is not None and args.rounds < 1:
            raise InvalidRequestError("--rounds must be at least 1")
    elif args.rounds is not None:
        raise InvalidRequestError("--rounds goes with --interleave")
    if args.batch_size and (args.plot or args.by_category):
        raise InvalidRequestError("--plot and --by-category go with the side-by-side table, not --batch-size")


def _run_interleaved(args: argparse.Namespace, benchmark, pair, console) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..bench.interleave import interleave_benchmark, write_interleave_json
    from ..bench.report import interleave_line, interleave_table

    prompts = len(benchmark.prompts)
    rounds = args.rounds if args.rounds is not None else DEFAULT_ROUNDS
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("warming up", total=2 * prompts * rounds)
        round_number = [1]

        def on_progress(side, prompt, rate) -> None:
            description = f"round {round_number[0]} {side} q{prompt.question_id} {rate:6.1f} tok/s"
            progress.update(task, advance=1, description=description)

        def on_round(finished) -> None:
            round_number[0] = finished.number + 1
            same = "" if finished.identical_ids is None else f", same ids {finished.identical_ids}/{prompts}"
            rates = f"A {finished.tokens_per_s('A'):.1f}, B {finished.tokens_per_s('B'):.1f} tok/s"
            progress.console.print(f"round {finished.number} ({finished.first} first): {rates}, "
                                   f"B/A {finished.ratio:.3f}x{same}")

        result = interleave_benchmark(benchmark, pair, rounds, on_progress, on_round)
    summary = result.summary()
    round_summaries = [round_.summary() for round_ in result.rounds]
    output = Console() if sys.stdout.isatty() else Console(width=200)
    output.print(interleave_table(round_summaries, summary, benchmark.settings.max_new_tokens))
    output.print(interleave_line(summary))
    if summary["identical_ids"] is not None and summary["identical_ids"] < summary["compared_runs"]:
        console.print(f"warning: A and B gave different ids in {summary['compared_runs'] - summary['identical_ids']} "
                      f"of {summary['compared_runs']} runs (lossless methods give identical ids when greedy)")
    if args.json:
        settings = {**benchmark.config, "prompts": prompts, "interleave": [pair[0].label, pair[1].label],
                    "rounds": rounds}
        write_interleave_json(args.json, result, benchmark.environment, settings)
        console.print(f"results written to {args.json}")
    return 0


def _run_batched(args: argparse.Namespace, benchmark, batch_sizes: list[int], console) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..bench.batched import batch_table_rows, write_batched_json

    if benchmark.unbatched_rows:
        console.print(f"left out at --batch-size (they decode one sequence at a time): {', '.join(benchmark.unbatched_rows)}")
    console.print(f"{len(benchmark.prompts)} prompts, batch sizes {batch_sizes}: warming up")

    def on_record(record) -> None:
        passes = record.pass_tokens_per_s
        spread = f" (passes {min(passes):.1f}-{max(passes):.1f})" if len(passes) > 1 else ""
        console.print(f"{record.label:>12} batch {record.batch_size:>3}: {record.tokens_per_s:7.1f} tok/s{spread}, "
                      f"exact vs batch 1 {record.exact}/{record.prompts}")

    records = benchmark.run_batched(batch_sizes, on_record)
    rows = batch_table_rows(records)
    table = Table(title=f"batched: {len(benchmark.prompts)} prompts, {benchmark.settings.max_new_tokens} new tokens each")
    columns = ["row", "batch_size", "tokens_per_s", "tokens_per_s_range", "vs_batch_1", "vs_ar", "mean_accepted_tokens",
               "latency_p50_s", "latency_p90_s", "queued_latency_p90_s", "exact_vs_batch_1", "exact_vs_ar"]
    if benchmark.settings.repeats == 1:
        columns.remove("tokens_per_s_range")
    for column in columns:
        table.add_column(column.replace("_", " "), justify="left" if column == "row" else "right")
    def cell(value) -> str:
        if value is None:
            return "-"
        return "-".join(map(str, value)) if isinstance(value, list) else str(value)  # (a range: low-high)

    for row in rows:
        table.add_row(*(cell(row[column]) for column in columns))
    (Console() if sys.stdout.isatty() else Console(width=200)).print(table)
    if args.json:
        write_batched_json(args.json, rows, records, benchmark.environment,
                           {**benchmark.config, "prompts": len(benchmark.prompts), "batch_sizes": batch_sizes})
        console.print(f"results written to {args.json}")
    return 0


def run_report(args: argparse.Namespace) -> int:
    from ..bench.report import write_report

    written = write_report(args.results, args.out)
    print(f"report written to {written[0]}" + (f" with {len(written) - 1} charts" if len(written) > 1 else ""))
    return 0

