"""``draftwise loadtest``: load test a running OpenAI-compatible server at one or more concurrencies, with
guidellm's metrics; a table, JSON and a chart, beside earlier runs of other servers."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import DraftwiseError, InvalidRequestError
from ..models import DEFAULT_MODEL
from ..serve.access import API_KEY_VARIABLE
from ..serve.load import DEFAULT_REQUESTS_PER_CLIENT, DEFAULT_SWEEP

#: Concurrent requests of one level unless told otherwise.
DEFAULT_CONCURRENCY = 16


def add_parser(commands: argparse._SubParsersAction) -> None:
    loadtest = commands.add_parser(
        "loadtest",
        help="load test a running OpenAI-compatible server at one or more concurrencies (guidellm's metrics)")
    loadtest.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 address")
    loadtest.add_argument("--model", default=DEFAULT_MODEL,
                          help="the served model name; also the tokenizer of synthetic prompts unless --tokenizer")
    loadtest.add_argument("--concurrency", type=int, default=None,
                          help=f"concurrent requests (default {DEFAULT_CONCURRENCY})")
    loadtest.add_argument("--sweep", nargs="?", const="", default=None, metavar="C1,C2,...",
                          help="one level per concurrency, one after the other (default "
                          f"{','.join(map(str, DEFAULT_SWEEP))})")
    loadtest.add_argument("--requests", type=int, default=None, help="requests per level (default: --per-client)")
    loadtest.add_argument("--per-client", type=int, default=DEFAULT_REQUESTS_PER_CLIENT,
                          help="without --requests: requests per concurrent client, at least twice this many per level")
    loadtest.add_argument("--max-tokens", "--output-tokens", dest="max_tokens", type=int, default=128,
                          help="tokens per answer (synthetic data: exactly this many, with ignore_eos)")
    loadtest.add_argument("--data", default="spec-bench", choices=["spec-bench", "synthetic"],
                          help="Spec-Bench questions, or synthetic prompts of --prompt-tokens tokens cut from them")
    loadtest.add_argument("--turns", type=int, default=1,
                          help="conversation profile: each client's conversation has this many turns, each follow-up "
                               "resending the conversation so far with a short question (default 1: single requests; "
                               "--requests and --per-client then count conversations)")
    loadtest.add_argument("--prompt-tokens", type=int, default=256, help="tokens per synthetic prompt")
    loadtest.add_argument("--tokenizer", default=None, help="tokenizer folder or preset for synthetic prompts")
    loadtest.add_argument("--per-category", type=int, default=3, help="Spec-Bench prompts per category")
    loadtest.add_argument("--data-file", default=None,
                          help="Spec-Bench question file (default: the copy that ships with draftwise)")
    loadtest.add_argument("--cache-dir", default=None, help="converted checkpoints (where --model's tokenizer is)")
    loadtest.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT or ITL)")
    loadtest.add_argument("--completions", action="store_true", help="text completions instead of chat")
    loadtest.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    loadtest.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    loadtest.add_argument("--extra-body", default=None, metavar="JSON",
                          help="more fields for every request, e.g. a server's own options")
    loadtest.add_argument("--warmup", type=int, default=1, help="unmeasured requests before the first level")
    loadtest.add_argument("--api-key", default=None,
                          help=f"the server's API key, sent as 'Authorization: Bearer KEY' (default: the "
                          f"{API_KEY_VARIABLE} environment variable where set)")
    loadtest.add_argument("--label", default=None, help="the server's name in tables and charts (default: --url)")
    loadtest.add_argument("--json", default=None, help="write the levels here (read back by --compare)")
    loadtest.add_argument("--plot", default=None, help="PNG chart: output tok/s, TTFT and ITL against concurrency")
    loadtest.add_argument("--compare", nargs="*", default=[], metavar="RESULTS.json",
                          help="earlier --json results (other servers) shown beside this run")
    loadtest.add_argument("--no-run", action="store_true",
                          help="send nothing: only the table (and --plot) of --compare")
    loadtest.set_defaults(handler=run)


def _concurrency_levels(args: argparse.Namespace) -> list[int]:
    if args.sweep is not None and args.concurrency is not None:
        raise InvalidRequestError("give --concurrency or --sweep, not both")
    if args.sweep is None:
        return [args.concurrency if args.concurrency is not None else DEFAULT_CONCURRENCY]
    if args.sweep == "":
        return list(DEFAULT_SWEEP)
    try:
        levels = [int(part) for part in args.sweep.split(",")]
    except ValueError:
        raise InvalidRequestError(f"--sweep takes concurrencies such as 1,4,16, not {args.sweep!r}") from None
    return levels


def _loadtest_prompts(args: argparse.Namespace, count: int) -> list[str]:
    """Spec-Bench questions, or ``count`` distinct synthetic prompts."""
    from ..bench.prompts import load_spec_bench

    if args.data == "spec-bench":
        return [prompt.text for prompt in load_spec_bench(args.data_file, per_category=args.per_category)]
    from transformers import AutoTokenizer

    from ..models import resolve_checkpoint
    from ..serve.load import synthetic_prompts

    source = args.tokenizer or args.model
    try:
        folder = source if os.path.isdir(source) else str(resolve_checkpoint(source, args.cache_dir, progress=False))
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, DraftwiseError) as error:
        raise InvalidRequestError(f"synthetic prompts need the model's tokenizer: pass --tokenizer ({error})") from None
    corpus = [prompt.text for prompt in load_spec_bench(args.data_file)]  # the whole file: many distinct windows
    return synthetic_prompts(tokenizer, corpus, count, args.prompt_tokens)


def _print_load_table(runs: dict[str, list[dict]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="load test (guidellm's metrics: TTFT, ITL, TPOT in ms; request latency in s)")
    turns = any("follow_up_time_to_first_token_ms" in level["metrics"] for levels in runs.values() for level in levels)
    for column in ("server", "concurrency", "ok", "failed", "output tok/s", "req/s", "TTFT p50", "TTFT p99",
                   *(("TTFT p50 turn 1", "TTFT p50 follow-ups", "cached") if turns else ()),
                   "ITL p50", "TPOT p50", "latency p50", "latency p99", "drafting", "MAL", "tok/step"):
        table.add_column(column, justify="left" if column == "server" else "right")

    def number(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for label, levels in runs.items():
        for level in levels:
            metrics, speculation = level["metrics"], level.get("speculation") or {}
            ttft, itl = metrics["time_to_first_token_ms"] or {}, metrics["inter_token_latency_ms"] or {}
            tpot, latency = metrics["time_per_output_token_ms"] or {}, metrics["request_latency"] or {}
            table.add_row(
                label, str(level["concurrency"]), str(metrics["request_totals"]["successful"]),
                str(metrics["request_totals"]["errored"] + metrics["request_totals"].get("incomplete", 0)),
                number(metrics["output_tokens_per_second"], 2),
                number(metrics["requests_per_second"], 3), number(ttft.get("median"), 0), number(ttft.get("p99"), 0),
                *((number((metrics.get("first_turn_time_to_first_token_ms") or {}).get("median"), 0),
                   number((metrics.get("follow_up_time_to_first_token_ms") or {}).get("median"), 0),
                   number(metrics.get("follow_up_cached_prompt_tokens"), 0)) if turns else ()),
                number(itl.get("median")), number(tpot.get("median")), number(latency.get("median"), 2),
                number(latency.get("p99"), 2),
                f"{speculation['drafting_share']:.0%}" if "drafting_share" in speculation else "-",
                number(speculation.get("mean_acceptance_length"), 2),
                number(speculation.get("tokens_per_sequence_step"), 2),
            )
    # Piped to a file the table keeps every column whole (rich would cut it to 80 characters).
    Console(width=None if sys.stdout.isatty() else 180).print(table)


def run(args: argparse.Namespace) -> int:
    """Load test a running server at one concurrency or a sweep of them; table, JSON and chart."""
    from ..serve.load import read_results

    levels = _concurrency_levels(args)
    if min(levels) < 1 or (args.requests is not None and args.requests < 1) or args.max_tokens < 1 \
            or args.per_client < 1:
        raise InvalidRequestError("--requests, --per-client, --concurrency/--sweep and --max-tokens must be positive")
    if args.prompt_tokens < 1 or args.warmup < 0 or args.turns < 1:
        raise InvalidRequestError("--prompt-tokens and --turns must be positive and --warmup at least 0")
    compared = {}
    for path in args.compare:
        try:
            label, compared_levels = read_results(path)
        except InvalidRequestError as error:
            raise InvalidRequestError(f"--compare: {error}") from None
        compared[label] = compared_levels
    reports = []
    if args.no_run:
        if not compared:
            raise InvalidRequestError("--no-run shows --compare results: give some")
        runs = compared
    else:
        reports = _run_loadtest(args, levels)
        runs = {args.label or args.url: [report.summary() for report in reports], **compared}
    _print_load_table(runs)
    if args.plot:
        from ..bench.plots import load_chart

        load_chart(runs, args.plot)
    for report in reports:
        for error in report.errors[:5] + report.incomplete[:5]:
            print(error, file=sys.stderr)
    return 1 if any(report.errors or report.incomplete for report in reports) else 0


def _run_loadtest(args: argparse.Namespace, levels: list[int]) -> list:
    """``draftwise loadtest``'s levels against the server (their JSON written when asked)."""
    from ..serve.load import requests_for, sweep, write_results

    try:
        extra_body = json.loads(args.extra_body) if args.extra_body else None
    except json.JSONDecodeError as error:
        raise InvalidRequestError(f"--extra-body is not JSON: {error}") from None
    if extra_body is not None and not isinstance(extra_body, dict):
        raise InvalidRequestError("--extra-body must be a JSON object")
    most_requests = max(args.requests or 0, *(requests_for(level, args.per_client) for level in levels))
    prompts = _loadtest_prompts(args, most_requests)
    synthetic = args.data == "synthetic"

    def progress(report) -> None:
        metrics = report.metrics()
        totals = metrics["request_totals"]
        print(f"concurrency {report.concurrency}: {totals['successful']} ok, {totals['errored']} errors, "
              f"{totals['incomplete']} incomplete, {metrics['output_tokens_per_second']:.2f} output tok/s",
              file=sys.stderr)

    reports = sweep(args.url, args.model, prompts, levels, args.max_tokens, requests=args.requests,
                    per_client=args.per_client, warmup=args.warmup, on_level=progress, chat=not args.completions,
                    stream=not args.no_stream, ignore_eos=synthetic or args.ignore_eos, temperature=args.temperature,
                    extra_body=extra_body, api_key=args.api_key or os.environ.get(API_KEY_VARIABLE), turns=args.turns)
    if args.json:
        settings = {"url": args.url, "model": args.model, "data": args.data, "stream": not args.no_stream,
                    "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens if synthetic else None,
                    "ignore_eos": synthetic or args.ignore_eos, "temperature": args.temperature,
                    "endpoint": "completions" if args.completions else "chat", "extra_body": extra_body,
                    "turns": args.turns}
        write_results(args.json, args.label or args.url, settings, reports)
    return reports

