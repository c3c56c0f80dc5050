"""``python -m draftwise.bench.build_llama_tools``: build llama.cpp's speculative-decoding tool for the bench's
``llama.cpp-draft`` and ``llama.cpp-ngram`` rows (see :mod:`draftwise.bench.llama_tools`), or say where it is."""

from __future__ import annotations

import sys

from ..errors import InvalidRequestError
from .llama_tools import build_tools


def main() -> None:
    """Build the tool once for this machine; exit 2 with one line where it cannot be built."""
    try:
        build_tools(say=lambda line: print(line, file=sys.stderr, flush=True))
    except InvalidRequestError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
