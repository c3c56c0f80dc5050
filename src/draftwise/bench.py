"""``draftwise bench``: every method, plain decoding and transformers' own generate, side by side on one set of
prompts, in one process, with the same model, dtype and threads.

Rows: each draftwise method (``ar`` is plain greedy decoding through the draftwise engine), ``hf`` (transformers
``model.generate`` greedy) and ``hf-pld`` (its prompt lookup, ``prompt_lookup_num_tokens=10``). For every prompt the
methods run one after another, so slow drifts of the machine hit all of them alike. Timing covers generation only
(tokenization outside), after a warm-up run of every method.

Metrics (see :mod:`draftwise.stats`): ``tokens_per_s`` = total tokens / total time; ``speedup_vs_ar`` and
``speedup_vs_hf`` are ratios of those; ``speedup_vs_ar_mean_rate`` is Spec-Bench's ratio of mean per-question rates;
``mat`` = total tokens / total steps; ``exact_match_vs_ar`` = share of prompts whose token ids equal ``ar``'s.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .api import eos_token_ids, generate
from .data import Prompt
from .drafters import Drafter, make_drafter
from .latency import LatencyModel
from .sampling import SamplingParams

HF_ROWS = ("hf", "hf-pld")
OVERALL = "overall"


@dataclass
class Record:
    """One method's run on one prompt."""

    method: str
    question_id: int | str
    category: str
    new_tokens: int
    time_s: float
    steps: int | None
    token_ids: list[int] = field(repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0


def run_hf(
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos: Sequence[int],
    lookup: bool,
    sampling: SamplingParams | None = None,
) -> tuple[list[int], float]:
    """transformers' own ``generate`` (with its prompt lookup when ``lookup``) with the same sampling options:
    ids and seconds."""
    sampling = sampling or SamplingParams()
    input_ids = torch.tensor([list(prompt_ids)], device=model.device)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    options: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        do_sample=not sampling.greedy,
        temperature=None if sampling.greedy else sampling.temperature,
        top_p=None if sampling.greedy else sampling.top_p,
        top_k=None if sampling.greedy else sampling.top_k,
        min_p=None if sampling.greedy or not sampling.min_p else sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        eos_token_id=list(eos) or None,
        pad_token_id=eos[0] if eos else None,
        attention_mask=torch.ones_like(input_ids),
    )
    if lookup:
        options["prompt_lookup_num_tokens"] = 10
    with torch.inference_mode():
        started = time.perf_counter()
        output = model.generate(input_ids, **options)
        elapsed = time.perf_counter() - started
    return output[0, input_ids.shape[1] :].tolist(), elapsed


def run_method(
    model: Any,
    tokenizer: Any,
    method: str | Drafter,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos: Sequence[int],
    latency: LatencyModel | None = None,
    sampling: SamplingParams | None = None,
) -> tuple[list[int], float, int | None]:
    """One method on one prompt: token ids, generation seconds, steps (``None`` for transformers rows)."""
    sampling = sampling or SamplingParams()
    if isinstance(method, str) and method in HF_ROWS:
        ids, elapsed = run_hf(model, prompt_ids, max_new_tokens, eos, method == "hf-pld", sampling)
        return ids, elapsed, None
    result = generate(
        model,
        tokenizer,
        prompt_ids=prompt_ids,
        method=method,
        max_new_tokens=max_new_tokens,
        latency=latency,
        **dataclasses.asdict(sampling),
    )
    return result.token_ids, result.stats.time_s, result.stats.steps


def validate_methods(methods: Sequence[str]) -> list[str]:
    """Check every method spec (building each drafter once) and put ``ar`` first, adding it if missing."""
    checked = []
    for method in methods:
        if method not in HF_ROWS:
            make_drafter(method)
        if method not in checked:
            checked.append(method)
    if "ar" not in checked:
        checked.insert(0, "ar")
    else:
        checked.insert(0, checked.pop(checked.index("ar")))
    return checked


def summarize(records: Sequence[Record], methods: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per category (and ``overall``) per method: tokens/s, speedups, MAT, exact match against ``ar``."""
    reference = {record.question_id: record.token_ids for record in records if record.method == "ar"}
    categories = sorted({record.category for record in records})
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for category in [*categories, OVERALL]:
        chosen = [record for record in records if category == OVERALL or record.category == category]
        rows: dict[str, dict[str, Any]] = {}
        for method in methods:
            mine = [record for record in chosen if record.method == method]
            if not mine:
                continue
            tokens = sum(record.new_tokens for record in mine)
            seconds = sum(record.time_s for record in mine)
            steps = [record.steps for record in mine]
            matches = [record.token_ids == reference.get(record.question_id) for record in mine]
            rows[method] = {
                "prompts": len(mine),
                "new_tokens": tokens,
                "time_s": seconds,
                "tokens_per_s": tokens / seconds if seconds else 0.0,
                "mean_rate": sum(record.tokens_per_s for record in mine) / len(mine),
                "mat": tokens / sum(steps) if None not in steps and sum(steps) else None,
                "exact_match_vs_ar": sum(matches) / len(matches),
            }
        for method, row in rows.items():
            for baseline in ("ar", "hf"):
                base = rows.get(baseline)
                row[f"speedup_vs_{baseline}"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
                row[f"speedup_vs_{baseline}_mean_rate"] = row["mean_rate"] / base["mean_rate"] if base else None
        summary[category] = rows
    return summary


def environment(model: Any, model_name: str) -> dict[str, Any]:
    """What the numbers were measured on."""
    import transformers

    return {
        "model": model_name,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def run_bench(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    methods: Sequence[str],
    max_new_tokens: int,
    on_progress: Callable[[str, Prompt, float], None] | None = None,
    warmup: bool = True,
    sampling: SamplingParams | None = None,
) -> list[Record]:
    """Run every method on every prompt (methods interleaved per prompt); returns one record per run.

    Each method keeps one drafter for the whole run (what it learns carries over between prompts, as it would in
    a server), and all methods share one forward-time model of this model on this machine.
    """
    eos = eos_token_ids(model, tokenizer)
    encoded = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=True
        )
        for prompt in prompts
    ]
    encoded = [list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids) for ids in encoded]
    latency = LatencyModel()
    runners: dict[str, str | Drafter] = {
        method: method if method in HF_ROWS else make_drafter(method) for method in methods
    }
    if warmup and prompts:
        for method in methods:
            run_method(model, tokenizer, method, encoded[0], min(16, max_new_tokens), eos, latency, sampling)
    records: list[Record] = []
    totals: dict[str, list[float]] = {method: [0, 0.0] for method in methods}
    for prompt, prompt_ids in zip(prompts, encoded):
        for method in methods:
            ids, seconds, steps = run_method(
                model, tokenizer, runners[method], prompt_ids, max_new_tokens, eos, latency, sampling
            )
            records.append(Record(method, prompt.question_id, prompt.category, len(ids), seconds, steps, ids))
            totals[method][0] += len(ids)
            totals[method][1] += seconds
            if on_progress is not None:
                on_progress(method, prompt, totals[method][0] / max(totals[method][1], 1e-9))
    return records


def write_json(path: str | Path, summary: dict, records: Sequence[Record], env: dict, settings: dict) -> None:
    payload = {
        "environment": env,
        "settings": settings,
        "methods": summary[OVERALL],
        "categories": {category: rows for category, rows in summary.items() if category != OVERALL},
        "records": [
            {
                "method": record.method,
                "question_id": record.question_id,
                "category": record.category,
                "new_tokens": record.new_tokens,
                "time_s": record.time_s,
                "tokens_per_s": record.tokens_per_s,
                "steps": record.steps,
                "token_ids": record.token_ids,
            }
            for record in records
        ],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1))
