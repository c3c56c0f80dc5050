"""Weights kept in GGUF's block quantisations (Q8_0, Q4_0) for the compiled ``quantized_linear`` product.

A GGUF file stores a ``(out_features, in_features)`` matrix row by row in blocks of 32 inputs: Q8_0 a float16 scale
and 32 int8 quants (weight = scale * quant), Q4_0 a float16 scale and 32 four-bit quants (weight = scale * (quant -
8)). :func:`pack` repacks those blocks once into the kernel's tiles of 64 outputs (the layout is described in
``native/quantized.cpp``), the scales widened to float32; :func:`quantize` makes such blocks from float weights with
the ``gguf`` package's own quantiser, :func:`dequantize` turns them back into float32 with its dequantiser (the
reference every test compares with).

The product dequantises each tile's group of 32 inputs once per call for all rows and sums every output in one fixed
order, so a row's result never depends on the other rows of the call, and equals, bit for bit, the float32 blocked
product (:mod:`draftwise.backend.weights.products`) of the dequantised matrix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .products import Linear

#: Quantisations the kernel runs, by name: the kernel's code for each.
KINDS = {"q8_0": 0, "q4_0": 1}
#: Outputs per tile and inputs per block of the packed layout.
TILE_OUTPUTS = 64
BLOCK_INPUTS = 32


def _quant_type(kind: str) -> Any:
    from gguf import GGMLQuantizationType

    if kind not in KINDS:
        raise ValueError(f"unknown quantisation {kind!r}: use one of {', '.join(KINDS)}")
    return {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}[kind]


def quantize(weight: torch.Tensor, kind: str) -> np.ndarray:
    """``weight`` ``(out, in)`` (``in`` a multiple of 32) as GGUF ``kind`` blocks, one row of bytes per output: what
    a GGUF file holds for the matrix (the ``gguf`` package's quantiser)."""
    from gguf import quants

    quant_type = _quant_type(kind)
    if weight.dim() != 2 or weight.shape[1] % BLOCK_INPUTS:
        raise ValueError(f"{kind} quantises (out, in) matrices with in a multiple of {BLOCK_INPUTS}, not "
                         f"{tuple(weight.shape)}")
    return quants.quantize(weight.detach().float().cpu().numpy(), quant_type)


def dequantize(blocks: np.ndarray, kind: str) -> torch.Tensor:
    """GGUF ``kind`` blocks (one row of bytes per output) as float32 weights ``(out, in)`` (the ``gguf`` package's
    dequantiser)."""
    from gguf import quants

    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(np.asarray(blocks, dtype=np.uint8),
                                                                   _quant_type(kind))))


def pack(blocks: np.ndarray, kind: str) -> torch.Tensor:
    """GGUF ``kind`` blocks ``(out, in / 32 * block bytes)`` repacked for ``quantized_linear``: ``(tiles, groups,
    bytes)`` uint8, outputs past ``out`` zero."""
    _quant_type(kind)
    blocks = np.asarray(blocks, dtype=np.uint8)
    block_bytes = 34 if kind == "q8_0" else 18
    if blocks.ndim != 2 or blocks.shape[1] % block_bytes:
        raise ValueError(f"{kind} blocks are rows of {block_bytes}-byte blocks, not an array of shape {blocks.shape}")
    out_features, groups = blocks.shape[0], blocks.shape[1] // block_bytes
    tiles = -(-out_features // TILE_OUTPUTS)
    padded = np.zeros((tiles * TILE_OUTPUTS, groups, block_bytes), dtype=np.uint8)
    padded[:out_features] = blocks.reshape(out_features, groups, block_bytes)
    # Scales: float16 -> float32, (tiles, groups, 64 outputs).
    scales = padded[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    scales = scales.reshape(tiles, TILE_OUTPUTS, groups).transpose(0, 2, 1)
    quants = padded[:, :, 2:].reshape(tiles, TILE_OUTPUTS, groups, block_bytes - 2).transpose(0, 2, 3, 1)
    if kind == "q8_0":  # (tiles, groups, 32 inputs, 64 outputs) int8
        body = quants
    else:  # GGUF: byte j of a block holds input j (low nibble) and input j + 16 (high nibble)
        nibbles = np.concatenate([quants & 15, quants >> 4], axis=2)  # (tiles, groups, 32 inputs, 64 outputs)
        half = TILE_OUTPUTS // 2
        body = nibbles[..., :half] | (nibbles[..., half:] << 4)  # output o low, output o + 32 high
    layout = np.concatenate([
        np.ascontiguousarray(scales).view(np.uint8).reshape(tiles, groups, -1),
        np.ascontiguousarray(body).reshape(tiles, groups, -1),
    ], axis=2)
    return torch.from_numpy(np.ascontiguousarray(layout))


class QuantizedLinear(Linear):
    """``y = x @ W.T + bias`` over float32 rows, ``W`` kept as GGUF ``kind`` blocks repacked once (see the module
    notes): a :class:`~draftwise.backend.weights.products.Linear` whose rows need no padding (``min_rows`` 1 gives
    every row its bits alone).

    Args:
        blocks: the matrix's GGUF blocks, one row of bytes per output (from a GGUF file or :func:`quantize`).
        kind: ``"q8_0"`` or ``"q4_0"``.
        in_features: inputs per row.
        bias: ``(out_features,)`` or ``None`` (kept in float32).
        kernels: the compiled kernels' module (:func:`draftwise.backend.native.load_kernels`).
        min_rows, fixed_rows: as :class:`~draftwise.backend.weights.products.Linear`'s.
    """

    def __init__(self, blocks: np.ndarray, kind: str, in_features: int, bias: torch.Tensor | None, kernels: Any,
                 min_rows: int = 1, fixed_rows: bool = False) -> None:
        packed = pack(blocks, kind)
        if packed.shape[1] * BLOCK_INPUTS != in_features:
            raise ValueError(f"the blocks hold {packed.shape[1] * BLOCK_INPUTS} inputs per row, not {in_features}")
        self.kind = kind
        self.kernels = kernels
        self.out_features, self.in_features = int(np.asarray(blocks).shape[0]), in_features
        self.blocked = None
        self.packed = False
        self.weight = packed
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.min_rows = min_rows
        self.fixed_rows = fixed_rows

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, kernels: Any,
                    min_rows: int = 1) -> QuantizedLinear:
        """``weight`` ``(out, in)`` quantised to ``kind`` (:func:`quantize`)."""
        return cls(quantize(weight, kind), kind, weight.shape[1], bias, kernels, min_rows)

    @property
    def quantization(self) -> str:
        return self.kind

    def _product(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.dtype != torch.float32:
            raise TypeError(f"quantised products take float32 rows, not {inputs.dtype}")
        if inputs.stride(-1) != 1:
            inputs = inputs.contiguous()
        return self.kernels.quantized_linear(inputs, self.weight, KINDS[self.kind], self.bias, self.out_features)
