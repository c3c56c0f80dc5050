"""``draftwise models`` (the presets, and installing them) and ``draftwise doctor`` (what this machine does with a
model)."""

from __future__ import annotations

import argparse

import torch

from ..errors import InvalidRequestError
from ..models import DEFAULT_MODEL, PRESETS, default_weights, install_preset, is_installed
from .common import add_model_arguments, load_options

#: Random trees ``draftwise doctor`` checks against plain decoding unless told otherwise.
DOCTOR_TRIALS = 40


def add_parsers(commands: argparse._SubParsersAction) -> None:
    models = commands.add_parser("models", help="list presets, or install one")
    models.add_argument("action", nargs="?", choices=["list", "install"], default="list")
    models.add_argument("names", nargs="*")
    models.set_defaults(handler=run_models)

    doctor = commands.add_parser(
        "doctor", help="measure how this machine runs a model: dtype, exact verification, forward cost by rows"
    )
    doctor.add_argument("--trials", type=int, default=DOCTOR_TRIALS,
                        help=f"random trees checked against plain decoding (default {DOCTOR_TRIALS})")
    add_model_arguments(doctor, several_dtypes=True)
    doctor.set_defaults(handler=run_doctor)


def run_models(args: argparse.Namespace) -> int:
    if args.action == "install":
        for name in args.names or [DEFAULT_MODEL]:
            install_preset(name)
            print(f"installed {name}")
        return 0
    if args.names:
        raise InvalidRequestError("draftwise models lists every preset: names go with 'install'")
    for name, preset in PRESETS.items():
        state = "installed" if is_installed(preset) else f"not installed ({preset.install_command})"
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name:<22}{preset.model}{default}: {state}")
    return 0


def run_doctor(args: argparse.Namespace) -> int:
    """Measure how this machine runs a model: dtype, backend, exact-verification padding, cost by rows."""
    from rich.console import Console
    from rich.table import Table

    from ..doctor import as_rows, diagnose, flags_summary

    if args.enable_torch_compile:
        raise InvalidRequestError("doctor measures the eager forwards; it does not take --enable-torch-compile")
    if args.trials < 1:
        raise InvalidRequestError("--trials must be at least 1")
    dtypes = args.dtype.split(",")
    options = load_options(args, dtype="auto")
    for dtype in dtypes:
        options.replace(dtype=dtype)  # (each one checked before anything loads)
    # The weights a run of the model takes unless told (a preset's or GGUF file's own blocks on a CPU the kernels run
    # on), with quantised weights in the one dtype they run in.
    weights = args.weights or default_weights(args.model, options.replace(dtype=dtypes[0]))
    if weights != "float":
        if any(dtype not in ("auto", "float32") for dtype in dtypes):
            raise InvalidRequestError(f"{weights} weights run float32 activations: drop --dtype or give float32")
        options = options.replace(weights=weights)
    if args.threads:
        torch.set_num_threads(args.threads)
    diagnosis = diagnose(args.model, dtypes, options, args.trials)
    console = Console()
    console.print(f"machine: {diagnosis.cpu} ({flags_summary()}); torch {diagnosis.torch}, {diagnosis.threads} threads")
    console.print(f"native bf16: {'yes' if diagnosis.native_bf16 else 'no'}; dtype=auto picks {diagnosis.auto_dtype}")
    rows = as_rows(diagnosis)
    table = Table(title=f"{diagnosis.model}")
    for column in rows[0]:
        table.add_column(column)
    for row in rows:
        table.add_row(*map(str, row.values()))
    console.print(table)
    for item in diagnosis.dtypes:
        for mismatch in item.report.mismatches[:5]:
            console.print(f"  {item.dtype}: {mismatch}")
    return 0 if all(item.exact_trees for item in diagnosis.dtypes) else 1
