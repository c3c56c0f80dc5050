"""``draftwise generate``: one prompt (an argument, a file or standard input), streamed as it is decoded."""

from __future__ import annotations

import argparse
import json
import sys

from ..api import DEFAULT_MAX_NEW_TOKENS, DEFAULT_METHOD
from ..decoding.engine import DEFAULT_BUDGET
from ..errors import InvalidRequestError
from ..files import read_text_file
from . import common
from .common import add_model_arguments, add_sampling_arguments, load_options, sampling_options, settle_heap


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("generate", help="generate text from a prompt (argument, --prompt-file or stdin)")
    parser.add_argument("prompt", nargs="?", help="the prompt; '-' or nothing reads standard input")
    parser.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 text file")
    parser.add_argument("--method", default=DEFAULT_METHOD,
                        help=f"ar, pld, or a spec like pld:max_ngram=3 (default {DEFAULT_METHOD})")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help=f"most tokens generated (default {DEFAULT_MAX_NEW_TOKENS})")
    parser.add_argument("--min-new-tokens", type=int, default=0,
                        help="no end-of-sequence token or stop sequence before this many tokens (default 0)")
    parser.add_argument("--stop", action="append", default=None, help="stop sequence (repeatable)")
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                        help=f"most draft nodes per step (default {DEFAULT_BUDGET})")
    parser.add_argument("--prediction-file", default=None,
                        help="the expected output (the file before an edit, say), drafted wherever the output follows "
                             "it (OpenAI's Predicted Outputs); the output is plain decoding's whatever it says")
    parser.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    parser.add_argument("--stats", action="store_true", help="print statistics to standard error")
    parser.add_argument("--state", default=None,
                        help="learning drafters (recycling, aded): load state from and save it to this file")
    add_sampling_arguments(parser)
    add_model_arguments(parser)
    parser.set_defaults(handler=run)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise InvalidRequestError("give the prompt as an argument or with --prompt-file, not both")
    if args.prompt_file is not None:
        text = read_text_file(args.prompt_file, "prompt file")
        if not text.strip():
            raise InvalidRequestError(f"prompt file {args.prompt_file} is empty")
        return text
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if sys.stdin.isatty() and args.prompt is None:
        raise InvalidRequestError("no prompt: pass it as an argument, with --prompt-file, or on standard input")
    return sys.stdin.read()


def run(args: argparse.Namespace) -> int:
    from ..api import stream
    from ..drafters import make_drafter, restore_state, save_state

    options = load_options(args)
    prompt = read_prompt(args)
    prediction = read_text_file(args.prediction_file, "prediction file") if args.prediction_file else None
    drafter = make_drafter(args.method)
    if args.state is not None:
        restore_state(drafter, args.state)
    model, tokenizer = common.load(args, options)
    settle_heap()
    chat = not args.no_chat_template and bool(getattr(tokenizer, "chat_template", None))
    pieces = stream(
        model,
        tokenizer,
        prompt,
        method=drafter,
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.min_new_tokens,
        stop=args.stop,
        chat_template=chat,
        budget=args.budget,
        prediction=prediction,
        **sampling_options(args),
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
