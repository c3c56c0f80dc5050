"""Products quantised on load (``weights="q8_0"`` / ``"q4_0"``) on the compiled CPU kernels, without float copies
of those matrices.

The first load quantises the products one at a time (a GGUF file's from its blocks de-quantised, as transformers
would; no float checkpoint is written) and keeps them packed in the cache folder, keyed by the source's files, the
kind and the packed layout's version; later loads read only the packed file (quantising a 0.5B model takes seconds,
reading its packed products a fraction of one).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from ..backend.forward.graphed import lean_target
from ..backend.forward.lean import LeanTarget
from .checkpoint import checkpoint_model
from .options import LoadOptions
from .presets import cache_folder
from .targets import make_target, release_float_matrices


def requantized_target(source: Path, config: Any, weights: str, options: LoadOptions,
                       activation_bits: int) -> LeanTarget:
    """The lean forward of ``source`` (a GGUF file or a checkpoint folder; ``config`` its model's) with its products
    quantised to ``weights`` (see the module notes)."""
    from ..backend.weights.gguf_file import (
        GGUFWeights,
        file_embedding,
        file_matrices,
        file_model,
        load_packed,
        requantized_matrices,
        save_packed,
    )
    from ..backend.weights.quantized import LAYOUT_VERSION

    files = [source] if source.is_file() else sorted(path for path in source.iterdir() if path.is_file())
    identity = ";".join([str(source.resolve()), weights, str(LAYOUT_VERSION),
                         *(f"{path.name}:{path.stat().st_size}:{path.stat().st_mtime_ns}" for path in files)])
    packed = (cache_folder(options.cache_dir) / "quantized-packed" / hashlib.sha256(identity.encode()).hexdigest()[:16]
              / "packed.safetensors")
    if packed.is_file():
        try:
            model, products, embedding = load_packed(packed, config)
            return lean_target(model, quantized=products, embedding=embedding, activation_bits=activation_bits,
                               kv_cache_dtype=options.kv_cache_dtype)
        except Exception:  # a damaged or outdated cache file: quantised again below
            packed.unlink()
    if source.is_file():
        file = GGUFWeights(source)
        model = file_model(file, config)
        embedding = file_embedding(model, file)
        target = lean_target(model, quantized=requantized_matrices(model, file_matrices(model, file), weights),
                             embedding=embedding, activation_bits=activation_bits,
                             kv_cache_dtype=options.kv_cache_dtype)
        del file  # (closes the file's mapping)
    else:
        model = checkpoint_model(source, torch.float32).eval()
        embedding = None
        target = make_target(model, options, backend="lean", calibrate=False, weights=weights,
                             activation_bits=activation_bits, max_model_len=None, torch_compile=False)
    release_float_matrices(target)
    packed.parent.mkdir(parents=True, exist_ok=True)
    save_packed(packed, model, target, embedding)
    return target
