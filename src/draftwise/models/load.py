""":func:`load_model`: a preset, a GGUF file or a checkpoint folder, ready for the engine, by the kind of weights it
runs (a GGUF file's own blocks, products quantised on load, or float weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..backend import native
from ..backend.target import Target
from ..errors import ModelLoadError, UnsupportedModelError
from .checkpoint import checkpoint_model, folder_tokenizer, load_errors, resolve_checkpoint
from .file_weights import file_metadata, file_target
from .options import LoadOptions
from .presets import DEFAULT_MODEL, gguf_file_of
from .requantized import requantized_target
from .targets import default_activation_bits, default_weights, finish_target, make_target


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token id that ends generation: the generation config's EOS ids and the tokenizer's EOS."""
    found: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        for token in source if isinstance(source, (list, tuple)) else [source]:
            if int(token) not in found:
                found.append(int(token))
    return found


def load_model(name_or_path: str = DEFAULT_MODEL, options: LoadOptions | None = None, *, progress: bool = True,
               **changes: Any) -> tuple[Target, Any]:
    """Load a causal LM and its tokenizer, ready for the engine.

    Args:
        name_or_path: a preset name (see :data:`~draftwise.models.PRESETS`), a ``.gguf`` file or a transformers
            checkpoint folder.
        options: how to load and run it (:class:`LoadOptions`, whose attributes document each option); any of its
            fields may be given as keywords instead or on top: ``load_model("smollm2-135m", dtype="float32")``.
            Every option is checked before anything loads.
        progress: print a line when a one-time conversion runs.

    With ``weights="file"`` (the default for a preset or GGUF file on a CPU the compiled kernels build on, unless a
    dtype is asked for) no float copy of the file's quantised matrices is made and no float checkpoint is written:
    ``target.model`` holds the model's config and float tensors (norms, biases) only, the products are packed once
    and kept in the cache folder, so later loads read neither the GGUF file nor a float checkpoint. The same goes
    for ``"q8_0"``/``"q4_0"`` on the compiled CPU kernels. Float weights of a GGUF file are converted once into a
    plain checkpoint in the cache folder. A preset's file is checked against its sha256 before it is first read.

    Returns:
        ``(target, tokenizer)``: ``target.model`` is the transformers model (the reference), ``target.dtype`` the
        dtype it runs in, ``target.weights`` the quantised weights it runs (``None`` for float weights),
        ``target.options`` the options it was loaded with; the tokenizer is ``None`` when the model has none.
    """
    options = LoadOptions.of(options, **changes)
    device = options.resolved_device
    weights = options.weights or default_weights(name_or_path, options)
    activation_bits = options.activation_bits or default_activation_bits(name_or_path, weights)
    dtype = options.resolved_dtype(quantized=weights != "float")
    if weights == "file":
        target, tokenizer = _load_file_weights(name_or_path, options, device, activation_bits)
    elif weights != "float" and options.backend != "transformers" and device.type == "cpu" and \
            native.load_kernels(warn=False) is not None:
        _check_float32_activations(options, f"{weights} weights on the CPU kernels")
        target, tokenizer = _load_requantized(name_or_path, options, weights, activation_bits, progress)
    else:
        folder = resolve_checkpoint(name_or_path, options.cache_dir, progress)
        model = checkpoint_model(folder, dtype)
        model.to(device).eval()
        tokenizer = folder_tokenizer(folder)
        target = make_target(model, options, weights=weights, activation_bits=activation_bits)
    target.tokenizer, target.source, target.options = tokenizer, str(name_or_path), options
    target.weights = None if weights == "float" else weights
    return target, tokenizer


def _load_file_weights(name_or_path: str, options: LoadOptions, device: Any,
                       activation_bits: int) -> tuple[Target, Any]:
    gguf_file = gguf_file_of(name_or_path, options.cache_dir)
    if gguf_file is None:
        if Path(name_or_path).expanduser().is_dir():
            raise ModelLoadError(f"weights='file' runs a GGUF file's own blocks; {name_or_path} is a checkpoint "
                                 "folder: give a preset or a .gguf file, or weights='q8_0'/'q4_0'")
        resolve_checkpoint(name_or_path, options.cache_dir, progress=False)  # raises the error for what the name is
    if options.backend == "transformers":
        raise UnsupportedModelError("a GGUF file's own blocks run on the lean backend, not transformers'")
    _check_float32_activations(options, "a GGUF file's own blocks")
    target, tokenizer = file_target(gguf_file, options, device, activation_bits)
    finish_target(target, options)
    return target, tokenizer


def _check_float32_activations(options: LoadOptions, what: str) -> None:
    """Quantised products take float32 activations: refuse another dtype asked for beside them."""
    if options.dtype not in ("auto", "float32"):
        raise UnsupportedModelError(f"{what} take float32 activations, not {options.dtype}")


def _load_requantized(name_or_path: str, options: LoadOptions, weights: str, activation_bits: int,
                      progress: bool) -> tuple[Target, Any]:
    from transformers import AutoConfig

    source = gguf_file_of(name_or_path, options.cache_dir) or resolve_checkpoint(name_or_path, options.cache_dir,
                                                                                 progress)
    with load_errors(source, "model"):
        # (a GGUF file's config and tokenizer from the cache folder weights="file" keeps them in)
        metadata = file_metadata(source, options.cache_dir) if source.is_file() else source
        config = AutoConfig.from_pretrained(str(metadata))
        tokenizer = folder_tokenizer(metadata)
        target = requantized_target(source, config, weights, options, activation_bits)
    finish_target(target, options)
    return target, tokenizer
