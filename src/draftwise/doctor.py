"""``draftwise doctor``: what this machine does with a model, measured afresh.

For each dtype asked for (or for the quantised weights a GGUF file runs as shipped): which forward runs the model, the
padding that makes verification rows bitwise plain decoding's here (measured, not recalled), a thorough check of that
exactness on the model itself, the forward's cost by row count, and the one-row forward beside the bandwidth floor
(every weight read once at the read rate measured now).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .backend.calibration.costs import cost_curves
from .backend.calibration.invariance import InvarianceReport, check_trees, plan_rows
from .backend.calibration.machine import (
    MeasurementStore,
    auto_dtype,
    bandwidth_floor,
    cpu_flags,
    cpu_model,
    native_bf16,
)
from .models import DEFAULT_MODEL, LoadOptions, load_model


@dataclass
class DtypeDiagnosis:
    """What was measured for one dtype."""

    dtype: str
    backend: str
    attention: str | None
    linear: str | None
    linear_min_rows: int | None
    attention_min_rows: int | None
    exact_trees: bool
    report: InvarianceReport
    cost_ms: dict[int, float]
    tree_cost_ms: dict[int, float] = field(default_factory=dict)
    #: Whether the products' weights are in transparent huge pages (lean backend on CPUs).
    huge_pages: bool = False
    #: The weights it ran: ``"float"``, or the quantised ones (``"file"``, ``"q8_0"``, ``"q4_0"``).
    weights: str = "float"
    #: What the quantised products ran (``"q4_k+q6_k, 8-bit activations"``), or ``None`` for float weights.
    quantization: str | None = None
    #: The bandwidth floor of a token (:func:`~draftwise.bench.environment.bandwidth_floor`), milliseconds.
    floor_ms: float | None = None


@dataclass
class Diagnosis:
    """The machine and what it does with one model."""

    model: str
    cpu: str
    native_bf16: bool
    auto_dtype: str
    torch: str
    threads: int
    dtypes: list[DtypeDiagnosis] = field(default_factory=list)


def diagnose(
    name_or_path: str = DEFAULT_MODEL,
    dtypes: Sequence[str] = ("auto",),
    options: LoadOptions | None = None,
    trials: int = 40,
) -> Diagnosis:
    """Measure, afresh and without touching the kept measurements, how ``name_or_path`` runs on this machine in
    each of ``dtypes`` (``options`` give the weights, device, backend, cache folder and the rest; with quantised
    weights, ``options.weights`` other than ``"float"``, the one dtype they run in)."""
    options = LoadOptions.of(options, weights=options.weights if options and options.weights else "float",
                             calibrate=False)
    quantized = options.weights != "float"
    if quantized:
        dtypes = ("auto",)
    device = options.resolved_device
    diagnosis = Diagnosis(
        model=name_or_path,
        cpu=cpu_model() if device.type == "cpu" else torch.cuda.get_device_name(device),
        native_bf16=native_bf16(device),
        auto_dtype=str(auto_dtype(device)).removeprefix("torch."),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
    )
    for name in dict.fromkeys(str(LoadOptions.of(options, dtype=dtype).resolved_dtype(quantized=False))
                              .removeprefix("torch.") for dtype in dtypes):
        target, _ = load_model(name_or_path, options, dtype="auto" if quantized else name)
        with tempfile.TemporaryDirectory() as scratch:
            store = MeasurementStore(Path(scratch))
            if target.backend == "lean":  # (its padding first; the transformers backend has none to plan)
                plan_rows(target, store)
            report = check_trees(target, trials=trials, steps=120, prompt_length=100, seed=17)
            curves = cost_curves(target, store)
        diagnosis.dtypes.append(
            DtypeDiagnosis(
                dtype=str(target.dtype).removeprefix("torch."),
                backend=target.backend,
                attention=getattr(target, "attention_path", None),
                linear=getattr(target, "linear_path", None),
                linear_min_rows=getattr(target, "linear_min_rows", None),
                attention_min_rows=getattr(target, "attention_min_rows", None),
                exact_trees=report.exact and (target.backend != "lean" or target.exact_trees),
                report=report,
                cost_ms={rows: 1000 * seconds for rows, seconds in curves.chain.items()},
                tree_cost_ms={rows: 1000 * seconds for rows, seconds in curves.tree.items()},
                huge_pages=getattr(target, "huge_pages", False),
                weights=options.weights,
                quantization=(f"{target.quantization}, {target.activation_bits}-bit activations"
                              if quantized and getattr(target, "quantization", None) else None),
                floor_ms=bandwidth_floor(target)["floor_ms_per_token"],
            )
        )
    return diagnosis


def flags_summary() -> str:
    """The CPU flags that decide kernels and dtypes."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")
    present = [flag for flag in wanted if flag in cpu_flags()]
    return ", ".join(present) or "none of " + ", ".join(wanted)


def as_rows(diagnosis: Diagnosis) -> list[dict[str, Any]]:
    """One printable row per dtype."""
    rows = []
    for item in diagnosis.dtypes:
        rows.append({
            "dtype": item.dtype if item.quantization is None else f"{item.dtype} ({item.quantization})",
            "backend": item.backend + (f" ({item.attention} attention, {item.linear} linear products"
                                       f"{', weights in huge pages' if item.huge_pages else ''})"
                                       if item.attention else ""),
            "padding (linear/attention rows)": (
                f"{item.linear_min_rows}/{item.attention_min_rows}" if item.linear_min_rows is not None else "-"
            ),
            "exact trees": f"yes ({item.report.rows_checked} rows)" if item.exact_trees else (
                f"NO ({len(item.report.mismatches)} of {item.report.rows_checked} rows differ)"
            ),
            "chain ms at 1/8/16/64 rows": " / ".join(
                f"{item.cost_ms[rows]:.1f}" for rows in (1, 8, 16, 64) if rows in item.cost_ms
            ),
            "tree ms at 8/16/64 rows": " / ".join(
                f"{item.tree_cost_ms[rows]:.1f}" for rows in (8, 16, 64) if rows in item.tree_cost_ms
            ) or "-",
            "4/8/16 rows vs 1": " / ".join(
                f"{item.cost_ms[rows] / item.cost_ms[1]:.2f}x" for rows in (4, 8, 16) if rows in item.cost_ms
            ) if 1 in item.cost_ms else "-",
            "1 row vs floor": (f"{item.cost_ms[1] / item.floor_ms:.2f}x ({item.floor_ms:.1f} ms)"
                               if item.floor_ms and 1 in item.cost_ms else "-"),
        })
    return rows
