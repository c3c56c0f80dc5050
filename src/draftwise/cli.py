"""The ``draftwise`` command: generate, bench, report, models, doctor, datastore, corpus, serve, loadtest."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Sequence

import torch

from .bench.prompts import DATASETS
from .decoding.batch import DEFAULT_MAX_PREFILL_ROWS
from .errors import DraftwiseError, InvalidRequestError
from .models import (ACTIVATION_BITS, DEFAULT_MODEL, KV_CACHE_DTYPES, PRESETS, WEIGHTS, default_cache_dir,
                     install_preset, is_installed)

#: The rows of ``draftwise bench`` when no --methods are given.
DEFAULT_BENCH_METHODS = "ar,pld,hf,hf-pld"
#: Rounds of ``draftwise bench --interleave`` (each configuration first in half of them).
DEFAULT_ROUNDS = 6


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"preset, GGUF file or checkpoint folder (default {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default="auto",
                        help="auto (bfloat16 on a GPU or a CPU with native bf16, else float32), float32, bfloat16, float16")
    parser.add_argument("--backend", default="auto", choices=["auto", "lean", "transformers"],
                        help="the engine's own forward (lean: llama, qwen2), the model's public one, or auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--weights", default=None, choices=list(WEIGHTS),
                        help="file: run a GGUF model's block-quantised matrices as shipped; q8_0/q4_0: quantise the "
                        "linear products' weights on load (lean forward, float32); float: the dtype's float weights "
                        "(default: file for a preset or .gguf file on a CPU the kernels build on, unless --dtype is "
                        "given; float otherwise)")
    parser.add_argument("--activation-bits", type=int, default=None, choices=list(ACTIVATION_BITS),
                        help="with quantised weights on the CPU kernels: each row's activations quantised per 32 inputs "
                        "to 16 bits (the float model's top token almost everywhere) or 8 (llama.cpp's precision: "
                        "faster, the float model's top token at 95-99 %% of positions); default: the model's, 8 for "
                        "the qwen2.5-coder-1.5b preset's file as shipped (98.6 %% there), 16 otherwise")
    parser.add_argument("--kv-cache-dtype", default=None, choices=["auto", *KV_CACHE_DTYPES],
                        help="what the caches keep keys and values in (default auto: float16 beside quantised weights "
                        "on the CPU kernels, as llama.cpp's cache, the model's dtype otherwise)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="most positions a sequence may reach, prompt and output together (default: the model's "
                        "context length); on a GPU each step's attention covers this many")
    parser.add_argument("--enable-torch-compile", action="store_true",
                        help="on a GPU, run the lean forward's step through torch.compile: fewer, fused kernels a step "
                        "after a minute or more of compiling at the first step")
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


def _settle_heap() -> None:
    """Move every object alive now (the loaded models, tokenizers and libraries: some 400,000 of them) out of the
    garbage collector's reach. They live as long as the command does, and a full collection walks them all: about
    0.2 s that would land inside some timed step or request. Every command that loads a model calls it once, when
    everything is loaded; each owns its process, so it may."""
    gc.collect()
    gc.freeze()


def _load(args: argparse.Namespace):
    from .models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_model(
        args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir, backend=args.backend,
        weights=args.weights, activation_bits=args.activation_bits, max_model_len=args.max_model_len,
        torch_compile=args.enable_torch_compile, kv_cache_dtype=args.kv_cache_dtype,
    )
    quantization = getattr(target, "quantization", None)
    weights = f", {quantization} weights" if quantization else ", float weights"
    if getattr(target, "kernel_activation_bits", None):
        weights += f" ({target.kernel_activation_bits}-bit activations)"
    if target.kv_dtype != target.dtype:
        weights += f", {str(target.kv_dtype).removeprefix('torch.')} cache"
    print(f"draftwise: {args.model} in {str(target.dtype).removeprefix('torch.')}{weights} on {target.device} "
          f"({target.backend} forward)", file=sys.stderr)
    return target, tokenizer


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
    from .drafters import make_drafter, restore_state, save_state

    prompt = _read_prompt(args)
    drafter = make_drafter(args.method)
    if args.state is not None:
        restore_state(drafter, args.state)
    model, tokenizer = _load(args)
    _settle_heap()
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
    if args.state is not None:
        save_state(drafter, args.state)
    if args.stats:
        print(json.dumps(pieces.result.summary(), indent=1), file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .api import sampling_params
    from .bench import Benchmark, BenchSettings, parse_methods, parse_sweep, write_json
    from .bench.batched import parse_batch_sizes
    from .bench.interleave import parse_interleave
    from .bench.report import floor_line, summary_tables, write_speedup_chart

    pair = parse_interleave(args.interleave) if args.interleave else None
    _check_bench_modes(args)
    if pair is not None:
        methods = [row.method for row in pair]
    else:
        methods = parse_methods(args.methods or DEFAULT_BENCH_METHODS)
        methods += [spec for text in args.method or [] for spec in parse_methods(text)]
    settings = BenchSettings(
        methods=methods,
        model=args.model,
        draft_model=args.draft_model,
        dtype=args.dtype,
        backend=args.backend,
        weights=args.weights,
        activation_bits=args.activation_bits,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        torch_compile=args.enable_torch_compile,
        device=args.device,
        threads=args.threads,
        cache_dir=args.cache_dir,
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
        sampling=sampling_params(_sampling_options(args)),
        out=args.out,
        resume=args.resume,
    )
    console = Console(stderr=True)
    batch_sizes = parse_batch_sizes(args.batch_size) if args.batch_size else None
    benchmark = Benchmark.prepare(settings, load_target=lambda: _load(args))
    _settle_heap()  # (once the anchors' models, loaded after the target, are in too)
    if batch_sizes:
        return _bench_batched(args, benchmark, batch_sizes, console)
    if pair is not None:
        return _bench_interleaved(args, benchmark, pair, console)
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
        write_json(args.json, summary, records, benchmark.environment, {**benchmark.config, "prompts": len(benchmark.prompts)})
        console.print(f"results written to {args.json}")
    if args.plot:
        chart = write_speedup_chart(summary, args.plot)
        console.print(f"speedup chart written to {chart}" if chart else
                      "no chart: no row besides ar to compare with it")
    return 0


def _check_bench_modes(args: argparse.Namespace) -> None:
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
        if args.rounds is None:
            args.rounds = DEFAULT_ROUNDS
        if args.rounds < 1:
            raise InvalidRequestError("--rounds must be at least 1")
    elif args.rounds is not None:
        raise InvalidRequestError("--rounds goes with --interleave")
    if args.batch_size and (args.plot or args.by_category):
        raise InvalidRequestError("--plot and --by-category go with the side-by-side table, not --batch-size")


def _bench_interleaved(args: argparse.Namespace, benchmark, pair, console) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .bench.interleave import interleave_benchmark, write_interleave_json
    from .bench.report import interleave_line, interleave_table

    prompts = len(benchmark.prompts)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("warming up", total=2 * prompts * args.rounds)
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

        result = interleave_benchmark(benchmark, pair, args.rounds, on_progress, on_round)
    summary = result.summary()
    rounds = [round_.summary() for round_ in result.rounds]
    output = Console() if sys.stdout.isatty() else Console(width=200)
    output.print(interleave_table(rounds, summary, benchmark.settings.max_new_tokens))
    output.print(interleave_line(summary))
    if summary["identical_ids"] is not None and summary["identical_ids"] < summary["compared_runs"]:
        console.print(f"warning: A and B gave different ids in {summary['compared_runs'] - summary['identical_ids']} "
                      f"of {summary['compared_runs']} runs (lossless methods give identical ids when greedy)")
    if args.json:
        settings = {**benchmark.config, "prompts": prompts, "interleave": [pair[0].label, pair[1].label],
                    "rounds": args.rounds}
        write_interleave_json(args.json, result, benchmark.environment, settings)
        console.print(f"results written to {args.json}")
    return 0


def _bench_batched(args: argparse.Namespace, benchmark, batch_sizes: list[int], console) -> int:
    from rich.console import Console
    from rich.table import Table

    from .bench.batched import batch_table_rows, write_batched_json

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


def cmd_report(args: argparse.Namespace) -> int:
    from .bench.report import write_report

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


def _corpus_texts(args: argparse.Namespace):
    """Tokenizer and texts of a corpus command's sources, every source checked before anything slow starts."""
    from .corpus.build import check_sources, corpus_texts

    if args.max_tokens <= 0 or args.max_new_tokens <= 0:
        raise DraftwiseError("--max-tokens and --max-new-tokens must be positive")
    prompts = check_sources(args.sources, args.self_generate)
    model, tokenizer = _load(args)
    _settle_heap()
    return tokenizer, corpus_texts(model, tokenizer, args.sources, prompts, args.max_new_tokens)


def _token_progress(console):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,} / {task.total:,} tokens"),
        TimeElapsedColumn(), console=console,
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    """Measure how this machine runs a model: dtype, backend, exact-verification padding, cost by rows."""
    from rich.console import Console
    from rich.table import Table

    from .doctor import as_rows, diagnose, flags_summary

    if args.weights:
        raise DraftwiseError("doctor measures the float dtypes (--dtype); it does not take --weights")
    if args.enable_torch_compile:
        raise DraftwiseError("doctor measures the eager forwards; it does not take --enable-torch-compile")
    if args.threads:
        torch.set_num_threads(args.threads)
    diagnosis = diagnose(args.model, args.dtype.split(","), args.device, args.cache_dir, args.backend, args.trials)
    console = Console()
    console.print(f"machine: {diagnosis.cpu} ({flags_summary()}); torch {diagnosis.torch}, {diagnosis.threads} threads")
    console.print(f"native bf16: {'yes' if diagnosis.native_bf16 else 'no'}; dtype=auto picks {diagnosis.auto_dtype}")
    rows = as_rows(diagnosis)
    table = Table(title=f"{diagnosis.model}")
    for column in rows[0]:
        table.add_column(column)
    for row in rows:
        table.add_row(*map(str, row.values()))
    console.print(table)
    for item in diagnosis.dtypes:
        for mismatch in item.report.mismatches[:5]:
            console.print(f"  {item.dtype}: {mismatch}")
    return 0 if all(item.exact_trees for item in diagnosis.dtypes) else 1


def cmd_datastore(args: argparse.Namespace) -> int:
    """Build a REST datastore from corpus sources (and optionally the model's own answers to some prompts)."""
    from rich.console import Console

    from .corpus.build import write_datastore

    console = Console(stderr=True)
    started = time.perf_counter()
    tokenizer, texts = _corpus_texts(args)
    with _token_progress(console) as progress:
        task = progress.add_task("tokenizing", total=args.max_tokens)
        datastore = write_datastore(
            tokenizer, texts, args.out, args.max_tokens,
            on_progress=lambda gathered: progress.update(task, completed=gathered),
            on_sorting=lambda: progress.update(task, description="sorting suffixes"),
        )
    console.print(
        f"datastore {args.out}: {len(datastore):,} tokens in {datastore.documents:,} pieces, "
        f"{os.path.getsize(args.out) / 1e6:.0f} MB, built in {time.perf_counter() - started:.0f} s"
    )
    return 0


def _serve_dependencies():
    try:
        import uvicorn

        from .serve import ServingEngine, create_app
    except ImportError as error:
        raise InvalidRequestError(f"the server needs its extra: pip install 'draftwise[serve]' ({error})") from None
    return uvicorn, ServingEngine, create_app


def cmd_serve(args: argparse.Namespace) -> int:
    """Start the OpenAI-compatible server."""
    from .drafters import check_method

    check_method(args.method)
    if min(args.max_batch, args.max_waiting, args.default_max_tokens, args.max_prefill_rows) < 1:
        raise InvalidRequestError("--max-batch, --max-waiting, --max-prefill-rows and --default-max-tokens must be "
                                  "positive")
    if args.ray:
        return _serve_on_ray(args)
    ray_only = [flag for flag, value in (("--replicas", args.replicas), ("--autoscale", args.autoscale),
                                         ("--address", args.address), ("--cpus-per-replica", args.cpus_per_replica),
                                         ("--gpus-per-replica", args.gpus_per_replica)) if value is not None]
    if ray_only or args.no_session_affinity:
        raise InvalidRequestError(f"{', '.join(ray_only) or '--no-session-affinity'} needs --ray")
    uvicorn, ServingEngine, create_app = _serve_dependencies()
    from .serve.engine import on_passing_thread

    def build():
        target, tokenizer = _load(args)
        if tokenizer is None:
            raise InvalidRequestError(f"{args.model} has no tokenizer: the server needs one")
        return ServingEngine(target, tokenizer, args.method, max_batch=args.max_batch, max_waiting=args.max_waiting,
                             budget=args.budget, max_prefill_rows=args.max_prefill_rows)

    # (torch's work then runs on the engine's thread alone: see on_passing_thread)
    engine = on_passing_thread(build)
    _settle_heap()
    name = args.served_model_name or args.model
    app = create_app(engine, name, args.default_max_tokens)
    print(f"draftwise: serving {name} with {args.method} on http://{args.host}:{args.port}/v1 "
          f"(batch up to {args.max_batch})", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _autoscale_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise InvalidRequestError(f"--autoscale takes MIN,MAX (two integers), not {text!r}") from None
    return low, high


def _serve_on_ray(args: argparse.Namespace) -> int:
    """``draftwise serve --ray``: the same server, its replicas run by Ray Serve."""
    autoscale = _autoscale_range(args.autoscale)
    if autoscale is not None and args.replicas is not None:
        raise InvalidRequestError("give --replicas or --autoscale, not both")
    replicas = args.replicas if args.replicas is not None else 1
    if replicas < 1:
        raise InvalidRequestError("replicas must be at least 1")
    try:
        from .serve.ray import build_app, run
    except ImportError as error:
        raise InvalidRequestError(f"--ray needs its extra: pip install 'draftwise[ray]' ({error})") from None
    cpus = args.cpus_per_replica if args.cpus_per_replica is not None else float(args.threads or 1)
    gpus = args.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if str(args.device).startswith("cuda") else 0.0
    name = args.served_model_name or args.model
    load_options = {"dtype": args.dtype, "device": args.device, "backend": args.backend, "cache_dir": args.cache_dir,
                    "weights": args.weights, "activation_bits": args.activation_bits,
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "max_model_len": args.max_model_len, "torch_compile": args.enable_torch_compile}
    app = build_app(args.model, served_model_name=name, method=args.method, replicas=replicas,
                    autoscale=autoscale, cpus_per_replica=cpus, gpus_per_replica=gpus,
                    threads=args.threads, max_batch=args.max_batch, max_waiting=args.max_waiting, budget=args.budget,
                    max_prefill_rows=args.max_prefill_rows,
                    default_max_tokens=args.default_max_tokens, session_affinity=not args.no_session_affinity,
                    **load_options)
    scale = f"{autoscale[0]} to {autoscale[1]} replicas" if autoscale else f"{replicas} replica(s)"
    print(f"draftwise: serving {name} with {args.method} on Ray Serve, {scale} of {cpus:g} CPU(s), "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    run(app, address=args.address, host=args.host, port=args.port)
    return 0


def _concurrency_levels(args: argparse.Namespace) -> list[int]:
    if args.sweep is not None and args.concurrency is not None:
        raise InvalidRequestError("give --concurrency or --sweep, not both")
    if args.sweep is None:
        return [args.concurrency if args.concurrency is not None else 16]
    if args.sweep == "":
        from .serve.load import DEFAULT_SWEEP

        return list(DEFAULT_SWEEP)
    try:
        levels = [int(part) for part in args.sweep.split(",")]
    except ValueError:
        raise InvalidRequestError(f"--sweep takes concurrencies such as 1,4,16, not {args.sweep!r}") from None
    return levels


def _loadtest_prompts(args: argparse.Namespace, count: int) -> list[str]:
    """Spec-Bench questions, or ``count`` distinct synthetic prompts."""
    from .bench.prompts import load_spec_bench

    if args.data == "spec-bench":
        return [prompt.text for prompt in load_spec_bench(args.data_file, per_category=args.per_category)]
    from transformers import AutoTokenizer

    from .models import resolve_checkpoint
    from .serve.load import synthetic_prompts

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
    for column in ("server", "concurrency", "ok", "failed", "output tok/s", "req/s", "TTFT p50", "TTFT p99",
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
                number(itl.get("median")), number(tpot.get("median")), number(latency.get("median"), 2),
                number(latency.get("p99"), 2),
                f"{speculation['drafting_share']:.0%}" if "drafting_share" in speculation else "-",
                number(speculation.get("mean_acceptance_length"), 2),
                number(speculation.get("tokens_per_sequence_step"), 2),
            )
    # Piped to a file the table keeps every column whole (rich would cut it to 80 characters).
    Console(width=None if sys.stdout.isatty() else 180).print(table)


def cmd_loadtest(args: argparse.Namespace) -> int:
    """Load test a running server at one concurrency or a sweep of them; table, JSON and chart."""
    from .serve.load import read_results

    levels = _concurrency_levels(args)
    if min(levels) < 1 or (args.requests is not None and args.requests < 1) or args.max_tokens < 1 \
            or args.per_client < 1:
        raise InvalidRequestError("--requests, --per-client, --concurrency/--sweep and --max-tokens must be positive")
    if args.prompt_tokens < 1 or args.warmup < 0:
        raise InvalidRequestError("--prompt-tokens must be positive and --warmup at least 0")
    compared = {}
    for path in args.compare:
        try:
            label, compared_levels = read_results(path)
        except (OSError, ValueError) as error:
            raise InvalidRequestError(f"--compare {path}: {error}") from None
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
        from .bench.plots import load_chart

        load_chart(runs, args.plot)
    for report in reports:
        for error in report.errors[:5] + report.incomplete[:5]:
            print(error, file=sys.stderr)
    return 1 if any(report.errors or report.incomplete for report in reports) else 0


def _run_loadtest(args: argparse.Namespace, levels: list[int]) -> list:
    """``draftwise loadtest``'s levels against the server (their JSON written when asked)."""
    from .serve.load import requests_for, sweep, write_results

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
                    extra_body=extra_body)
    if args.json:
        settings = {"url": args.url, "model": args.model, "data": args.data, "stream": not args.no_stream,
                    "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens if synthetic else None,
                    "ignore_eos": synthetic or args.ignore_eos, "temperature": args.temperature,
                    "endpoint": "completions" if args.completions else "chat", "extra_body": extra_body}
        write_results(args.json, args.label or args.url, settings, reports)
    return reports


def cmd_corpus(args: argparse.Namespace) -> int:
    """Count the tri-grams of corpus sources into a store for ``--method aded:corpus=OUT``."""
    from rich.console import Console

    from .corpus.build import write_trigram_store

    if args.top_k <= 0 or args.max_pairs <= 0:
        raise DraftwiseError("--top-k and --max-pairs must be positive")
    console = Console(stderr=True)
    started = time.perf_counter()
    tokenizer, texts = _corpus_texts(args)
    with _token_progress(console) as progress:
        task = progress.add_task("counting tri-grams", total=args.max_tokens)
        store, counted = write_trigram_store(
            tokenizer, texts, args.out, args.max_tokens, args.top_k, args.max_pairs,
            on_progress=lambda seen: progress.update(task, completed=seen),
        )
    console.print(
        f"tri-gram store {args.out}: {counted:,} tokens counted, {len(store):,} token pairs kept, "
        f"{os.path.getsize(args.out) / 1e6:.0f} MB, built in {time.perf_counter() - started:.0f} s"
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
    bench.add_argument("--methods", default=None,
                       help="methods separated by ',' or ';' (ar, pld, aded, recycling..., hf, hf-pld, hf-assisted); "
                            "a spec's own options continue it: ar,pld:max_ngram=4,draft_length=6,recycling "
                            f"(default {DEFAULT_BENCH_METHODS})")
    bench.add_argument("--method", action="append", default=None, help="one more method spec (repeatable)")
    bench.add_argument("--dataset", default="spec_bench", choices=DATASETS)
    bench.add_argument("--data", default=None, help="jsonl prompt file: one {\"prompt\": ...}, {\"messages\": [...]} or "
                       "{\"turns\": [...]} per line (default: shared/data/spec_bench/question.jsonl)")
    bench.add_argument("--per-category", type=int, default=5)
    bench.add_argument("--prompts", type=int, default=None, metavar="N",
                       help="at most N of the selected prompts, the categories taken in turn (default: all)")
    bench.add_argument("--seed-prompts", type=int, default=None,
                       help="sample each category's prompts with this seed (default: the first ones)")
    bench.add_argument(
        "--categories", default=None, help="comma-separated categories (or MT-Bench sub-categories: coding, math, ...) to keep"
    )
    bench.add_argument("--turns", choices=["1", "2", "both"], default="1",
                       help="user turns to measure; later turns follow ar's answer to the first (default 1)")
    bench.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text (first turns only)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=1,
                       help="timed passes over the prompts, each with fresh drafters (medians reported; with "
                       "--batch-size, each batch size's rows run in turn N times)")
    bench.add_argument("--sweep", default=None, help="run each drafting method at several draft budgets: budget=4,8,16")
    bench.add_argument("--draft-model", default=None, help="draft model of the hf-assisted row (preset, GGUF or folder)")
    bench.add_argument("--out", default=None, help="append each run to this jsonl results file as it finishes")
    bench.add_argument("--resume", action="store_true", help="continue the --out file of an interrupted run")
    bench.add_argument("--json", default=None, help="write the summary and every record as JSON here")
    bench.add_argument("--by-category", action="store_true",
                       help="a table per category besides the overall one")
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

    doctor = commands.add_parser(
        "doctor", help="measure how this machine runs a model: dtype, exact verification, forward cost by rows"
    )
    doctor.add_argument("--trials", type=int, default=40, help="random trees checked against plain decoding")
    _add_model_arguments(doctor)
    doctor.set_defaults(handler=cmd_doctor)

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

    serve = commands.add_parser("serve", help="OpenAI-compatible server (completions, chat, streaming, metrics)")
    serve.add_argument("--method", default="pld", help="decoding method of every request (default pld)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch", type=int, default=16, help="most sequences decoded at once (default 16)")
    serve.add_argument("--max-prefill-rows", type=int, default=DEFAULT_MAX_PREFILL_ROWS,
                       help="most prompt tokens prefilled in one step: longer prompts are prefilled in pieces "
                            f"between decoding steps (default {DEFAULT_MAX_PREFILL_ROWS})")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="most requests waiting for a slot; more are answered 503 (default 256)")
    serve.add_argument("--budget", type=int, default=16, help="most draft nodes per sequence and step")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    serve.add_argument("--default-max-tokens", type=int, default=256,
                       help="tokens generated when a request gives no max_tokens (default 256)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    ray_group = serve.add_argument_group("scale-out on Ray Serve (pip install 'draftwise[ray]')")
    ray_group.add_argument("--ray", action="store_true", help="run replicas of the server on Ray Serve")
    ray_group.add_argument("--replicas", type=int, default=None, help="a fixed number of replicas (default 1)")
    ray_group.add_argument("--autoscale", default=None, metavar="MIN,MAX",
                           help="autoscale between MIN and MAX replicas on ongoing requests (instead of --replicas)")
    ray_group.add_argument("--address", default=None,
                           help="Ray cluster to join: auto, or ray://head:10001 (default: start a local one)")
    ray_group.add_argument("--cpus-per-replica", type=float, default=None,
                           help="CPUs each replica reserves (default: --threads, or 1)")
    ray_group.add_argument("--gpus-per-replica", type=float, default=None,
                           help="GPUs each replica reserves (default: 1 with --device cuda, else 0)")
    ray_group.add_argument("--no-session-affinity", action="store_true",
                           help="ignore the x-session-id header (power-of-two-choices routing for every request)")
    _add_model_arguments(serve)
    serve.set_defaults(handler=cmd_serve)

    loadtest = commands.add_parser(
        "loadtest", help="load test a running OpenAI-compatible server at one or more concurrencies (guidellm's metrics)")
    loadtest.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 address")
    loadtest.add_argument("--model", default=DEFAULT_MODEL,
                          help="the served model name; also the tokenizer of synthetic prompts unless --tokenizer")
    loadtest.add_argument("--concurrency", type=int, default=None, help="concurrent requests (default 16)")
    loadtest.add_argument("--sweep", nargs="?", const="", default=None, metavar="C1,C2,...",
                          help="one level per concurrency, one after the other (default 1,4,16)")
    loadtest.add_argument("--requests", type=int, default=None, help="requests per level (default: --per-client)")
    loadtest.add_argument("--per-client", type=int, default=4,
                          help="without --requests: requests per concurrent client, at least twice this many per level")
    loadtest.add_argument("--max-tokens", "--output-tokens", dest="max_tokens", type=int, default=128,
                          help="tokens per answer (synthetic data: exactly this many, with ignore_eos)")
    loadtest.add_argument("--data", default="spec-bench", choices=["spec-bench", "synthetic"],
                          help="Spec-Bench questions, or synthetic prompts of --prompt-tokens tokens cut from them")
    loadtest.add_argument("--prompt-tokens", type=int, default=256, help="tokens per synthetic prompt")
    loadtest.add_argument("--tokenizer", default=None, help="tokenizer folder or preset for synthetic prompts")
    loadtest.add_argument("--per-category", type=int, default=3, help="Spec-Bench prompts per category")
    loadtest.add_argument("--data-file", default=None, help="Spec-Bench question file (default: the shared copy)")
    loadtest.add_argument("--cache-dir", default=None, help="converted checkpoints (where --model's tokenizer is)")
    loadtest.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT or ITL)")
    loadtest.add_argument("--completions", action="store_true", help="text completions instead of chat")
    loadtest.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    loadtest.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    loadtest.add_argument("--extra-body", default=None, metavar="JSON",
                          help="more fields for every request, e.g. a server's own options")
    loadtest.add_argument("--warmup", type=int, default=1, help="unmeasured requests before the first level")
    loadtest.add_argument("--label", default=None, help="the server's name in tables and charts (default: --url)")
    loadtest.add_argument("--json", default=None, help="write the levels here (read back by --compare)")
    loadtest.add_argument("--plot", default=None, help="PNG chart: output tok/s, TTFT and ITL against concurrency")
    loadtest.add_argument("--compare", nargs="*", default=[], metavar="RESULTS.json",
                          help="earlier --json results (other servers) shown beside this run")
    loadtest.add_argument("--no-run", action="store_true", help="send nothing: only the table (and --plot) of --compare")
    loadtest.set_defaults(handler=cmd_loadtest)
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
