"""Benchmark prompts: Spec-Bench's question file (and any file in its format)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidRequestError

#: Spec-Bench groups the eight MT-Bench categories under one task.
MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
SPEC_BENCH_FILE = Path("data") / "spec_bench" / "question.jsonl"


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: the first user turn of a question."""

    question_id: int | str
    category: str
    subcategory: str
    text: str


def default_spec_bench_path() -> Path | None:
    """Spec-Bench's question file in a ``shared`` folder beside the working directory or this checkout."""
    here = Path(__file__).resolve()
    roots = [Path.cwd(), Path.cwd().parent, *here.parents]
    for root in roots:
        candidate = root / "shared" / SPEC_BENCH_FILE
        if candidate.is_file():
            return candidate
    return None


def load_spec_bench(path: str | Path | None, per_category: int | None = None) -> list[Prompt]:
    """The first turns of the questions in ``path``, ``per_category`` of each task (all when ``None``).

    MT-Bench sub-categories count as one task, ``mt_bench``, and are taken in turn so a small sample covers them all.
    """
    if path is None:
        path = default_spec_bench_path()
        if path is None:
            raise InvalidRequestError(
                "Spec-Bench's question.jsonl was not found beside this checkout; pass its location with --data PATH"
            )
    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"data file {path} does not exist")
    by_category: dict[str, dict[str, list[Prompt]]] = defaultdict(lambda: defaultdict(list))
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                turns = row["turns"]
                if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                    raise TypeError("'turns' must be a non-empty list of strings")
                subcategory = str(row.get("category", "default"))
                question_id = row.get("question_id", line_number)
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
                raise InvalidRequestError(f"{path}:{line_number}: not a question row ({error})") from error
            category = "mt_bench" if subcategory in MT_BENCH_CATEGORIES else subcategory
            by_category[category][subcategory].append(Prompt(question_id, category, subcategory, str(turns[0])))
    prompts: list[Prompt] = []
    for category, groups in by_category.items():
        taken: list[Prompt] = []
        queues = [list(group) for group in groups.values()]
        while queues and (per_category is None or len(taken) < per_category):
            for queue in list(queues):
                if per_category is not None and len(taken) >= per_category:
                    break
                taken.append(queue.pop(0))
                if not queue:
                    queues.remove(queue)
        prompts.extend(taken)
    return prompts
