"""Benchmark results: one record per timed run, the resumable results file (a header line with the config and the
environment, then one line per finished run) and the JSON summary file."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..decoding.stats import GenerationStats
from ..errors import InvalidRequestError
from ..files import read_text_file

#: The category key of the whole run in a summary.
OVERALL = "overall"

#: First line of a results file names its format.
RESULTS_FORMAT = "draftwise-bench-results/1"

#: (row label, question id, turn, repeat): one run.
RunKey = tuple[str, Any, int, int]


def row_label(method: str, budget: int | None) -> str:
    """Name of a row: the method spec, with ``@budget`` when run at an explicit draft budget."""
    return method if budget is None else f"{method}@{budget}"


@dataclass
class Record:
    """One row's run on one turn of one question.

    ``steps``, ``drafted_tokens`` and the acceptance counters are ``None``/empty for transformers rows (it reports
    none). ``accepted_length_histogram[n]`` counts the steps that emitted ``n`` tokens. ``context_only`` marks a
    first-turn answer generated only to ask the second turn (when first turns are not measured).
    """

    method: str
    question_id: int | str
    category: str
    new_tokens: int
    time_s: float
    steps: int | None
    token_ids: list[int] = field(repr=False)
    turn: int = 1
    repeat: int = 0
    budget: int | None = None
    time_to_first_token_s: float | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    attempts_per_position: list[int] = field(default_factory=list, repr=False)
    accepts_per_position: list[int] = field(default_factory=list, repr=False)
    accepted_length_histogram: list[int] = field(default_factory=list, repr=False)
    peak_memory_bytes: int | None = None
    context_only: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0

    @property
    def label(self) -> str:
        return row_label(self.method, self.budget)

    @property
    def key(self) -> RunKey:
        return (self.label, self.question_id, self.turn, self.repeat)

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (with ``tokens_per_s``)."""
        return {**dataclasses.asdict(self), "tokens_per_s": self.tokens_per_s}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        """Inverse of :meth:`to_json` (derived and unknown keys are ignored)."""
        names = {item.name for item in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in data.items() if name in names})


def results_header(config: Mapping[str, Any], env: Mapping[str, Any]) -> dict[str, Any]:
    """The first line of a results file."""
    return {"format": RESULTS_FORMAT, "config": dict(config), "environment": dict(env)}


#: Environment entries measured anew at every start (they vary between runs on one machine): not compared on resume.
MEASURED_ENVIRONMENT = ("read_gb_per_s", "read_gb_per_s_probes", "floor_ms_per_token")


def _header_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    current = json.loads(json.dumps(dict(current)))  # (as the file holds it: tuples are lists there)
    differences = []
    for section in ("config", "environment"):
        old, new = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(old) | set(new)):
            if section == "environment" and key in MEASURED_ENVIRONMENT:
                continue
            if key not in old and new.get(key) in (None, False):  # (an entry added later, at its default)
                continue
            if old.get(key) != new.get(key):
                differences.append(f"{section}.{key}: {old.get(key)!r} in the file, {new.get(key)!r} now")
    return differences


def read_results(path: str | Path) -> tuple[dict[str, Any], list[Record]]:
    """The header and records of a results file. A torn last line (the run was killed while writing it) is
    ignored; a repeated run keeps its first record."""
    path = Path(path)
    lines = read_text_file(path, "results file").split("\n")
    header, records, seen = None, [], set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # torn last line: no newline was written after it
                break
            raise InvalidRequestError(f"{path}:{number}: not JSON ({error})") from error
        if header is None:
            if not isinstance(data, dict) or data.get("format") != RESULTS_FORMAT:
                raise InvalidRequestError(f"{path} is not a draftwise bench results file (written with --out)")
            header = data
            continue
        try:
            record = Record.from_json(data)
        except TypeError as error:
            raise InvalidRequestError(f"{path}:{number}: not a run record ({error})") from error
        if record.key not in seen:
            seen.add(record.key)
            records.append(record)
    if header is None:
        raise InvalidRequestError(f"{path} is empty: not a draftwise bench results file")
    return header, records


class ResultsWriter:
    """Appends records to a results file as they finish, so that an interrupted run can resume.

    Use :meth:`open`; then :meth:`append` each record and :meth:`close` at the end (or use it as a context
    manager).
    """

    def __init__(self, path: Path, handle: IO[str], records: list[Record]) -> None:
        self.path = path
        self.handle = handle
        #: Records already in the file when it was opened (a resumed run's).
        self.records = records

    @classmethod
    def open(cls, path: str | Path, header: Mapping[str, Any], resume: bool = False) -> ResultsWriter:
        """Start a results file with ``header``, or with ``resume`` continue an existing one written with the same
        config and environment (refused otherwise, naming the differences)."""
        path = Path(path)
        if path.exists() and not resume:
            raise InvalidRequestError(f"{path} exists: pass --resume to continue that run, or choose another file")
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "w", encoding="utf-8")
            handle.write(json.dumps(dict(header)) + "\n")
            handle.flush()
            return cls(path, handle, [])
        saved, records = read_results(path)
        differences = _header_differences(saved, header)
        if differences:
            raise InvalidRequestError(
                f"cannot resume {path}: it was written by a different run:\n  " + "\n  ".join(differences)
            )
        _drop_torn_line(path)
        return cls(path, open(path, "a", encoding="utf-8"), records)

    def append(self, record: Record) -> None:
        """Write one record and flush it to the file."""
        self.handle.write(json.dumps(record.to_json()) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _drop_torn_line(path: Path) -> None:
    """Cut a last line that was only partly written, so that appending starts on a fresh line."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def write_json(path: str | Path, summary: dict, records: Sequence[Record], env: dict, settings: dict) -> None:
    """The summary, settings, environment and every record as one JSON file."""
    payload = {
        "environment": env,
        "settings": settings,
        "methods": summary[OVERALL],
        "categories": {category: rows for category, rows in summary.items() if category != OVERALL},
        "records": [record.to_json() for record in records],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1))


@dataclass
class Measurement:
    """What one timed run produced."""

    token_ids: list[int]
    time_s: float
    time_to_first_token_s: float | None = None
    stats: GenerationStats | None = None
    peak_memory_bytes: int | None = None
