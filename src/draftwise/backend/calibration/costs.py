"""The verification forward's cost by row count, of chains and of trees, measured on the running machine.

How much a draft node costs decides how big a tree pays, and it differs a lot between machines: on one CPU a
16-row forward costs twice a one-row forward, on another barely more, on a GPU nothing. The curves are measured once
per model, dtype and machine (a few seconds), kept on disk, and handed to the engine's latency model as its prior;
the engine goes on refining it from the forwards it runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..rows import RowBlock
from .invariance import model_shape
from .machine import MeasurementStore, finish_queued_work, machine_key

#: Row counts the curves are measured at (the latency model interpolates between them); trees from three rows (the
#: root and two children).
CURVE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: A curve where some row count took less than this share of a smaller count's time was measured while something
#: else ran (a forward of more rows never costs less): it is measured again, when measured and when recalled. Kept,
#: such a curve priced drafts on that machine for good (seen: 16 rows at 24x one row, 8 rows at a third of 6 rows'
#: time, and drafting all but off).
DISTURBED_BELOW = 0.8
#: Measurements of a curve at most, while they come out disturbed.
MEASURE_ATTEMPTS = 3


@dataclass(frozen=True)
class CostCurves:
    """Median forward seconds by row count of chains (each row follows the one before it) and of trees (rows that
    branch): a target may verify a chain on a leaner path than a tree of as many rows."""

    chain: dict[int, float]
    tree: dict[int, float]


def disturbed(curves: CostCurves, below: float = DISTURBED_BELOW) -> bool:
    """Whether some row count of ``curves`` took less than ``below`` times the time of a smaller count of the same
    kind: a sign that the machine was busy with something else while they were measured."""
    for curve in (curves.chain, curves.tree):
        dearest = 0.0
        for rows in sorted(curve):
            if curve[rows] < below * dearest:
                return True
            dearest = max(dearest, curve[rows])
    return False


def two_branches(count: int) -> tuple[int, ...]:
    """Row parents of a ``count``-row tree: the root, then two paths below it taking rows in turn (the shape of
    prompt lookup's two best matches)."""
    return (-1, *(0 if row <= 2 else row - 2 for row in range(1, count)))


@torch.inference_mode()
def measure_cost_curves(
    target: Any, rows: tuple[int, ...] = CURVE_ROWS, cache_length: int = 512, repeats: int = 5
) -> CostCurves:
    """Median seconds of a verification forward of each row count in ``rows`` over ``cache_length`` cached
    positions, of a chain and (from three rows) of a :func:`two_branches` tree, taken in turn (every shape once a
    round) so that all of them see the machine in the same states."""
    vocab = target.config.vocab_size
    cache_length = min(cache_length, target.context_length - max(rows) - 1)
    cache = target.new_cache(cache_length + max(rows) + 1)
    target.prefill([cache], [[(7 * position) % vocab for position in range(cache_length)]])
    seconds: dict[str, dict[int, list[float]]] = {"chain": {}, "tree": {}}
    blocks: dict[int, dict[str, RowBlock]] = {}
    for count in rows:
        tokens = tuple((11 * row) % vocab for row in range(count))
        blocks[count] = {"chain": RowBlock.chain(tokens)}
        if count >= 3:
            blocks[count]["tree"] = RowBlock(tokens, two_branches(count))
        for block in blocks[count].values():
            target.forward([cache], [block])  # warm this shape up
    # Round after round over every row count: a machine whose speed drifts (memory bandwidth shared with others)
    # then shifts the whole curve, not the ratio between two row counts measured minutes apart.
    for _ in range(repeats):
        for count in rows:
            for shape, block in blocks[count].items():
                started = time.perf_counter()
                target.forward([cache], [block])
                finish_queued_work(target.device)
                seconds[shape].setdefault(count, []).append(time.perf_counter() - started)
    medians = {shape: {count: statistics.median(times) for count, times in by_rows.items()}
               for shape, by_rows in seconds.items()}
    return CostCurves(medians["chain"], medians["tree"])


def cost_curves(target: Any, store: MeasurementStore | None = None, measure: bool = True) -> CostCurves | None:
    """The target's cost curves: recalled from this machine's measurements, else measured (when ``measure``) and
    kept. A recalled or new curve that looks :func:`disturbed` is measured again (up to :data:`MEASURE_ATTEMPTS`
    times; the last is kept)."""
    store = store if store is not None else MeasurementStore()
    # (New compiled kernels change the costs: they are measured again.)
    key = machine_key(target.device, target.dtype, {**model_shape(target), "backend": target.backend,
                                                    "kernels": getattr(target, "kernels_build", None)})
    record = store.load(key)
    saved = record.get("cost_curves")
    if saved:
        curves = CostCurves(*({int(rows): float(value) for rows, value in saved[shape].items()}
                              for shape in ("chain", "tree")))
        if not measure or not disturbed(curves):
            return curves
    if not measure:
        return None
    for _ in range(MEASURE_ATTEMPTS):
        curves = measure_cost_curves(target)
        if not disturbed(curves):
            break
    record["cost_curves"] = {
        **{shape: {str(rows): value for rows, value in getattr(curves, shape).items()} for shape in ("chain", "tree")},
    }
    store.save(key, record)
    return curves
