"""A GGUF file's own blocks as shipped (``weights="file"``): the lean forward without a float model.

Config, tokenizer and (for the compiled CPU kernels) the repacked products are kept in the cache folder, keyed by
the file's path, size and time and the packed layout's version: the first load reads the file (building a large
vocabulary's tokenizer and repacking take a while), later ones only the cache. On other devices the blocks are
decoded from the file at each load and dequantised at every step there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..backend import native
from ..backend.forward.graphed import lean_target
from ..backend.forward.lean import LeanTarget
from .checkpoint import MARKER, checkpoint_ready, folder_tokenizer, load_errors
from .options import LoadOptions
from .presets import cache_folder
from .targets import compile_option


def file_target(gguf_file: Path, options: LoadOptions, device: torch.device,
                activation_bits: int) -> tuple[LeanTarget, Any]:
    """The lean forward of a GGUF file's own blocks on ``device`` and the file's tokenizer (``None`` where it has
    none), without a float model (see the module notes)."""
    from transformers import AutoConfig

    from ..backend.weights.gguf_file import (
        GGUFWeights,
        file_embedding,
        file_matrices,
        file_model,
        load_packed,
        save_packed,
    )

    with load_errors(gguf_file, "GGUF model"):
        folder = file_metadata(gguf_file, options.cache_dir)
        packed = folder / "packed.safetensors"
        config = AutoConfig.from_pretrained(str(folder))
        # Products packed for the compiled CPU kernels are kept; elsewhere blocks are decoded from the file.
        kernels = device.type == "cpu" and native.load_kernels(warn=False) is not None
        cached = None
        if kernels and packed.is_file():
            try:
                cached = load_packed(packed, config)
            except Exception:  # a damaged or outdated cache file: repacked from the GGUF file below
                packed.unlink()
        if cached is not None:
            model, source, embedding = cached
            target = lean_target(model, quantized=source, embedding=embedding, activation_bits=activation_bits,
                                 kv_cache_dtype=options.kv_cache_dtype)
        else:
            weights = GGUFWeights(gguf_file)
            model = file_model(weights, config, device)
            embedding = file_embedding(model, weights)
            target = lean_target(model, quantized=file_matrices(model, weights), embedding=embedding,
                                 activation_bits=activation_bits, kv_cache_dtype=options.kv_cache_dtype,
                                 **compile_option(options.torch_compile))
            del weights  # closes the file's mapping: only the products' blocks stay resident
            if not target.dequantizing:
                save_packed(packed, model, target, embedding)
    return target, folder_tokenizer(folder)


def file_metadata(gguf_file: Path, cache_dir: str | os.PathLike | None) -> Path:
    """The cache folder of a GGUF file's config and tokenizer (keyed by the file's path, size and time and the
    packed layout's version; written at its first load: a large vocabulary's tokenizer takes a while to build).

    Raises:
        ValueError: the file has no config transformers can read.
    """
    from transformers import AutoTokenizer

    from ..backend.weights.gguf_file import file_config
    from ..backend.weights.quantized import LAYOUT_VERSION

    stat = gguf_file.stat()
    identity = f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{LAYOUT_VERSION}"
    folder = cache_folder(cache_dir) / "gguf-packed" / hashlib.sha256(identity.encode()).hexdigest()[:16]
    if not checkpoint_ready(folder):
        config = file_config(gguf_file)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        except Exception:  # a file without a tokenizer still runs on token ids
            tokenizer = None
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".metadata-") as scratch:
            staging = Path(scratch) / "metadata"
            config.save_pretrained(str(staging))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(staging))
            (staging / MARKER).write_text(json.dumps({"gguf": str(gguf_file)}))
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(staging, folder)
    return folder
