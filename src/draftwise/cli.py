"""The ``draftwise`` command: generate, bench, models."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch

from .data import DATASETS
from .errors import DraftwiseError
from .models import DEFAULT_MODEL, PRESETS, default_cache_dir, install_preset, is_installed


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"preset, GGUF file or checkpoint folder (default {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default="float32", help="weights dtype (default float32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--cache-dir", default=None, help=f"converted checkpoints (default {default_cache_dir()})")


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (transformers' meanings; temperature 0 = greedy)")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--seed", type=int, default=None)


def _sampling_options(args: argparse.Namespace) -> dict:
    return {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
    }


def _load(args: argparse.Namespace):
    from .models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise DraftwiseError("give the prompt as an argument or with --prompt-file, not both")
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as handle:
            return handle.read()
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if sys.stdin.isatty() and args.prompt is None:
        raise DraftwiseError("no prompt: pass it as an argument, with --prompt-file, or on standard input")
    return sys.stdin.read()


def cmd_generate(args: argparse.Namespace) -> int:
    from .api import stream

    from .drafters import make_drafter

    prompt = _read_prompt(args)
    drafter = make_drafter(args.method)
    if args.state is not None:
        if not hasattr(drafter, "load"):
            raise DraftwiseError(f"method {args.method!r} keeps no state; --state applies to learning drafters")
        if os.path.exists(args.state):
            drafter.load(args.state)
    model, tokenizer = _load(args)
    chat = not args.no_chat_template and bool(getattr(tokenizer, "chat_template", None))
    pieces = stream(
        model,
        tokenizer,
        prompt,
        method=drafter,
        max_new_tokens=args.max_new_tokens,
        stop=args.stop,
        chat_template=chat,
        budget=args.budget,
        **_sampling_options(args),
    )
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    result = pieces.result
    if args.state is not None:
        drafter.save(args.state)
    if args.stats:
        stats = result.stats
        summary = {
            "method": result.method,
            "finish_reason": result.finish_reason,
            "new_tokens": stats.new_tokens,
            "steps": stats.steps,
            "mean_accepted_tokens": round(stats.mean_accepted_tokens, 3),
            "drafted_tokens": stats.drafted_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "acceptance_rate": round(stats.acceptance_rate, 3),
            "acceptance_per_position": [round(rate, 3) for rate in stats.acceptance_per_position],
            "tokens_per_s": round(stats.tokens_per_s, 2),
            "time_to_first_token_s": round(stats.time_to_first_token_s, 4),
            "time_s": round(stats.time_s, 3),
        }
        print(json.dumps(summary, indent=1), file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .api import sampling_params
    from .bench import (
        ResultsWriter,
        environment,
        parse_methods,
        parse_sweep,
        plan_rows,
        planned_runs,
        results_header,
        run_bench,
        summarize,
        validate_methods,
        write_json,
    )
    from .data import load_dataset
    from .models import load_model
    from .report import summary_tables

    if args.max_new_tokens <= 0 or args.per_category is not None and args.per_category <= 0:
        raise DraftwiseError("--max-new-tokens and --per-category must be positive")
    if args.repeats < 1:
        raise DraftwiseError("--repeats must be at least 1")
    if args.resume and not args.out:
        raise DraftwiseError("--resume continues a results file: give it with --out")
    specs = parse_methods(args.methods) + [spec for text in args.method or [] for spec in parse_methods(text)]
    if args.draft_model and "hf-assisted" not in specs:
        specs.append("hf-assisted")
    if "hf-assisted" in specs and not args.draft_model:
        raise DraftwiseError("hf-assisted needs a draft model: give it with --draft-model")
    methods = validate_methods(specs)
    budgets = parse_sweep(args.sweep) if args.sweep else None
    rows = plan_rows(methods, budgets)
    turns = {"1": [1], "2": [2], "both": [1, 2]}[args.turns]
    sampling = sampling_params(_sampling_options(args))
    categories = args.categories.split(",") if args.categories else None
    prompts = load_dataset(args.dataset, args.data, args.per_category, args.seed_prompts, categories)
    if not prompts:
        raise DraftwiseError("no prompts selected")
    console = Console(stderr=True)
    model, tokenizer = _load(args)
    draft_model = None
    if args.draft_model:
        draft_model, _ = load_model(args.draft_model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
    config = {
        "model": args.model,
        "draft_model": args.draft_model,
        "dtype": args.dtype,
        "device": args.device,
        "methods": methods,
        "rows": [row.label for row in rows],
        "sweep_budgets": budgets,
        "dataset": args.dataset,
        "data": os.path.abspath(args.data) if args.data else None,
        "categories": categories,
        "per_category": args.per_category,
        "seed_prompts": args.seed_prompts,
        "questions": [prompt.question_id for prompt in prompts],
        "turns": turns,
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "chat_template": not args.no_chat_template,
        "sampling": _sampling_options(args),
    }
    env = environment(model, args.model, draft_model=draft_model, draft_model_name=args.draft_model)
    writer = ResultsWriter.open(args.out, results_header(config, env), args.resume) if args.out else None
    previous = writer.records if writer else []
    try:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            done = sum(1 for record in previous if not record.context_only)
            task = progress.add_task("warming up", total=planned_runs(prompts, rows, turns, args.repeats), completed=done)

            def on_progress(label, prompt, rate):
                description = f"{label:>12} q{prompt.question_id} {prompt.category:<15} {rate:6.1f} tok/s"
                progress.update(task, advance=1, description=description)

            records = run_bench(
                model, tokenizer, prompts, methods, args.max_new_tokens, on_progress, sampling=sampling, turns=turns,
                repeats=args.repeats, budgets=budgets, chat_template=not args.no_chat_template,
                draft_model=draft_model, previous=previous, on_record=writer.append if writer else None,
            )
    except KeyboardInterrupt:
        if writer is not None:
            console.print(f"interrupted: finished runs are saved in {args.out}; continue with --resume")
        raise
    finally:
        if writer is not None:
            writer.close()
    summary = summarize(records, [row.label for row in rows])
    output = Console() if sys.stdout.isatty() else Console(width=200)  # a file or pipe needs no wrapping
    for table in summary_tables(summary):
        output.print(table)
    if args.out:
        console.print(f"runs saved in {args.out} (draftwise report {args.out} --out DIR for a report with charts)")
    if args.json:
        settings = {**config, "prompts": len(prompts)}
        write_json(args.json, summary, records, env, settings)
        console.print(f"results written to {args.json}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .report import write_report

    written = write_report(args.results, args.out)
    print(f"report written to {written[0]}" + (f" with {len(written) - 1} charts" if len(written) > 1 else ""))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    if args.action == "install":
        for name in args.names or [DEFAULT_MODEL]:
            install_preset(name)
            print(f"installed {name}")
        return 0
    for name, preset in PRESETS.items():
        state = "installed" if is_installed(preset) else f"not installed ({preset.install_command})"
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name:<22}{preset.model}{default}: {state}")
    return 0


def cmd_datastore(args: argparse.Namespace) -> int:
    """Build a REST datastore from corpus sources (and optionally the model's own answers to some prompts)."""
    import time

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .datastore import Datastore, gather_tokens, tokenizer_identity

    console = Console(stderr=True)
    started = time.perf_counter()
    _, tokenizer, texts = _corpus_texts(args)
    with Progress(
        TextColumn("tokenizing"), BarColumn(), TextColumn("{task.completed:,} / {task.total:,} tokens"),
        TimeElapsedColumn(), console=console,
    ) as progress:
        task = progress.add_task("tokens", total=args.max_tokens)
        pieces = gather_tokens(tokenizer, texts, args.max_tokens, lambda gathered: progress.update(task, completed=gathered))
    with console.status("sorting suffixes"):
        datastore = Datastore.from_documents(pieces, **tokenizer_identity(tokenizer))
        datastore.save(args.out)
    size = os.path.getsize(args.out) / 1e6
    console.print(
        f"datastore {args.out}: {len(datastore):,} tokens in {datastore.documents:,} pieces, {size:.0f} MB, "
        f"built in {time.perf_counter() - started:.0f} s"
    )
    return 0


def _corpus_texts(args: argparse.Namespace):
    """Model, tokenizer and the texts of a corpus command's sources (the model's own answers first), with every
    source checked before anything slow starts."""
    import itertools

    from .sources import documents, read_prompt_file, self_generated_documents, source_documents

    if args.max_tokens <= 0 or args.max_new_tokens <= 0:
        raise DraftwiseError("--max-tokens and --max-new-tokens must be positive")
    if not args.sources and args.self_generate is None:
        raise DraftwiseError("give at least one source (a path, stdlib, package-docs or sharegpt) or --self-generate")
    for spec in args.sources:
        source_documents(spec)  # refuses unknown and benchmark sources before any slow work
    prompts = read_prompt_file(args.self_generate) if args.self_generate is not None else []
    model, tokenizer = _load(args)
    if tokenizer is None:
        raise DraftwiseError(f"{args.model} has no tokenizer to build a corpus with")
    texts = itertools.chain(
        self_generated_documents(model, tokenizer, prompts, args.max_new_tokens) if prompts else (),
        documents(args.sources) if args.sources else (),
    )
    return model, tokenizer, texts


def cmd_corpus(args: argparse.Namespace) -> int:
    """Count the tri-grams of corpus sources into a store for ``--method aded:corpus=OUT``."""
    import time

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .sources import tokenize_documents
    from .trigram import TrigramCounter

    if args.top_k <= 0 or args.max_pairs <= 0:
        raise DraftwiseError("--top-k and --max-pairs must be positive")
    console = Console(stderr=True)
    started = time.perf_counter()
    _, tokenizer, texts = _corpus_texts(args)
    counter = TrigramCounter()
    with Progress(
        TextColumn("counting tri-grams"), BarColumn(), TextColumn("{task.completed:,} / {task.total:,} tokens"),
        TimeElapsedColumn(), console=console,
    ) as progress:
        task = progress.add_task("tokens", total=args.max_tokens)
        for ids in tokenize_documents(tokenizer, texts, args.max_tokens):
            counter.add(ids)
            progress.update(task, completed=counter.tokens_seen)
    with console.status("keeping the strongest successors"):
        store = counter.store(top_k=args.top_k, max_pairs=args.max_pairs)
        store.save(args.out, tokenizer=getattr(tokenizer, "name_or_path", "") or "", tokens=counter.tokens_seen)
    size = os.path.getsize(args.out) / 1e6
    console.print(
        f"tri-gram store {args.out}: {counter.tokens_seen:,} tokens counted, {len(store):,} token pairs kept, "
        f"{size:.0f} MB, built in {time.perf_counter() - started:.0f} s"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftwise", description="Lossless draft-and-verify decoding.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from a prompt (argument, --prompt-file or stdin)")
    gen.add_argument("prompt", nargs="?", help="the prompt; '-' or nothing reads standard input")
    gen.add_argument("--prompt-file", default=None)
    gen.add_argument("--method", default="pld", help="ar, pld, or a spec like pld:max_ngram=3 (default pld)")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--stop", action="append", default=None, help="stop sequence (repeatable)")
    gen.add_argument("--budget", type=int, default=16, help="most draft nodes per step")
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    gen.add_argument("--stats", action="store_true", help="print statistics to standard error")
    gen.add_argument("--state", default=None, help="learning drafters (recycling, aded): load state from and save it to this file")
    _add_sampling_arguments(gen)
    _add_model_arguments(gen)
    gen.set_defaults(handler=cmd_generate)

    bench = commands.add_parser("bench", help="methods side by side with transformers' generate")
    bench.add_argument("--methods", default="ar,pld,hf,hf-pld",
                       help="methods separated by ',' or ';' (ar, pld, recycling..., hf, hf-pld, hf-assisted); a "
                            "spec's own options continue it: ar,pld:max_ngram=4,draft_length=6,recycling")
    bench.add_argument("--method", action="append", default=None, help="one more method spec (repeatable)")
    bench.add_argument("--dataset", default="spec_bench", choices=DATASETS)
    bench.add_argument("--data", default=None, help="jsonl prompt file: one {\"prompt\": ...}, {\"messages\": [...]} or "
                       "{\"turns\": [...]} per line (default: shared/data/spec_bench/question.jsonl)")
    bench.add_argument("--per-category", type=int, default=5)
    bench.add_argument("--seed-prompts", type=int, default=None,
                       help="sample each category's prompts with this seed (default: the first ones)")
    bench.add_argument(
        "--categories", default=None, help="comma-separated categories (or MT-Bench sub-categories: coding, math, ...) to keep"
    )
    bench.add_argument("--turns", choices=["1", "2", "both"], default="1",
                       help="user turns to measure; later turns follow ar's answer to the first (default 1)")
    bench.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text (first turns only)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=1, help="timed runs of each prompt and method (medians reported)")
    bench.add_argument("--sweep", default=None, help="run each drafting method at several draft budgets: budget=4,8,16")
    bench.add_argument("--draft-model", default=None, help="draft model of the hf-assisted row (preset, GGUF or folder)")
    bench.add_argument("--out", default=None, help="append each run to this jsonl results file as it finishes")
    bench.add_argument("--resume", action="store_true", help="continue the --out file of an interrupted run")
    bench.add_argument("--json", default=None, help="write the summary and every record as JSON here")
    _add_sampling_arguments(bench)
    _add_model_arguments(bench)
    bench.set_defaults(handler=cmd_bench)

    report = commands.add_parser("report", help="markdown report and charts from bench results files")
    report.add_argument("results", nargs="+", help="results files written by draftwise bench --out")
    report.add_argument("--out", required=True, help="folder for report.md and the PNG charts")
    report.set_defaults(handler=cmd_report)

    models = commands.add_parser("models", help="list presets, or install one")
    models.add_argument("action", nargs="?", choices=["list", "install"], default="list")
    models.add_argument("names", nargs="*")
    models.set_defaults(handler=cmd_models)

    datastore = commands.add_parser("datastore", help="build a retrieval datastore for the rest method")
    datastore_actions = datastore.add_subparsers(dest="action", required=True)
    store_build = datastore_actions.add_parser(
        "build", help="index corpus sources (paths, stdlib, package-docs, sharegpt) for --method rest:datastore=OUT"
    )
    store_build.add_argument("sources", nargs="*", help="paths, stdlib, package-docs or sharegpt (benchmark data refused)")
    store_build.add_argument("--out", required=True, help="datastore file to write (.npz)")
    store_build.add_argument("--max-tokens", type=int, default=20_000_000, help="corpus size bound (default 20M tokens)")
    store_build.add_argument("--self-generate", default=None, metavar="PROMPTS",
                             help="also index the model's own answers to these prompts (jsonl or one per line)")
    store_build.add_argument("--max-new-tokens", type=int, default=256, help="answer length for --self-generate")
    _add_model_arguments(store_build)
    store_build.set_defaults(handler=cmd_datastore)

    corpus = commands.add_parser("corpus", help="build a tri-gram corpus for the aded method")
    corpus_actions = corpus.add_subparsers(dest="action", required=True)
    corpus_build = corpus_actions.add_parser(
        "build", help="count the tri-grams of corpus sources (paths, stdlib, package-docs, sharegpt) for "
        "--method aded:corpus=OUT"
    )
    corpus_build.add_argument("sources", nargs="*", help="paths, stdlib, package-docs or sharegpt (benchmark data refused)")
    corpus_build.add_argument("--out", required=True, help="tri-gram store to write (.npz)")
    corpus_build.add_argument("--max-tokens", type=int, default=50_000_000, help="corpus size bound (default 50M tokens)")
    corpus_build.add_argument("--top-k", type=int, default=12, help="successors kept per token pair (default 12)")
    corpus_build.add_argument("--max-pairs", type=int, default=4_000_000, help="token pairs kept (default 4M)")
    corpus_build.add_argument("--self-generate", default=None, metavar="PROMPTS",
                              help="also count the model's own answers to these prompts (jsonl or one per line)")
    corpus_build.add_argument("--max-new-tokens", type=int, default=256, help="answer length for --self-generate")
    _add_model_arguments(corpus_build)
    corpus_build.set_defaults(handler=cmd_corpus)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except DraftwiseError as error:
        print(f"draftwise: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
