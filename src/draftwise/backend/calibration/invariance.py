"""Batch invariance, measured on the running machine.

A verification row is only as exact as the kernels under it: the same row must come out of a product with the same
bits whether the product has 1, 3 or 40 rows. Whether a kernel does depends on the library and the CPU (on one
machine a float32 product changes its rounding at 1, 2, 4, 8 and 12 rows, bfloat16 only at 1, oneDNN's packed
products never beyond 1), so nothing here is assumed:

- :func:`min_invariant_rows` finds the smallest row count from which a kernel gives every row the same result for
  every larger count it is checked at (each row compared whole, with ``torch.equal``);
- :func:`check_trees` runs the model itself: plain one-row decoding, then random draft trees around the true
  continuation at many cache lengths, and compares every verification row with the plain row bit for bit;
- :func:`plan_rows` sets a lean target's padding from the first, confirms it with the second, pads more if needed
  and, if no padding is exact, turns draft trees off for that target (exact, just not faster) and says so;
  :func:`check_rows` does the same for a target with no padding to choose (the transformers backend). The
  result is kept per machine, library version, thread count, dtype, model shape and backend code (a digest of its
  sources, :func:`~draftwise.backend.calibration.machine.code_digest`: an edit to the forward measures again).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..forward.lean import BLOCK, MAX_FORWARD_ROWS
from ..rows import RowBlock
from .machine import MeasurementStore, machine_key

#: Row counts a kernel may be padded to, smallest first.
CANDIDATE_MIN_ROWS = (1, 2, 4, 8, 12, 16, 24, 32)
#: Row counts every candidate is checked at (those at or above it), beyond the candidate itself.
SAMPLE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 15, 16, 17, 23, 24, 31, 32, 33, 47, 48, 63, 64, 65, 96, 130, 195,
               257, 390, 520)
#: Paddings tried after the measured one, in order, while whole forwards are not exact (each raised to at least
#: the measured one).
ESCALATION = ((2, 1), (4, 1), (2, 12), (4, 16), (16, 32))


def min_invariant_rows(run: Callable[[int], torch.Tensor], max_rows: int, candidates: Sequence[int] = CANDIDATE_MIN_ROWS) -> int | None:
    """The smallest candidate ``c`` such that ``run(m)`` (the first ``m`` rows of one fixed input through a kernel)
    equals the first ``m`` rows of ``run(max_rows)`` for every checked ``m >= c``; ``None`` if no candidate does."""
    reference = run(max_rows)
    results: dict[int, bool] = {}

    def agrees(rows: int) -> bool:
        if rows not in results:
            results[rows] = torch.equal(run(rows), reference[:rows])
        return results[rows]

    for candidate in candidates:
        checked = sorted({candidate, *(rows for rows in SAMPLE_ROWS if candidate <= rows <= max_rows)})
        if all(agrees(rows) for rows in checked):
            return candidate
    return None


def _min_rows_over(runs: Sequence[Callable[[int], torch.Tensor]], max_rows: int) -> int | None:
    found = [min_invariant_rows(run, max_rows) for run in runs]
    return None if None in found else max(found, default=1)


def probe_linear_rows(target: Any, max_rows: int = MAX_FORWARD_ROWS, seeds: Sequence[int] = (0, 1)) -> int | None:
    """The row count the target's linear products are invariant from (each distinct kind, two random inputs)."""
    layer = target.layers[0]
    runs = []
    for linear in (layer.qkv, layer.output, layer.gate_up, layer.down, target.head):
        for seed in seeds:
            generator = torch.Generator().manual_seed(seed)
            inputs = torch.randn(max_rows, linear.in_features, generator=generator).to(target.dtype).to(target.device)
            runs.append(lambda rows, linear=linear, inputs=inputs: _raw(linear, inputs[:rows]))
    return _min_rows_over(runs, max_rows)


def _raw(linear: Any, inputs: torch.Tensor) -> torch.Tensor:
    """The kernel itself, without the padding a row plan adds."""
    saved, linear.min_rows = linear.min_rows, 1
    try:
        return linear(inputs)
    finally:
        linear.min_rows = saved


def probe_attention_rows(target: Any, max_rows: int | None = None, seeds: Sequence[int] = (0, 1)) -> int | None:
    """The row count attention's two products (scores, and weighted values over one block) are invariant from."""
    head_dim, block = target.head_dim, target.block
    max_rows = max_rows or 65 * target.group
    runs = []
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)

        def make(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(target.dtype).to(target.device)

        queries, keys = make(3, max_rows, head_dim), make(3, head_dim, block)
        weights, values = make(3, max_rows, block).abs(), make(3, block, head_dim)
        runs.append(lambda rows, q=queries, k=keys: torch.bmm(q[:, :rows], k).transpose(0, 1))
        runs.append(lambda rows, w=weights, v=values: torch.bmm(w[:, :rows], v).transpose(0, 1))
    return _min_rows_over(runs, max_rows)


@dataclass
class InvarianceReport:
    """What :func:`check_trees` found.

    Attributes:
        rows_checked: verification rows compared with plain decoding.
        mismatches: descriptions of the rows that differed (empty when exact).
    """

    rows_checked: int = 0
    mismatches: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.rows_checked > 0 and not self.mismatches


@torch.inference_mode()
def check_trees(
    target: Any, trials: int = 12, steps: int = 40, prompt_length: int = 90, seed: int = 0, batch: int = 4
) -> InvarianceReport:
    """Compare verification rows with plain one-row decoding, bit for bit, on the target itself.

    A random prompt is prefilled and decoded greedily ``steps`` tokens, one row per forward. Then, ``trials`` times
    at a random point of that continuation, a tree holding the true next tokens among random siblings (in random
    order, so that ancestors sit among other nodes; every third one a chain of the true tokens alone) is verified on
    a cache of that length; every row on the true path must equal the plain row at its position. Then the same trees
    are verified ``batch`` at a time in one forward on fresh caches (as a batch of sequences runs), and must give the
    same rows again.
    """
    rng = random.Random(seed)
    vocab = target.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(prompt_length)]
    cache = target.new_cache(prompt_length + steps + 80)
    first = target.prefill([cache], [prompt]).logits[0][-1]
    generated = [int(torch.argmax(first))]
    plain: list[torch.Tensor] = []
    for _ in range(steps):
        logits = target.forward([cache], [RowBlock.chain([generated[-1]])]).logits[0][0]
        target.commit(cache, [0])
        plain.append(logits)
        generated.append(int(torch.argmax(logits)))
    report = InvarianceReport()
    trees: list[tuple[Any, RowBlock, list[tuple[int, torch.Tensor]]]] = []
    for trial in range(trials):
        start = rng.randrange(0, steps - 1)
        depth = rng.randint(1, min(8, steps - start - 1))
        truth = generated[start + 1 : start + 1 + depth]
        paths = [truth]
        for level in range(depth if trial % 3 else 0):
            for _ in range(rng.randint(0, 3)):
                paths.append([*truth[:level], rng.randrange(vocab), *(rng.randrange(vocab) for _ in range(rng.randint(0, 2)))])
        rng.shuffle(paths)
        rows, parents, index = [generated[start]], [-1], {(): 0}
        for path in paths:
            for level in range(len(path)):
                key = tuple(path[: level + 1])
                if key not in index:
                    index[key] = len(rows)
                    rows.append(path[level])
                    parents.append(index[key[:-1]])
        block = RowBlock(tuple(rows), tuple(parents))
        logits = target.forward([_cache_at(target, prompt, generated, start, steps)], [block]).logits[0]
        expected = [(index[tuple(truth[:level])], plain[start + level]) for level in range(depth + 1)]
        trees.append((start, block, expected))
        where = f"trial {trial}: tree of {len(rows)} rows at cache length {prompt_length + start}"
        _compare(report, logits, expected, where)
    # The same trees several at a time in one forward (ragged rows and cache lengths): a batch must not change them.
    for first in range(0, len(trees), batch):
        group = trees[first : first + batch]
        caches = [_cache_at(target, prompt, generated, start, steps) for start, _, _ in group]
        output = target.forward(caches, [block for _, block, _ in group])
        for offset, ((_, block, expected), logits) in enumerate(zip(group, output.logits)):
            _compare(report, logits, expected, f"trial {first + offset} in a batch of {len(group)}")
    return report


def _cache_at(target: Any, prompt: list[int], generated: list[int], start: int, steps: int) -> Any:
    """A fresh cache holding ``prompt`` and the first ``start`` generated tokens."""
    cache = target.new_cache(len(prompt) + steps + 80)
    target.prefill([cache], [prompt])
    if start:
        target.forward([cache], [RowBlock.chain(generated[:start])])
        target.commit(cache, range(start))
    return cache


def _compare(report: InvarianceReport, logits: torch.Tensor, expected: list[tuple[int, torch.Tensor]], where: str) -> None:
    for level, (row, plain_row) in enumerate(expected):
        report.rows_checked += 1
        if not torch.equal(logits[row], plain_row):
            difference = float((logits[row].float() - plain_row.float()).abs().max())
            report.mismatches.append(f"{where}, depth {level}: max difference {difference:.2e}")


def model_shape(target: Any) -> dict[str, Any]:
    config = target.config
    shape = {
        "backend": target.backend,
        "type": config.model_type,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "intermediate": config.intermediate_size,
        "vocab": config.vocab_size,
        "packed": getattr(target, "packed", None),
        "block": getattr(target, "block", None),
        "step_rows": getattr(target, "step_rows", None),  # (the graphed forward's fixed step width)
        "attention": getattr(target, "attention_path", None),
        "linear": getattr(target, "linear_path", None),
        "activation_bits": getattr(target, "kernel_activation_bits", None),
        # The compiled kernels' build (their sources, flags and the machine): new kernels are measured anew.
        "kernels": getattr(target, "kernels_build", None),
    }
    if getattr(target, "compiled", False):  # (a compiled GPU step rounds and costs apart from the eager one)
        shape["compiled"] = True
    if target.kv_dtype != target.dtype:  # (a cache in another dtype than the activations': its own rounding and costs)
        shape["kv_cache"] = str(target.kv_dtype)
    return shape


@dataclass
class RowPlan:
    """How a lean target pads its products, and whether that makes draft trees exact on this machine.

    Attributes:
        linear_min_rows, attention_min_rows: the paddings.
        linear_fixed: linear products run at exactly ``linear_min_rows`` rows (GPUs).
        exact: whether the end-to-end check passed with them (if not, the target verifies no drafts).
        report: the check's findings.
    """

    linear_min_rows: int
    attention_min_rows: int
    exact: bool
    report: InvarianceReport | None = None
    linear_fixed: bool = False


def plan_rows(target: Any, store: MeasurementStore | None = None, trials: int = 12) -> RowPlan:
    """Measure (or recall) the paddings that make ``target``'s verification rows exact, and apply them.

    Padding more is tried when the measured one still lets a whole forward differ; if none is exact, draft trees are
    turned off for the target (``target.exact_trees = False``) with a warning: generation stays exact, at the speed
    of plain decoding.
    """
    store = store if store is not None else MeasurementStore()
    key = machine_key(target.device, target.dtype, model_shape(target))
    saved = store.load(key).get("row_plan")
    if saved:
        plan = RowPlan(saved["linear_min_rows"], saved["attention_min_rows"], saved["exact"],
                       linear_fixed=saved.get("linear_fixed", False))
        _apply(target, plan)
        return plan
    plan = _check_fixed_rows(target, trials) if target.fixed_row_plan else _measure_padding(target, trials)
    _apply(target, plan)
    record = store.load(key)
    record["row_plan"] = {
        "linear_min_rows": plan.linear_min_rows,
        "attention_min_rows": plan.attention_min_rows,
        "linear_fixed": plan.linear_fixed,
        "exact": plan.exact,
    }
    store.save(key, record)
    return plan


def _check_fixed_rows(target: Any, trials: int) -> RowPlan:
    """A target whose products run at one fixed row count (the CUDA forward) has no padding to choose: its rows are
    checked, longer than a padded target's since the check is cheap there."""
    plan = RowPlan(target.linear_min_rows, target.attention_min_rows, False, linear_fixed=True)
    plan.report = check_trees(target, trials=3 * trials, steps=2 * BLOCK + 10, prompt_length=BLOCK - 7)
    plan.exact = plan.report.exact
    return plan


def _measure_padding(target: Any, trials: int) -> RowPlan:
    """The paddings measured by :func:`probe_linear_rows` and :func:`probe_attention_rows`, confirmed by
    :func:`check_trees`, raised along :data:`ESCALATION` while whole forwards are not exact; then the fastest exact
    linear padding."""
    attention = probe_attention_rows(target) or CANDIDATE_MIN_ROWS[-1]
    linear = probe_linear_rows(target) or CANDIDATE_MIN_ROWS[-1]
    ladder = [(linear, attention), *((max(linear, rows), max(attention, rows_)) for rows, rows_ in ESCALATION)]
    plan = RowPlan(linear, attention, False)
    for linear_rows, attention_rows in dict.fromkeys(ladder):
        plan = RowPlan(linear_rows, attention_rows, False)
        target.set_row_plan(plan.linear_min_rows, plan.attention_min_rows)
        plan.report = check_trees(target, trials=trials)
        plan.exact = plan.report.exact
        if plan.exact:
            break
    return _fastest_padding(target, plan, trials) if plan.exact else plan


#: Larger linear paddings tried for speed once a plan is exact (a matrix-vector kernel can be slower than a
#: few-row product: on one CPU padding 1 row to 4 made the linear layers 10% faster).
SPEED_PADDINGS = (2, 4, 8)
#: How much faster (as a fraction) a larger padding must measure to be taken.
SPEED_MARGIN = 0.05


@torch.inference_mode()
def _one_row_seconds(target: Any, repeats: int = 7) -> float:
    """Median seconds of a one-row forward over a short cache (what plain decoding pays per token)."""
    import statistics
    import time

    cache = target.new_cache(160)
    target.prefill([cache], [[3] * 128])
    block = RowBlock.chain([5])
    target.forward([cache], [block])
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.forward([cache], [block])
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def _fastest_padding(target: Any, plan: RowPlan, trials: int) -> RowPlan:
    """Among exact linear paddings, the one whose one-row forward is fastest (checked exact again if it changes)."""
    timings = {}
    for rows in sorted({plan.linear_min_rows, *(rows for rows in SPEED_PADDINGS if rows > plan.linear_min_rows)}):
        target.set_row_plan(rows, plan.attention_min_rows)
        timings[rows] = _one_row_seconds(target)
    best = min(timings, key=lambda rows: (timings[rows], rows))
    # A padding costs work on every row: it is taken only when clearly faster, not on a noisy measurement's say.
    if best == plan.linear_min_rows or timings[best] > (1 - SPEED_MARGIN) * timings[plan.linear_min_rows]:
        target.set_row_plan(plan.linear_min_rows, plan.attention_min_rows)
        return plan
    target.set_row_plan(best, plan.attention_min_rows)
    report = check_trees(target, trials=trials)
    if not report.exact:
        target.set_row_plan(plan.linear_min_rows, plan.attention_min_rows)
        return plan
    return RowPlan(best, plan.attention_min_rows, True, report)


def _apply(target: Any, plan: RowPlan) -> None:
    if not target.fixed_row_plan:
        target.set_row_plan(plan.linear_min_rows, plan.attention_min_rows)
    _set_exactness(target, plan.exact, "with any padding tried")


def _set_exactness(target: Any, exact: bool, how: str) -> None:
    """Let ``target`` draft or not by what its check found; where not, say why (in its statistics and a warning)."""
    target.exact_trees = exact
    target.drafting_off_reason = None if exact else (
        f"verification rows differ from one-row decoding on this machine ({target.backend} forward in "
        f"{str(target.dtype).removeprefix('torch.')}, {how})")
    if not exact:
        warnings.warn(
            f"draft verification is not bitwise exact on this machine ({target.backend} forward, {how}); drafting "
            f"is off for this model in {target.dtype} (generation stays exact, at plain decoding's speed). Run "
            "`draftwise doctor` for details.",
            RuntimeWarning,
            stacklevel=4,
        )


def check_rows(target: Any, store: MeasurementStore | None = None, trials: int = 12) -> bool:
    """Check (or recall) whether a target with no padding to choose (the transformers backend's) gives verification
    rows bitwise plain decoding's on this machine (:func:`check_trees`), and let it draft only if so. Kept per
    machine, library version, thread count, dtype, model shape and backend code, as row plans are."""
    store = store if store is not None else MeasurementStore()
    key = machine_key(target.device, target.dtype, model_shape(target))
    record = store.load(key)
    saved = record.get("row_check")
    if saved is None:
        saved = {"exact": check_trees(target, trials=trials).exact}
        record["row_check"] = saved
        store.save(key, record)
    _set_exactness(target, bool(saved["exact"]), "checked at load")
    return target.exact_trees
