"""The model's own answers as a corpus: the text that best approximates what it will generate."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from ..api import generate
from ..bench.prompts import read_prompts
from ..errors import InvalidRequestError
from ..files import read_text_file
from .sources import check_not_benchmark


def read_prompt_file(path: str | Path) -> list[str | list[dict]]:
    """Prompts for self-generation: a jsonl file (``{"prompt"}``, ``{"messages"}`` or ``{"turns"}``: first turn) or a
    text file with one prompt per line. Benchmark prompts are refused."""
    path = check_not_benchmark(path)
    if ".jsonl" in path.suffixes:  # the benchmark's prompt-file format: {"prompt"}, {"messages"} or {"turns"}
        prompts: list[str | list[dict]] = [prompt.conversation(1) for prompt in read_prompts(path)]
    else:
        prompts = [line for line in read_text_file(path, "prompt file").splitlines() if line.strip()]
    if not prompts:
        raise InvalidRequestError(f"prompt file {path} holds no prompts")
    return prompts


def self_generated_documents(
    model, tokenizer, prompts: Iterable[str | list[dict]], max_new_tokens: int, method: str = "pld"
) -> Iterator[str]:
    """The model's own (greedy) answers to ``prompts``: the text that best approximates what it will generate.

    Any exact method gives the same text; prompt lookup gives it fastest."""
    for prompt in prompts:
        yield generate(model, tokenizer, prompt, method=method, max_new_tokens=max_new_tokens).text
