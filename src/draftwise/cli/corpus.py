"""``draftwise datastore build`` (a retrieval datastore for ``rest``) and ``draftwise corpus build`` (a tri-gram
store for ``aded``)."""

from __future__ import annotations

import argparse
import os
import time

from ..corpus.build import SELF_GENERATED_TOKENS, TRIGRAM_MAX_PAIRS, TRIGRAM_MAX_TOKENS, TRIGRAM_TOP_K
from ..drafters.stores.datastore import DEFAULT_MAX_TOKENS as DATASTORE_MAX_TOKENS
from ..errors import InvalidRequestError
from . import common
from .common import add_model_arguments, load_options, settle_heap

SOURCES_HELP = "paths, stdlib, package-docs or sharegpt (benchmark data refused)"


def add_parsers(commands: argparse._SubParsersAction) -> None:
    datastore = commands.add_parser("datastore", help="build a retrieval datastore for the rest method")
    datastore_actions = datastore.add_subparsers(dest="action", required=True)
    store_build = datastore_actions.add_parser(
        "build", help="index corpus sources (paths, stdlib, package-docs, sharegpt) for --method rest:datastore=OUT"
    )
    store_build.add_argument("sources", nargs="*", help=SOURCES_HELP)
    store_build.add_argument("--out", required=True, help="datastore file to write (.npz)")
    store_build.add_argument("--max-tokens", type=int, default=DATASTORE_MAX_TOKENS,
                             help=f"corpus size bound (default {DATASTORE_MAX_TOKENS:,} tokens)")
    _add_self_generate(store_build, "index")
    add_model_arguments(store_build)
    store_build.set_defaults(handler=run_datastore)

    corpus = commands.add_parser("corpus", help="build a tri-gram corpus for the aded method")
    corpus_actions = corpus.add_subparsers(dest="action", required=True)
    corpus_build = corpus_actions.add_parser(
        "build", help="count the tri-grams of corpus sources (paths, stdlib, package-docs, sharegpt) for "
        "--method aded:corpus=OUT"
    )
    corpus_build.add_argument("sources", nargs="*", help=SOURCES_HELP)
    corpus_build.add_argument("--out", required=True, help="tri-gram store to write (.npz)")
    corpus_build.add_argument("--max-tokens", type=int, default=TRIGRAM_MAX_TOKENS,
                              help=f"corpus size bound (default {TRIGRAM_MAX_TOKENS:,} tokens)")
    corpus_build.add_argument("--top-k", type=int, default=TRIGRAM_TOP_K,
                              help=f"successors kept per token pair (default {TRIGRAM_TOP_K})")
    corpus_build.add_argument("--max-pairs", type=int, default=TRIGRAM_MAX_PAIRS,
                              help=f"token pairs kept (default {TRIGRAM_MAX_PAIRS:,})")
    _add_self_generate(corpus_build, "count")
    add_model_arguments(corpus_build)
    corpus_build.set_defaults(handler=run_corpus)


def _add_self_generate(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("--self-generate", default=None, metavar="PROMPTS",
                        help=f"also {verb} the model's own answers to these prompts (jsonl or one per line)")
    parser.add_argument("--max-new-tokens", type=int, default=SELF_GENERATED_TOKENS,
                        help=f"answer length for --self-generate (default {SELF_GENERATED_TOKENS})")


def _corpus_texts(args: argparse.Namespace):
    """Tokenizer and texts of a corpus command's sources, every source checked before anything slow starts."""
    from ..corpus.build import check_sources, corpus_texts

    if args.max_tokens <= 0 or args.max_new_tokens <= 0:
        raise InvalidRequestError("--max-tokens and --max-new-tokens must be positive")
    options = load_options(args)
    prompts = check_sources(args.sources, args.self_generate)
    model, tokenizer = common.load(args, options)
    settle_heap()
    return tokenizer, corpus_texts(model, tokenizer, args.sources, prompts, args.max_new_tokens)


def _token_progress(console):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,} / {task.total:,} tokens"),
        TimeElapsedColumn(), console=console,
    )


def run_datastore(args: argparse.Namespace) -> int:
    """Build a REST datastore from corpus sources (and optionally the model's own answers to some prompts)."""
    from rich.console import Console

    from ..corpus.build import write_datastore

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


def run_corpus(args: argparse.Namespace) -> int:
    """Count the tri-grams of corpus sources into a store for ``--method aded:corpus=OUT``."""
    from rich.console import Console

    from ..corpus.build import write_trigram_store

    if args.top_k <= 0 or args.max_pairs <= 0:
        raise InvalidRequestError("--top-k and --max-pairs must be positive")
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
