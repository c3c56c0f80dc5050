"""The ``draftwise`` command: generate, bench, models."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch

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
    from .bench import environment, run_bench, summarize, validate_methods, write_json
    from .data import load_spec_bench
    from .report import summary_tables

    if args.dataset != "spec_bench":
        raise DraftwiseError(f"unknown dataset {args.dataset!r}; available: spec_bench")
    if args.max_new_tokens <= 0 or args.per_category is not None and args.per_category <= 0:
        raise DraftwiseError("--max-new-tokens and --per-category must be positive")
    methods = validate_methods([method for method in args.methods.split(";" if ";" in args.methods else ",") if method])
    sampling = sampling_params(_sampling_options(args))
    prompts = load_spec_bench(args.data, args.per_category)
    if args.categories:
        wanted = set(args.categories.split(","))
        prompts = [prompt for prompt in prompts if prompt.category in wanted]
    if not prompts:
        raise DraftwiseError("no prompts selected")
    console = Console(stderr=True)
    model, tokenizer = _load(args)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("warming up", total=len(prompts) * len(methods))

        def on_progress(method, prompt, rate):
            progress.update(task, advance=1, description=f"{method:>8} q{prompt.question_id} {prompt.category:<15} {rate:6.1f} tok/s")

        records = run_bench(model, tokenizer, prompts, methods, args.max_new_tokens, on_progress, sampling=sampling)
    summary = summarize(records, methods)
    for table in summary_tables(summary):
        Console().print(table)
    if args.json:
        settings = {
            "methods": methods,
            "dataset": args.dataset,
            "per_category": args.per_category,
            "max_new_tokens": args.max_new_tokens,
            "prompts": len(prompts),
            "sampling": _sampling_options(args),
        }
        write_json(args.json, summary, records, environment(model, args.model), settings)
        console.print(f"results written to {args.json}")
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
    gen.add_argument("--state", default=None, help="learning drafters (recycling): load state from and save it to this file")
    _add_sampling_arguments(gen)
    _add_model_arguments(gen)
    gen.set_defaults(handler=cmd_generate)

    bench = commands.add_parser("bench", help="methods side by side with transformers' generate")
    bench.add_argument("--methods", default="ar,pld,hf,hf-pld", help="comma-separated methods (ar, pld, hf, hf-pld, specs)")
    bench.add_argument("--dataset", default="spec_bench")
    bench.add_argument("--data", default=None, help="question file (default: shared/data/spec_bench/question.jsonl)")
    bench.add_argument("--per-category", type=int, default=5)
    bench.add_argument("--categories", default=None, help="comma-separated categories to keep")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--json", default=None, help="write results as JSON here")
    _add_sampling_arguments(bench)
    _add_model_arguments(bench)
    bench.set_defaults(handler=cmd_bench)

    models = commands.add_parser("models", help="list presets, or install one")
    models.add_argument("action", nargs="?", choices=["list", "install"], default="list")
    models.add_argument("names", nargs="*")
    models.set_defaults(handler=cmd_models)
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
