"""The batched benchmark (``draftwise bench --batch-size 1,4,8``): every prompt submitted at once, decoded ``N`` at
a time by the continuous-batching scheduler, for each draftwise row and batch size.

Reported per (row, batch size): aggregate tokens/s (all new tokens over the wall time of the whole batch), each
request's latency (from its admission to its last token, and from submission, queueing included), mean accepted
tokens per step, and how many prompts got exactly the ids they get at batch size 1 (the exactness guarantee; batch
size 1 is always run as the reference).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..api import generate
from ..backend.target import as_target
from ..decoding.drafter import Drafter
from ..decoding.latency import LatencyModel
from ..decoding.sampling import SamplingParams
from ..errors import InvalidRequestError
from .metrics import percentile

#: Tokens of the warm-up batch at each batch size.
WARMUP_TOKENS = 16


@dataclass
class BatchRecord:
    """One row at one batch size, over every prompt.

    Attributes:
        label: the row (method spec).
        batch_size: most sequences per forward.
        prompts: how many prompts were submitted.
        new_tokens: tokens generated over all prompts.
        wall_s: seconds from submitting every prompt to the last one finishing.
        latency_s: each request's seconds from its admission (prefill) to its last token.
        queued_latency_s: each request's seconds from submission to its last token (waiting for a slot included).
        steps: decoding steps summed over the prompts.
        exact: prompts whose ids equal the row's batch-1 ids (in every pass).
        exact_vs_ar: prompts whose ids equal ``ar``'s batch-1 ids (in every pass; greedy runs).
        token_ids: every prompt's generated ids.
        pass_tokens_per_s: each timed pass's aggregate tokens/s; with several passes, the other fields are those of
            the median pass.
    """

    label: str
    batch_size: int
    prompts: int
    new_tokens: int
    wall_s: float
    latency_s: list[float]
    queued_latency_s: list[float]
    steps: int
    exact: int = 0
    exact_vs_ar: int | None = None
    token_ids: list[list[int]] = field(default_factory=list, repr=False)
    pass_tokens_per_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    def summary(self) -> dict[str, Any]:
        """The record's metrics without the ids, rounded, JSON-ready."""
        return {
            "row": self.label,
            "batch_size": self.batch_size,
            "prompts": self.prompts,
            "new_tokens": self.new_tokens,
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 3),
            "latency_p50_s": round(percentile(self.latency_s, 50), 3),
            "latency_p90_s": round(percentile(self.latency_s, 90), 3),
            "queued_latency_p50_s": round(percentile(self.queued_latency_s, 50), 3),
            "queued_latency_p90_s": round(percentile(self.queued_latency_s, 90), 3),
            "exact_vs_batch_1": f"{self.exact}/{self.prompts}",
            "exact_vs_ar": None if self.exact_vs_ar is None else f"{self.exact_vs_ar}/{self.prompts}",
            "passes": max(1, len(self.pass_tokens_per_s)),
            "tokens_per_s_range": [round(min(self.pass_tokens_per_s), 2), round(max(self.pass_tokens_per_s), 2)]
            if self.pass_tokens_per_s else None,
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,4,8"`` as batch sizes (1 is added: it is the reference every batch is compared with)."""
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise InvalidRequestError(f"--batch-size takes positive integers separated by commas, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise InvalidRequestError(f"--batch-size takes positive integers separated by commas, got {text!r}")
    return sorted({1, *sizes})


def run_batched(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    drafters: dict[str, Callable[[], Drafter]],
    batch_sizes: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    warm_up_ids: Sequence[int] | None = None,
    on_record: Callable[[BatchRecord], None] | None = None,
    repeats: int = 1,
) -> list[BatchRecord]:
    """Run every row (``drafters``: a function making each row's drafter, by label, ``ar`` among them) at every batch
    size over all of ``prompt_ids``.

    Every (row, batch size) starts from a drafter made afresh (a batch forks it per sequence, sharing what it learns)
    and warmed up on ``warm_up_ids`` at that batch size: a drafter that learns across requests (ADED's n-gram matrix,
    Token Recycling's table, Lookahead's pool) would otherwise meet, from the second batch size on, the very outputs
    it learned at the first. All rows share one forward-time model. Batch size 1 runs first and is each row's
    reference. The rows run one after the other at each batch size (``ar`` first), so that a row and the ``ar`` it
    is compared with are measured minutes apart rather than a whole run apart (CPUs drift). With ``repeats`` passes,
    each batch size runs all its rows, then all of them again, and so on (fresh drafters every pass); a record is
    its median pass (by tokens/s), a prompt counts as exact only if it was in every pass. Records are returned row
    by row.
    """
    if "ar" not in drafters:
        raise InvalidRequestError("the rows need 'ar': it is the reference")
    if not prompt_ids:
        raise InvalidRequestError("no prompts selected")
    if repeats < 1:
        raise InvalidRequestError(f"repeats must be at least 1, got {repeats}")
    sizes = sorted({1, *batch_sizes})
    latency = LatencyModel.of(as_target(model))
    sampling = sampling or SamplingParams()
    records: list[BatchRecord] = []
    reference: dict[str, list[list[int]]] = {}
    labels = ["ar", *(label for label in drafters if label != "ar")]
    for size in sizes:
        passes: dict[str, list[BatchRecord]] = {label: [] for label in labels}
        for _ in range(repeats):
            for label in labels:
                passes[label].append(_timed_pass(model, tokenizer, prompt_ids, drafters[label](), label, size,
                                                 max_new_tokens, latency, sampling, warm_up_ids))
                reference.setdefault(label, passes[label][0].token_ids)
        for label in labels:
            record = _median_pass(passes[label], reference, sampling.greedy)
            records.append(record)
            if on_record is not None:
                on_record(record)
    order = {label: index for index, label in enumerate(drafters)}
    return sorted(records, key=lambda record: (order[record.label], record.batch_size))


def _timed_pass(
    model: Any, tokenizer: Any, prompt_ids: Sequence[Sequence[int]], drafter: Drafter, label: str, size: int,
    max_new_tokens: int, latency: LatencyModel, sampling: SamplingParams, warm_up_ids: Sequence[int] | None,
) -> BatchRecord:
    """One row's pass over every prompt at one batch size (its exact counts are set by :func:`_median_pass`)."""
    if warm_up_ids is not None:
        generate(model, tokenizer, prompt_ids=[list(warm_up_ids)] * size, method=drafter,
                 max_new_tokens=WARMUP_TOKENS, latency=latency, sampling=sampling, max_batch=size)
    started = time.perf_counter()
    results = generate(model, tokenizer, prompt_ids=[list(ids) for ids in prompt_ids], method=drafter,
                       max_new_tokens=max_new_tokens, latency=latency, sampling=sampling, max_batch=size)
    wall = time.perf_counter() - started
    ids = [result.token_ids for result in results]
    return BatchRecord(
        label=label,
        batch_size=size,
        prompts=len(results),
        new_tokens=sum(len(tokens) for tokens in ids),
        wall_s=wall,
        latency_s=[result.stats.time_s for result in results],
        queued_latency_s=[result.stats.queue_time_s + result.stats.time_s for result in results],
        steps=sum(result.stats.steps for result in results),
        token_ids=ids,
    )


def _median_pass(passes: Sequence[BatchRecord], reference: dict[str, list[list[int]]], greedy: bool) -> BatchRecord:
    """The pass of median tokens/s (the lower of the two middle ones), with every pass's rate; a prompt counts as
    exact (vs the row's batch-1 ids, and of greedy runs vs ``ar``'s) if its ids were in every pass."""
    ranked = sorted(passes, key=lambda record: record.tokens_per_s)
    median = ranked[(len(ranked) - 1) // 2]
    median.pass_tokens_per_s = [record.tokens_per_s for record in passes]

    def exact_in_every_pass(expected: list[list[int]]) -> int:
        return sum(all(record.token_ids[index] == ids for record in passes) for index, ids in enumerate(expected))

    median.exact = exact_in_every_pass(reference[median.label])
    median.exact_vs_ar = exact_in_every_pass(reference["ar"]) if greedy else None
    return median


def batch_table_rows(records: Sequence[BatchRecord]) -> list[dict[str, Any]]:
    """Each record's summary with its speed relative to the same row at batch 1 and to ``ar`` at the same batch
    size."""
    rate = {(record.label, record.batch_size): record.tokens_per_s for record in records}
    rows = []
    for record in records:
        summary = record.summary()
        one = rate.get((record.label, 1))
        ar = rate.get(("ar", record.batch_size))
        summary["vs_batch_1"] = round(record.tokens_per_s / one, 2) if one else None
        summary["vs_ar"] = round(record.tokens_per_s / ar, 2) if ar else None
        rows.append(summary)
    return rows


def write_batched_json(
    path: str, rows: Sequence[dict[str, Any]], records: Sequence[BatchRecord], env: dict, settings: dict
) -> None:
    """The batched benchmark's table rows, every record (with ids), the environment and the settings, as JSON."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    payload = {"settings": settings, "environment": env, "summary": list(rows),
               "records": [record.to_json() for record in records]}
    Path(path).write_text(json.dumps(payload, indent=1))
