"""An A/B comparison of two configurations in one process (``draftwise bench --interleave "A;B" --rounds N``).

A busy machine drifts (its memory bandwidth can change twofold within minutes), so two configurations timed in two
separate runs are compared across whatever the machine did in between. Here both run round by round in one process,
on one loaded model: each round runs every prompt (its first turn) under A and under B, one right after the other, A
first in odd rounds and B first in even ones. Each round gives both configurations' tokens/s (total new tokens /
total time over the prompts) and the ratio B/A; the ratios of the rounds give the result, their median, and their
spread (interquartile and min-max range), which says how far the ratio can be trusted on this machine.

A configuration is a method spec as ``--methods`` takes it, optionally at a draft budget written ``@N``, or a
transformers or llama.cpp row: ``"ar;aded"``, ``"pld@8;pld@16"``, ``"aded;aded:max_depth=4"``, ``"hf;ar"``. The
same spec on both sides (``"ar;ar"``) measures the machine's own noise: its ratios spread around 1. Every round
builds each configuration's drafter afresh and warms it up, so that a drafter that learns from outputs never meets a
prompt it has already answered. For greedy decoding every prompt's ids of A and B are compared: lossless methods
produce identical ids.

Settings that need a process of their own (the dtype, the backend, another source tree) cannot be interleaved here:
alternate short runs of the two (A, B, A, B, ...) and compare their medians; where only a method differs between two
source trees, each tree's interleaved ratio over ``ar`` (``--interleave "ar;aded"``) cancels most of the drift.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..decoding.sampling import SamplingParams
from ..drafters import check_method, make_drafter
from ..errors import InvalidRequestError
from .metrics import percentile, total_rate
from .prompts import Prompt
from .results import Record
from .run import WARMUP_PROMPT, WARMUP_TOKENS, Benchmark, Row, RowTimer, _encode, _record, parse_methods

#: The two sides of a comparison; the ratio reported is the second's tokens/s over the first's.
SIDES = ("A", "B")


def parse_configuration(spec: str) -> Row:
    """One side of a comparison as a row: a method spec, with ``@N`` at its end for a draft budget (``pld@8``)."""
    method, at, budget_text = spec.strip().rpartition("@")
    if not at or not budget_text.isdigit():
        method, budget = spec.strip(), None
    else:
        budget = int(budget_text)
    if not method:
        raise InvalidRequestError(f"bad configuration {spec!r}: expected a method spec, optionally with @budget")
    row = Row(method, budget)
    if not row.is_external:
        check_method(method)
    elif budget is not None:
        raise InvalidRequestError(f"bad configuration {spec!r}: {method} has no draft budget")
    return row


#: Rounds of an interleaved comparison unless told otherwise (each configuration first in half of them).
DEFAULT_ROUNDS = 6


def parse_interleave(text: str) -> tuple[Row, Row]:
    """``"A;B"`` as the two rows to compare (each side as :func:`parse_configuration` reads it; a side's own options
    are comma-separated, so ``;`` is the clearer separator, though ``,`` works as in ``--methods``)."""
    specs = parse_methods(text)
    if len(specs) != 2:
        raise InvalidRequestError(
            f"--interleave compares two configurations, as \"A;B\" (e.g. \"ar;aded\"), got {len(specs)} in {text!r}"
        )
    first, second = (parse_configuration(spec) for spec in specs)
    return first, second


@dataclass
class InterleaveRound:
    """One round: every prompt under both configurations.

    Attributes:
        number: 1-based.
        first: the side that ran first on every prompt of this round (``"A"`` or ``"B"``).
        records: each side's runs (one per prompt, ``repeat`` = the round's index), by side.
        identical_ids: prompts whose ids under A and under B are identical (greedy runs; ``None`` when sampling).
    """

    number: int
    first: str
    records: dict[str, list[Record]] = field(repr=False)
    identical_ids: int | None = None

    def tokens_per_s(self, side: str) -> float:
        """One side's total new tokens / total time over the round's prompts."""
        return total_rate(self.records[side])

    @property
    def ratio(self) -> float:
        """B's tokens/s over A's (0 when A has no time)."""
        base = self.tokens_per_s("A")
        return self.tokens_per_s("B") / base if base else 0.0

    def summary(self) -> dict[str, Any]:
        """The round's rates, ratio and id agreement, JSON-ready."""
        return {
            "round": self.number,
            "first": self.first,
            "a_tokens_per_s": round(self.tokens_per_s("A"), 3),
            "b_tokens_per_s": round(self.tokens_per_s("B"), 3),
            "ratio": round(self.ratio, 4),
            "identical_ids": self.identical_ids,
            "prompts": len(self.records["A"]),
        }


@dataclass
class InterleaveResult:
    """The rounds of an A/B comparison and what they add up to (see :meth:`summary`)."""

    a: Row
    b: Row
    rounds: list[InterleaveRound]
    greedy: bool

    @property
    def ratios(self) -> list[float]:
        """Each round's B/A ratio, in round order."""
        return [round_.ratio for round_ in self.rounds]

    def summary(self) -> dict[str, Any]:
        """Median tokens/s of each side over the rounds, the median B/A ratio with its interquartile and min-max
        range, and how many (round, prompt) runs gave A and B identical ids (greedy runs; ``None`` when sampling)."""
        ratios = self.ratios
        compared = sum(len(round_.records["A"]) for round_ in self.rounds)
        return {
            "a": self.a.label,
            "b": self.b.label,
            "rounds": len(self.rounds),
            "prompts": len(self.rounds[0].records["A"]) if self.rounds else 0,
            "a_tokens_per_s": statistics.median(round_.tokens_per_s("A") for round_ in self.rounds),
            "b_tokens_per_s": statistics.median(round_.tokens_per_s("B") for round_ in self.rounds),
            "ratio": statistics.median(ratios),
            "ratio_q1": percentile(ratios, 25),
            "ratio_q3": percentile(ratios, 75),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "identical_ids": sum(round_.identical_ids or 0 for round_ in self.rounds) if self.greedy else None,
            "compared_runs": compared,
        }


def run_interleaved(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    pair: tuple[Row, Row],
    rounds: int,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    *,
    chat_template: bool = True,
    draft_model: Any = None,
    anchors: dict[str, Any] | None = None,
    warmup: bool = True,
    on_progress: Callable[[str, Prompt, float], None] | None = None,
    on_round: Callable[[InterleaveRound], None] | None = None,
) -> InterleaveResult:
    """Run ``pair`` (A, B) round by round over the first turns of ``prompts`` (see this module's docstring).

    Args:
        rounds: how many rounds; each runs every prompt once under A and once under B.
        sampling: the sampling options of every run (greedy when ``None``).
        chat_template: feed prompts through the tokenizer's chat template.
        draft_model, anchors: the ``hf-assisted`` draft model and the llama.cpp runners, when a side needs them.
        warmup: warm each configuration up (on a prompt outside the data) at the start of every round.
        on_progress: called after each timed run with the side (``"A"`` or ``"B"``), the prompt and the side's
            tokens/s so far in this round.
        on_round: called with each round as it finishes.
    """
    if rounds < 1:
        raise InvalidRequestError(f"--rounds must be at least 1, got {rounds}")
    if not prompts:
        raise InvalidRequestError("no prompts selected")
    sampling = sampling or SamplingParams()
    timer = RowTimer(model, tokenizer, sampling, draft_model, anchors)
    rows = dict(zip(SIDES, pair))
    timer.check_rows(list(rows.values()))
    prompt_ids = [_encode(tokenizer, prompt.conversation(1, []), chat_template) for prompt in prompts]
    warm_up_ids = _encode(tokenizer, WARMUP_PROMPT, chat_template) if warmup else None
    finished: list[InterleaveRound] = []
    for index in range(rounds):
        order = SIDES if index % 2 == 0 else SIDES[::-1]
        drafters = {side: None if row.is_external else make_drafter(row.method) for side, row in rows.items()}
        if warm_up_ids is not None:
            for side in order:
                timer.measure(rows[side], drafters[side], warm_up_ids, min(WARMUP_TOKENS, max_new_tokens))
        records: dict[str, list[Record]] = {side: [] for side in SIDES}
        for prompt, ids in zip(prompts, prompt_ids):
            for side in order:
                measured = timer.measure(rows[side], drafters[side], ids, max_new_tokens)
                records[side].append(_record(rows[side], prompt, 1, index, measured))
                if on_progress is not None:
                    on_progress(side, prompt, total_rate(records[side]))
        identical = None
        if sampling.greedy:
            identical = sum(a.token_ids == b.token_ids for a, b in zip(records["A"], records["B"]))
        finished.append(InterleaveRound(index + 1, order[0], records, identical))
        if on_round is not None:
            on_round(finished[-1])
    return InterleaveResult(pair[0], pair[1], finished, sampling.greedy)


def write_interleave_json(path: str | Path, result: InterleaveResult, env: dict, settings: dict) -> None:
    """The comparison's summary, every round's rates, every run (with ``side``), the environment and the settings,
    as JSON."""
    records = [
        {**record.to_json(), "side": side, "round": round_.number}
        for round_ in result.rounds
        for side in SIDES
        for record in round_.records[side]
    ]
    payload = {
        "settings": settings,
        "environment": env,
        "interleave": result.summary(),
        "rounds": [round_.summary() for round_ in result.rounds],
        "records": records,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1))


def interleave_benchmark(
    benchmark: Benchmark,
    pair: tuple[Row, Row],
    rounds: int,
    on_progress: Callable[[str, Prompt, float], None] | None = None,
    on_round: Callable[[InterleaveRound], None] | None = None,
) -> InterleaveResult:
    """:func:`run_interleaved` over a prepared :class:`~draftwise.bench.run.Benchmark`'s model, prompts and settings
    (first turns only, once a round)."""
    settings = benchmark.settings
    if settings.budgets or settings.turns != [1] or settings.repeats != 1:
        raise InvalidRequestError("--interleave runs first turns once a round: drop --sweep, --turns and --repeats")
    return run_interleaved(
        benchmark.model, benchmark.tokenizer, benchmark.prompts, pair, rounds, settings.max_new_tokens,
        settings.sampling, chat_template=settings.chat_template, draft_model=benchmark.draft_model,
        anchors=benchmark.anchors, on_progress=on_progress, on_round=on_round,
    )
