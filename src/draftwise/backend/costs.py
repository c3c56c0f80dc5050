"""The verification forward's cost by row count, measured on the running machine.

How much a draft node costs decides how big a tree pays, and it differs a lot between machines: on one CPU a
16-row forward costs twice a one-row forward, on another barely more, on a GPU nothing. The curve is measured once
per model, dtype and machine (a few seconds), kept on disk, and handed to the engine's latency model as its prior;
the engine goes on refining it from the forwards it runs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .invariance import model_shape
from .machine import MeasurementStore, machine_key
from .rows import RowBlock

#: Row counts the curve is measured at (the latency model interpolates between them).
CURVE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
CURVE_VERSION = 1


@torch.inference_mode()
def measure_cost_curve(
    target: Any, rows: tuple[int, ...] = CURVE_ROWS, cache_length: int = 512, repeats: int = 3
) -> dict[int, float]:
    """Median seconds of a verification forward of each row count in ``rows`` over ``cache_length`` cached
    positions (chain-shaped rows; the tree's shape does not change the work)."""
    vocab = target.config.vocab_size
    cache_length = min(cache_length, target.context_length - max(rows) - 1)
    cache = target.new_cache(cache_length + max(rows) + 1)
    target.prefill([cache], [[(7 * position) % vocab for position in range(cache_length)]])
    curve: dict[int, float] = {}
    for count in rows:
        block = RowBlock.chain([(11 * row) % vocab for row in range(count)])
        target.forward([cache], [block])  # warm this shape up
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            target.forward([cache], [block])
            seconds.append(time.perf_counter() - started)
        curve[count] = statistics.median(seconds)
    return curve


def cost_curve(target: Any, store: MeasurementStore | None = None, measure: bool = True) -> dict[int, float] | None:
    """The target's cost curve: recalled from this machine's measurements, else measured (when ``measure``) and
    kept."""
    store = store if store is not None else MeasurementStore()
    key = machine_key(target.device, target.dtype, {**model_shape(target), "backend": target.backend})
    record = store.load(key)
    saved = record.get("cost_curve")
    if saved and saved.get("version") == CURVE_VERSION:
        return {int(rows): float(seconds) for rows, seconds in saved["seconds"].items()}
    if not measure:
        return None
    curve = measure_cost_curve(target)
    record["cost_curve"] = {"version": CURVE_VERSION, "seconds": {str(rows): value for rows, value in curve.items()}}
    store.save(key, record)
    return curve
