"""A GGUF file's block-quantised matrices, matched to the transformers model loaded from the same file.

transformers de-quantises a GGUF file into float32 weights (with the ``gguf`` package, whose values
:func:`~draftwise.backend.weights.quantized.decode` reproduces bit for bit). :func:`file_matrices` reads the file's
blocks again and hands each projection of that model its matrix as the file holds it, so the lean forward can run
the file's own quantisation while the float model stays its reference (the quantised forward agrees with it within the
tolerance docs/models.md states). Each matrix is checked to dequantise to
exactly the model's weight, which also proves the name mapping and llama's query/key row order.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import torch

from .quantized import FILE_TYPES, QuantizedMatrix, decode

#: A decoder layer's GGUF tensor names and the transformers projections they hold.
_PROJECTIONS = {
    "attn_q": ("self_attn", "q_proj"),
    "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"),
    "ffn_gate": ("mlp", "gate_proj"),
    "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _field(reader: Any, name: str) -> Any:
    field = reader.fields.get(name)
    return None if field is None else field.contents()


def _llama_row_order(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's query/key rows for its rotary kernel; transformers' loader undoes
    it (``LlamaTensorProcessor._reverse_permute_weights``): the same reordering, of row indices."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


def file_matrices(model: Any, path: str | os.PathLike) -> dict[Any, QuantizedMatrix]:
    """The quantised matrices of the GGUF file at ``path``, by the projection module of ``model`` (loaded from that
    file) each belongs to: the decoder layers' projections and the output head (the token embedding where the file
    ties them). Matrices in float types (F32, F16, BF16) or types without a product here are left out.

    Raises:
        ValueError: the file does not match the model (a matrix that does not dequantise to the model's weight, a
            shape or a layer the model lacks).
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    architecture = _field(reader, "general.architecture")
    heads = _field(reader, f"{architecture}.attention.head_count")
    kv_heads = _field(reader, f"{architecture}.attention.head_count_kv") or heads
    layers = model.model.layers
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight or not any(
        tensor.name == "output.weight" for tensor in reader.tensors)
    matrices: dict[Any, QuantizedMatrix] = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if type_name not in FILE_TYPES:
            continue
        module = None
        order = None
        found = _LAYER_TENSOR.fullmatch(tensor.name)
        if found and found.group(2) in _PROJECTIONS:
            index = int(found.group(1))
            if index >= len(layers):
                raise ValueError(f"{tensor.name}: the model has {len(layers)} layers")
            block, name = _PROJECTIONS[found.group(2)]
            module = getattr(getattr(layers[index], block), name)
            if architecture == "llama" and found.group(2) in ("attn_q", "attn_k"):
                order = _llama_row_order(tensor.data.shape[0], int(heads if found.group(2) == "attn_q" else kv_heads))
        elif tensor.name == "output.weight" or (tensor.name == "token_embd.weight" and tied):
            module = head
        if module is None:
            continue
        matrix = decode(np.asarray(tensor.data), type_name)
        if order is not None:
            matrix = matrix.rows(order)
        weight = module.weight.detach()
        if tuple(weight.shape) != matrix.shape or not torch.equal(matrix.dequantize(), weight.float().cpu()):
            raise ValueError(f"{tensor.name} ({type_name}) does not dequantise to the model's "
                             f"{type(module).__name__} weight of shape {tuple(weight.shape)}: the model was not loaded "
                             f"from this file")
        matrices[module] = matrix
    return matrices
