"""The engine's target for a loaded model: which forward runs it, with which weights, checked on this machine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..backend import native
from ..backend.calibration.costs import cost_curves
from ..backend.calibration.invariance import check_rows, plan_rows
from ..backend.calibration.machine import MeasurementStore
from ..backend.forward.graphed import lean_target
from ..backend.forward.lean import LeanTarget, model_device, named_kv_cache_dtype, unsupported_reason
from ..backend.target import Target, TransformersTarget
from ..backend.transformers_patches import use_grouped_query_sdpa, use_row_efficient_linear
from ..errors import ModelLoadError, UnsupportedModelError
from .options import LoadOptions, check_compile_device
from .presets import PRESETS


def default_weights(name_or_path: str, options: LoadOptions) -> str:
    """The weights :func:`draftwise.load_model` runs ``name_or_path`` with when ``options.weights`` is ``None``: a
    GGUF file's (or a preset's) own blocks, as shipped, where they run on the compiled CPU kernels (the CPU, the lean
    backend) and no dtype is asked for (``dtype="auto"``: they take float32 activations); ``"float"`` otherwise (a
    checkpoint folder, a float dtype asked for, a GPU, where the blocks would be dequantised at every step, or a CPU
    the kernels cannot be built on)."""
    is_gguf = name_or_path in PRESETS or Path(name_or_path).expanduser().suffix.lower() == ".gguf"
    if (not is_gguf or options.backend == "transformers" or options.resolved_device.type != "cpu"
            or options.dtype != "auto" or native.load_kernels(warn=False) is None):
        return "float"
    return "file"


def default_activation_bits(name_or_path: str | os.PathLike, weights: str | None = "file") -> int:
    """The precision quantised products take activations in when :func:`draftwise.load_model` is not told: a preset's
    :attr:`~draftwise.models.Preset.activation_bits` where its file's own blocks run (``weights="file"``: what was
    measured), 16 for any other model or weights."""
    preset = PRESETS.get(str(name_or_path))
    return preset.activation_bits if preset is not None and weights == "file" else 16


def compile_option(torch_compile: bool) -> dict[str, Any]:
    """:class:`~draftwise.backend.forward.graphed.GraphedLeanTarget`'s option for ``torch_compile`` (none when off,
    so the CPU's :class:`LeanTarget` is never handed it)."""
    return {"compiled": True} if torch_compile else {}


def make_target(model: Any, options: LoadOptions | None = None, *, gguf_file: str | os.PathLike | None = None,
                **changes: Any) -> Target:
    """The engine's :class:`~draftwise.backend.target.Target` for a loaded transformers model.

    Args:
        model: a transformers causal LM (its dtype and device are the target's).
        options: how to run it (:class:`LoadOptions`; ``changes`` as keywords override its fields). What applies
            here: ``backend`` (``"lean"``: the engine's own forward, llama and qwen2 families; ``"transformers"``: the
            model's public forward, any family with full attention; ``"auto"``: lean where it can run the model),
            ``weights`` (``"q8_0"``/``"q4_0"``: every linear product's weights quantised on load and run so on the
            lean forward, float32 on the compiled CPU kernels; ``"file"``: the block-quantised matrices of
            ``gguf_file`` as they are; ``None``/``"float"``: the model's float weights), ``activation_bits``
            (default 16), ``kv_cache_dtype``, ``max_model_len``, ``torch_compile``, ``fast_linear`` (the
            transformers backend's few-row CPU kernels), ``calibrate`` (measure on this machine, or recall, whether
            verification rows are bitwise plain decoding's, with the padding that makes them so on the lean forward,
            and the forward's cost by row count: a few seconds the first time, kept per machine) and ``cache_dir``
            (where those measurements are kept).
        gguf_file: the GGUF file ``model`` was loaded from, for ``weights="file"``.
    """
    options = LoadOptions.of(options, **changes)
    device = model_device(model)
    if options.torch_compile:
        check_compile_device(device)
    weights = None if options.weights == "float" else options.weights
    backend = options.backend
    reason = unsupported_reason(model)
    if (backend == "lean" or weights is not None) and reason is not None:
        raise UnsupportedModelError(f"the lean backend cannot run this model: {reason}; use backend='transformers'")
    if weights == "file" and gguf_file is None:
        raise ModelLoadError("weights='file' runs a GGUF file's own blocks: give the file the model was loaded from")
    if options.torch_compile and reason is not None:
        raise UnsupportedModelError(f"torch_compile runs the lean forward's step, which cannot run this model: "
                                    f"{reason}")
    if backend != "transformers" and reason is None:
        lean_options: dict[str, Any] = {"activation_bits": options.activation_bits or 16,
                                        "kv_cache_dtype": options.kv_cache_dtype,
                                        **compile_option(options.torch_compile)}
        if weights == "file":
            from ..backend.weights.gguf_file import GGUFWeights, file_embedding, file_matrices

            try:
                source = GGUFWeights(gguf_file)
                lean_options["quantized"] = file_matrices(model, source)
                lean_options["embedding"] = file_embedding(model, source)
                target: Target = lean_target(model, **lean_options)  # decodes and packs the matrices, one at a time
            except ValueError as error:
                raise ModelLoadError(str(error)) from None
        else:
            if weights is not None:
                lean_options["quantization"] = weights
            target = lean_target(model, **lean_options)
    else:
        if named_kv_cache_dtype(options.kv_cache_dtype) not in (None, model.dtype):
            raise UnsupportedModelError(f"a {options.kv_cache_dtype} cache runs on the lean backend; the transformers "
                                        "backend keeps the model's dtype")
        if options.fast_linear and device.type == "cpu":
            use_row_efficient_linear(model)
            use_grouped_query_sdpa(model)
        target = TransformersTarget(model)
    finish_target(target, options)
    return target


def finish_target(target: Target, options: LoadOptions) -> None:
    """Limit ``target``'s context to ``options.max_model_len`` (where given), then, with ``options.calibrate``,
    measure (or recall) on this machine whether its verification rows are bitwise plain decoding's (the lean forward:
    with the padding that makes them so; drafting is off where they are not) and its cost curves: in that order, so
    that the measured forwards are the ones that will run (the graphed forward's attention covers the limited
    span)."""
    if options.max_model_len is not None:
        try:
            target.limit_context(options.max_model_len)
        except ValueError as error:
            raise ModelLoadError(str(error)) from None
    if not options.calibrate:
        return
    store = MeasurementStore(Path(options.cache_dir) / "machine" if options.cache_dir is not None else None)
    if isinstance(target, LeanTarget):
        plan_rows(target, store)
    else:
        check_rows(target, store)
    curves = cost_curves(target, store)
    target.cost_prior, target.tree_cost_prior = curves.chain, curves.tree


def release_float_matrices(target: Target) -> None:
    """Free the float weights of a target's matrices quantised on load: its forward runs their quantised products
    (the ``hf`` rows of a benchmark load the float model again, see :func:`draftwise.bench.run.float_reference`). The
    token embedding, which the forward looks up, stays."""
    embedding = target.model.get_input_embeddings().weight
    for module in target.model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight is not embedding:
            module.weight = torch.nn.Parameter(torch.empty_like(module.weight, device="meta"), requires_grad=False)
