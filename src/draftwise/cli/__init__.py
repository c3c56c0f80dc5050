"""The ``draftwise`` command: generate, bench, report, models, doctor, datastore, corpus, serve, loadtest.

Each command's parser stands beside its handler in a module of its own (:mod:`.generate`, :mod:`.bench`,
:mod:`.models`, :mod:`.corpus`, :mod:`.serve`, :mod:`.loadtest`) and takes its defaults from the library's
constants; :mod:`.common` holds the model flags, which become one :class:`~draftwise.models.LoadOptions`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import DraftwiseError
from . import bench, corpus, generate, loadtest, models, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftwise", description="Lossless draft-and-verify decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(commands)
    bench.add_parsers(commands)
    models.add_parsers(commands)
    corpus.add_parsers(commands)
    serve.add_parser(commands)
    loadtest.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except DraftwiseError as error:
        print(f"draftwise: error: {' '.join(str(error).split())}", file=sys.stderr)  # (one line, whatever it quotes)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
