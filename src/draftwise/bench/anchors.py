"""llama.cpp as a benchmark row: what a user would run instead, on the same model in the same dtype.

Rows ``llama.cpp`` (plain decoding) and ``llama.cpp-pld`` (its prompt lookup, ``LlamaPromptLookupDecoding`` with
``num_pred_tokens=10``) run through llama-cpp-python (``pip install 'draftwise[anchors]'``). The model is the
preset's own GGUF file (or the GGUF file given), rewritten once with its tensors in the dtype the target runs in
(float32, bfloat16 or float16; norms stay float32 as llama.cpp keeps them), so that both engines read the same
weights at the same width. Checkpoint folders without a GGUF file cannot run here.

llama.cpp's kernels round differently from transformers' and the engine's, so its greedy ids may leave ``ar``'s at a
near-tie: the bench reports its exact-match rate like any row's.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..decoding.sampling import SamplingParams
from ..errors import InvalidRequestError
from .results import Measurement

ANCHOR_ROWS = ("llama.cpp", "llama.cpp-pld")
#: GGUF tensor types by torch dtype, and llama.cpp's file-type code for a file mostly of that type.
GGUF_TYPES = {torch.float32: ("F32", 0), torch.bfloat16: ("BF16", 32), torch.float16: ("F16", 1)}


def source_gguf(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The GGUF file behind a preset (assembled and checked in ``cache_dir`` where it is split) or a ``.gguf`` path."""
    from ..models import gguf_file_of

    path = gguf_file_of(name_or_path, cache_dir)
    if path is not None:
        return path
    raise InvalidRequestError(
        f"llama.cpp rows need the model as GGUF: {name_or_path!r} is neither a preset nor a .gguf file"
    )


def rewrite_gguf(source: Path, destination: Path, dtype: torch.dtype) -> Path:
    """Write ``source`` again with every matrix de-quantised to ``dtype`` (metadata and tokenizer unchanged)."""
    import gguf

    if dtype not in GGUF_TYPES:
        raise InvalidRequestError(f"llama.cpp rows support {', '.join(map(str, GGUF_TYPES))}, not {dtype}")
    type_name, file_type = GGUF_TYPES[dtype]
    target_type = getattr(gguf.GGMLQuantizationType, type_name)
    reader = gguf.GGUFReader(str(source))
    architecture = reader.fields["general.architecture"].contents()
    destination.parent.mkdir(parents=True, exist_ok=True)
    scratch = destination.with_name(f".{destination.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(scratch), architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = file_type if name == "general.file_type" else field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, field.types[0])
    if "general.file_type" not in reader.fields:
        writer.add_file_type(file_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        values = values.reshape([int(size) for size in reversed(tensor.shape)])
        if values.ndim > 1 and target_type != gguf.GGMLQuantizationType.F32:
            packed = gguf.quants.quantize(values, target_type)
            writer.add_tensor(tensor.name, packed, raw_shape=packed.shape, raw_dtype=target_type)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(scratch, destination)
    return destination


def anchor_gguf(name_or_path: str, dtype: torch.dtype, cache_dir: str | os.PathLike | None = None) -> Path:
    """The model's GGUF file in ``dtype``, rewritten once and kept in the cache folder."""
    from ..backend.calibration.machine import cache_root

    source = source_gguf(name_or_path, cache_dir)
    digest = hashlib.sha256(f"{source.resolve()}:{source.stat().st_size}".encode()).hexdigest()[:12]
    folder = Path(cache_dir) if cache_dir is not None else cache_root()
    destination = folder / "gguf" / f"{source.stem}-{digest}-{GGUF_TYPES[dtype][0].lower()}.gguf"
    if not destination.is_file():
        rewrite_gguf(source, destination, dtype)
    return destination


class LlamaCppRunner:
    """One llama.cpp row: a loaded model that decodes prompts given as token ids.

    Args:
        gguf_path: the model file.
        lookup: decode with llama.cpp's prompt lookup (``llama.cpp-pld``).
        context: positions to allocate.
        threads: CPU threads (default: torch's).
    """

    def __init__(self, gguf_path: Path, lookup: bool, context: int, threads: int | None = None) -> None:
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as error:
            raise InvalidRequestError(
                "llama.cpp rows need llama-cpp-python: pip install 'draftwise[anchors]'"
            ) from error
        threads = threads or torch.get_num_threads()
        self.lookup = lookup
        self.llama = Llama(
            model_path=str(gguf_path),
            n_ctx=context,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            # Its prompt lookup verifies against logits of every position (and fails on long prompts without them).
            logits_all=lookup,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None,
            verbose=False,
        )

    def measure(
        self, prompt_ids: Sequence[int], max_new_tokens: int, eos: Sequence[int], sampling: SamplingParams
    ) -> Measurement:
        """Decode ``prompt_ids``: ids, seconds from the call to the last token, and time to the first token."""
        if sampling.min_p and not sampling.greedy:
            options: dict[str, Any] = {"min_p": sampling.min_p}
        else:
            options = {"min_p": 0.0}
        options.update(
            temp=sampling.temperature,
            top_k=sampling.top_k if not sampling.greedy else 1,
            top_p=sampling.top_p,
            repeat_penalty=sampling.repetition_penalty,
        )
        self.llama.reset()  # no reuse of an earlier prompt's cache: every run pays its prefill
        if sampling.seed is not None:
            self.llama.set_seed(sampling.seed)
        stop = set(eos)
        tokens: list[int] = []
        started = time.perf_counter()
        first = None
        for token in self.llama.generate(list(prompt_ids), reset=True, **options):
            if first is None:
                first = time.perf_counter() - started
            tokens.append(int(token))
            if token in stop or len(tokens) >= max_new_tokens:
                break
        return Measurement(tokens, time.perf_counter() - started, first)
