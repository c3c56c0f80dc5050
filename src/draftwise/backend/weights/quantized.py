"""Weights kept in GGUF's block quantisations for the compiled ``quantized_linear`` product.

A GGUF file stores a ``(out_features, in_features)`` matrix row by row in blocks: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 in
blocks of 32 inputs with a float16 scale (and, for the ``_1`` types, a float16 offset), the k-quants Q4_K, Q5_K and
Q6_K in super-blocks of 256 whose sub-blocks of 32 (16 for Q6_K) get scales (and offsets) from small integers times a
float16. Whatever the type, every weight is ``scale * quant + offset`` where ``scale * quant`` is exact in float32
(at most 24 significant bits: a float16 times at most 13 more bits), so one rounding at most, the addition; gguf's own
dequantisation computes the same. :func:`decode` turns any of these types into that common form
(:class:`QuantizedMatrix`: per 32 inputs one or two float32 scales, an optional float32 offset, small integer quants),
and :func:`pack` lays it out once in the kernel's tiles of 8 outputs (see ``native/quantized.cpp``): quants in
nibbles where they fit in four bits, else one byte each, grouped four inputs to a 32-bit lane.

The product is an integer dot product, as llama.cpp's: each row's activations are quantised per group of 32 inputs to
16-bit fixed point (two int8 parts) or to 8 bits as llama.cpp's (see :data:`ACTIVATION_BITS`; some presets' files
take 8 by default, :func:`draftwise.models.default_activation_bits`; over the k-quants' factored packing, 8 bits per
128 inputs, whose integer sums the super-block's small scales weight before one float32 step), the sums
of quant x activation are exact integers, and the float32 steps after them run in one fixed order per row. A row's
result therefore never depends on the other rows of the call (a verification row is bitwise plain decoding's), and
stays within about 1e-4 (relative) of the float product of the dequantised matrix at 16 bits, about 5e-3 at 8
(``tests/quantized_reference.py`` states the arithmetic step by step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .products import Linear

#: Quantisations weights can be quantised to on load, by name (``load_model(weights=...)``).
KINDS = ("q8_0", "q4_0")
#: The precisions a quantised product takes each row's activations in: 8 bits (an int8 and a scale per 32 inputs, or
#: per 128 over the k-quants, as llama.cpp's dot products take them) or 16 (two int8 parts per 32 inputs: within a
#: hair of the float product, at twice the integer multiplies).
ACTIVATION_BITS = (8, 16)


def check_activation_bits(activation_bits: int) -> None:
    """A ``ValueError`` naming the choices unless ``activation_bits`` is one of :data:`ACTIVATION_BITS`."""
    if activation_bits not in ACTIVATION_BITS:
        raise ValueError(f"unknown activation_bits {activation_bits!r}; activation bits: "
                         f"{', '.join(map(str, ACTIVATION_BITS))}")


#: GGUF block types :func:`decode` reads (a file's matrices in these types run as they are).
FILE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
#: The packed layout's version: repacked weights cached under another version are repacked again.
LAYOUT_VERSION = 4
#: Outputs per tile and inputs per group of the packed layout.
TILE_OUTPUTS = 8
BLOCK_INPUTS = 32
#: Groups of 32 inputs in a k-quant super-block (256 inputs).
SUPER_GROUPS = 8
#: The packed layout's format bits (``native/quantized.cpp``): quants in nibbles, an offset per group, a scale per
#: half group (16 inputs), quants as signed bytes, scales and offsets factored per super-block (:class:`ScaleFactors`),
#: scales and offsets as float16 (where each is a float16 value), quants in six bits (nibbles and a plane of their
#: top two bits); the bits from CENTRE_SHIFT up hold the centre of unsigned quants.
NIBBLES, OFFSETS, HALVES, SIGNED, FACTORED, HALF_FLOATS, SIX_BITS = 1, 2, 4, 8, 16, 32, 64
CENTRE_SHIFT = 7


def _gguf_type(name: str) -> Any:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name.upper()]


def quantize(weight: torch.Tensor, kind: str) -> np.ndarray:
    """``weight`` ``(out, in)`` (``in`` a multiple of 32) as GGUF ``kind`` blocks, one row of bytes per output: what
    a GGUF file holds for the matrix (the ``gguf`` package's quantiser)."""
    from gguf import quants

    if kind not in KINDS:
        raise ValueError(f"unknown quantisation {kind!r}: use one of {', '.join(KINDS)}")
    if weight.dim() != 2 or weight.shape[1] % BLOCK_INPUTS:
        raise ValueError(f"{kind} quantises (out, in) matrices with in a multiple of {BLOCK_INPUTS}, not "
                         f"{tuple(weight.shape)}")
    return quants.quantize(weight.detach().float().cpu().numpy(), _gguf_type(kind))


def dequantize(blocks: np.ndarray, kind: str) -> torch.Tensor:
    """GGUF ``kind`` blocks (one row of bytes per output) as float32 weights ``(out, in)`` (the ``gguf`` package's
    dequantiser: the reference every test compares with)."""
    from gguf import quants

    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(np.asarray(blocks, dtype=np.uint8),
                                                                   _gguf_type(kind))))


@dataclass
class ScaleFactors:
    """A k-quant matrix's scales and offsets as its file factors them: per super-block of 8 groups a float32 per
    output times a small integer per group (per half group for scales): ``scales[o, g, h] = scale[o, g // 8] *
    small_scales[o, g, h]`` and ``offsets[o, g] = offset[o, g // 8] * small_offsets[o, g]``, both exact in float32.
    Packed so, a group's scales take a byte an output instead of four.

    Attributes:
        scale: ``(out, in / 256)`` float32.
        small_scales: ``(out, in / 32, 2)`` int8.
        offset: ``(out, in / 256)`` float32, or ``None`` (no offsets).
        small_offsets: ``(out, in / 32)`` int8, or ``None``.
    """

    scale: np.ndarray
    small_scales: np.ndarray
    offset: np.ndarray | None
    small_offsets: np.ndarray | None

    def rows(self, order: np.ndarray) -> ScaleFactors:
        return ScaleFactors(self.scale[order], self.small_scales[order],
                            None if self.offset is None else self.offset[order],
                            None if self.small_offsets is None else self.small_offsets[order])


@dataclass
class QuantizedMatrix:
    """A block-quantised ``(out, in)`` matrix in the common form: weight ``[o, i] = scales[o, i // 32, (i % 32) //
    16] * quants[o, i] + offsets[o, i // 32]`` (no offset where ``offsets`` is ``None``).

    Attributes:
        scales: ``(out, in / 32, 2)`` float32 (both halves equal where the type has one scale per 32 inputs).
        offsets: ``(out, in / 32)`` float32, or ``None``.
        quants: ``(out, in)`` int8.
        halves: whether the two halves' scales may differ (Q6_K).
        types: the GGUF types it came from (for reports).
        factors: the same scales and offsets factored per super-block (k-quants), or ``None``.
    """

    scales: np.ndarray
    offsets: np.ndarray | None
    quants: np.ndarray
    halves: bool
    types: tuple[str, ...]
    factors: ScaleFactors | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.quants.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 weights (the values gguf's dequantisation gives)."""
        out, inputs = self.shape
        scales = np.repeat(self.scales, 16, axis=2).reshape(out, inputs)
        values = scales * self.quants.astype(np.float32)
        if self.offsets is not None:
            values = values + np.repeat(self.offsets, BLOCK_INPUTS, axis=1)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def rows(self, order: np.ndarray) -> QuantizedMatrix:
        """The matrix with its outputs in ``order``."""
        offsets = None if self.offsets is None else self.offsets[order]
        factors = None if self.factors is None else self.factors.rows(order)
        return QuantizedMatrix(self.scales[order], offsets, self.quants[order], self.halves, self.types, factors)

    @staticmethod
    def stack(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
        """``parts`` one above the other (outputs concatenated), in a form that holds them all."""
        if len({part.shape[1] for part in parts}) != 1:
            raise ValueError("stacked matrices need the same number of inputs")
        offsets = None
        if any(part.offsets is not None for part in parts):
            # -0.0 adds nothing to any float, +0.0 included: the parts without offsets keep their exact values.
            offsets = np.concatenate([part.offsets if part.offsets is not None
                                      else np.full(part.scales.shape[:2], -0.0, np.float32) for part in parts])
        return QuantizedMatrix(np.concatenate([part.scales for part in parts]), offsets,
                               np.concatenate([part.quants for part in parts]), any(part.halves for part in parts),
                               tuple(dict.fromkeys(kind for part in parts for kind in part.types)),
                               _stacked_factors(parts))


def _stacked_factors(parts: list[QuantizedMatrix]) -> ScaleFactors | None:
    """The parts' factors one above the other, where every part has them (else ``None``: plain scales)."""
    if any(part.factors is None for part in parts):
        return None
    factors = [part.factors for part in parts]
    offset = small_offsets = None
    if any(factor.offset is not None for factor in factors):
        # -0.0 x 0 = -0.0: the parts without offsets keep theirs (see stack).
        offset = np.concatenate([factor.offset if factor.offset is not None
                                 else np.full(factor.scale.shape, -0.0, np.float32) for factor in factors])
        small_offsets = np.concatenate([factor.small_offsets if factor.small_offsets is not None
                                        else np.zeros(factor.small_scales.shape[:2], np.int8) for factor in factors])
    return ScaleFactors(np.concatenate([factor.scale for factor in factors]),
                        np.concatenate([factor.small_scales for factor in factors]), offset, small_offsets)


def _half_floats(data: np.ndarray) -> np.ndarray:
    return data.copy().view(np.float16).astype(np.float32)


def _low_high(data: np.ndarray, width: int) -> np.ndarray:
    """Bytes holding element j in the low nibble and element j + ``width`` in the high one, as elements."""
    return np.concatenate([data & 15, data >> 4], axis=-1).reshape(*data.shape[:-1], 2 * width)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's twelve bytes of 6-bit scales and offsets: eight of each (gguf's unpacking)."""
    scales = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, m_d = scales[..., 0, :], scales[..., 1, :], scales[..., 2, :]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def decode(blocks: np.ndarray, type_name: str) -> QuantizedMatrix:
    """A GGUF matrix's blocks (``(out, bytes per row)`` uint8, as a file holds them) in the common form.

    Raises:
        ValueError: a type not in :data:`FILE_TYPES`, or blocks of the wrong size.
    """
    type_name = type_name.upper()
    if type_name not in FILE_TYPES:
        raise ValueError(f"GGUF type {type_name} has no quantised product here; types: {', '.join(FILE_TYPES)}")
    from gguf import GGML_QUANT_SIZES

    block_inputs, block_bytes = GGML_QUANT_SIZES[_gguf_type(type_name)]
    blocks = np.asarray(blocks, dtype=np.uint8)
    if blocks.ndim != 2 or blocks.shape[1] % block_bytes:
        raise ValueError(f"{type_name} blocks are rows of {block_bytes}-byte blocks, not an array of shape "
                         f"{blocks.shape}")
    out, count = blocks.shape[0], blocks.shape[1] // block_bytes
    data = blocks.reshape(out, count, block_bytes)
    halves = False
    offsets = None
    factors = None
    if block_inputs == BLOCK_INPUTS:
        scale = _half_floats(data[..., :2])[..., 0]  # (out, groups)
        if type_name == "Q8_0":
            quants = data[..., 2:].view(np.int8)
        elif type_name == "Q4_0":
            quants = _low_high(data[..., 2:], 16).astype(np.int16) - 8
        elif type_name == "Q4_1":
            quants, offsets = _low_high(data[..., 4:], 16), _half_floats(data[..., 2:4])[..., 0]
        else:  # Q5_0, Q5_1: four bytes of fifth bits, then nibbles
            start = 2 if type_name == "Q5_0" else 4
            high = np.unpackbits(data[..., start : start + 4], axis=-1, bitorder="little")
            quants = _low_high(data[..., start + 4 :], 16) | (high << 4)
            if type_name == "Q5_0":
                quants = quants.astype(np.int16) - 16
            else:
                offsets = _half_floats(data[..., 2:4])[..., 0]
        scales = np.repeat(scale[..., None], 2, axis=2)
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _half_floats(data[..., 0:2]), _half_floats(data[..., 2:4])  # (out, count, 1)
        sc, mins = _k_scales(data[..., 4:16])  # (out, count, 8)
        scales = np.repeat((d * sc).reshape(out, count * 8, 1), 2, axis=2)
        offsets = -(dmin * mins).reshape(out, count * 8)
        factors = ScaleFactors(d[..., 0], np.repeat(sc.astype(np.int8).reshape(out, count * 8, 1), 2, axis=2),
                               -dmin[..., 0], mins.astype(np.int8).reshape(out, count * 8))
        if type_name == "Q4_K":  # 32 bytes hold sub-blocks 2j (low nibbles) and 2j + 1 (high)
            quants = _low_high(data[..., 16:].reshape(out, count, 4, 32), 32)
        else:
            high = data[..., 16:48]  # bit j of byte i: sub-block j's fifth bit of input i
            low = _low_high(data[..., 48:].reshape(out, count, 4, 32), 32).reshape(out, count, 8, 32)
            bits = (high[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
            quants = low | (bits << 4)
    else:  # Q6_K: 128 bytes low nibbles, 64 bytes of high pairs, 16 int8 scales, a float16
        ql = data[..., :128].reshape(out, count, 2, 64)
        low = np.concatenate([ql & 15, ql >> 4], axis=-1).reshape(out, count, 2, 4, 32)
        qh = data[..., 128:192].reshape(out, count, 2, 1, 32)
        high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
        quants = (low | (high << 4)).astype(np.int16) - 32
        small = data[..., 192:208].view(np.int8)
        super_scale = _half_floats(data[..., 208:210])
        scales = (small.astype(np.float32) * super_scale).reshape(out, count * 8, 2)
        factors = ScaleFactors(super_scale[..., 0], np.ascontiguousarray(small).reshape(out, count * 8, 2), None, None)
        halves = True
    quants = np.ascontiguousarray(np.asarray(quants).reshape(out, -1).astype(np.int8))
    offsets = None if offsets is None else np.ascontiguousarray(offsets.reshape(out, -1), dtype=np.float32)
    return QuantizedMatrix(np.ascontiguousarray(scales, dtype=np.float32), offsets, quants, halves, (type_name,),
                           factors)


def layout_format(matrix: QuantizedMatrix) -> int:
    """The packed layout's format: its bits and, from :data:`CENTRE_SHIFT` up, the centre added to every quant to
    store it unsigned (nibbles where quant + centre fits four bits, six bits where it fits those, unsigned bytes where
    it stays below 128, else signed bytes)."""
    low, high = (int(matrix.quants.min()), int(matrix.quants.max())) if matrix.quants.size else (0, 0)
    centre = max(0, -low)
    if high + centre <= 15:
        layout = NIBBLES
    elif high + centre <= 63:  # Q6_K and the 5-bit types
        layout = SIX_BITS
    elif high + centre <= 127:
        layout = 0
    else:
        layout, centre = SIGNED, 0
    factored = matrix.factors is not None and matrix.shape[1] % (SUPER_GROUPS * BLOCK_INPUTS) == 0
    half = not factored and _exact_in_half(matrix.scales) and (matrix.offsets is None or
                                                               _exact_in_half(matrix.offsets))
    return (layout | (OFFSETS if matrix.offsets is not None else 0) | (HALVES if matrix.halves else 0)
            | (FACTORED if factored else 0) | (HALF_FLOATS if half else 0) | centre << CENTRE_SHIFT)


def _exact_in_half(values: np.ndarray) -> bool:
    """Whether every float32 of ``values`` is a float16 value (the 32-input types' scales and offsets are)."""
    return bool(np.array_equal(values.astype(np.float16).astype(np.float32).view(np.uint32), values.view(np.uint32)))


def pack(matrix: QuantizedMatrix) -> tuple[torch.Tensor, int]:
    """``matrix`` repacked for ``quantized_linear``: ``(tiles, units, bytes)`` uint8 (outputs past ``out`` zero) and
    its format (:func:`layout_format`). A unit is a group of 32 inputs, or with :data:`FACTORED` a super-block of 8.

    A group of a tile of 8 outputs holds their scales as float32 (two rows of them with :data:`HALVES`), their
    offsets (with :data:`OFFSETS`), then eight vectors of 32 bytes, vector k holding inputs 4k..4k+3 of output j at
    bytes 4j..4j+3 (quant + centre); with :data:`NIBBLES` four vectors, vector k's low nibbles and vector k + 4's high
    ones in one; with :data:`SIX_BITS` those four vectors of the quants' low nibbles, then two vectors of their top two
    bits, quad k's at bits 2(k % 4) of vector k // 4. With :data:`HALF_FLOATS` the scales and offsets are float16. With :data:`FACTORED`, a super-block holds the 8 outputs' float32 scales (and offsets) of
    :class:`ScaleFactors`, then its 8 groups, each with the small integer scales (two rows with :data:`HALVES`) and
    offsets as int8 in place of the floats."""
    layout = layout_format(matrix)
    out, inputs = matrix.shape
    groups, tiles = inputs // BLOCK_INPUTS, -(-out // TILE_OUTPUTS)
    padded_rows = tiles * TILE_OUTPUTS

    def tiled(values: np.ndarray) -> np.ndarray:  # (out, units, k) -> (tiles, units, k * 8 values)
        full = np.zeros((padded_rows, *values.shape[1:]), values.dtype)
        full[:out] = values
        tiles_first = full.reshape(tiles, TILE_OUTPUTS, values.shape[1], -1).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(tiles_first).view(np.uint8).reshape(tiles, values.shape[1], -1)

    factors = matrix.factors if layout & FACTORED else None
    if factors is not None:
        parts = [tiled(factors.small_scales if layout & HALVES else factors.small_scales[..., :1])]
        if layout & OFFSETS:
            parts.append(tiled(factors.small_offsets[..., None]))
    else:
        width = np.float16 if layout & HALF_FLOATS else np.float32
        parts = [tiled((matrix.scales if layout & HALVES else matrix.scales[..., :1]).astype(width))]
        if layout & OFFSETS:
            parts.append(tiled(matrix.offsets[..., None].astype(width)))
    stored = matrix.quants.astype(np.int16) + (layout >> CENTRE_SHIFT)
    quants = np.zeros((padded_rows, inputs), np.uint8)
    quants[:out] = stored.astype(np.int8).view(np.uint8) if layout & SIGNED else stored.astype(np.uint8)
    # (tiles, 8 outputs j, groups, 8 quads k, 4 inputs) -> (tiles, groups, k, j, 4)
    quants = quants.reshape(tiles, TILE_OUTPUTS, groups, 8, 4).transpose(0, 2, 3, 1, 4)
    if layout & (NIBBLES | SIX_BITS):
        low = quants & 15
        nibbles = low[:, :, :4] | (low[:, :, 4:] << 4)
        if layout & SIX_BITS:  # then two vectors of top bits: quad k's at bits 2(k % 4) of vector k // 4
            top = (quants >> 4).reshape(tiles, groups, 2, 4, TILE_OUTPUTS, 4)
            planes = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
            nibbles = np.concatenate([nibbles, planes], axis=2)
        quants = nibbles
    parts.append(np.ascontiguousarray(quants).reshape(tiles, groups, -1))
    packed = np.concatenate(parts, axis=2)
    if factors is not None:
        supers = groups // SUPER_GROUPS
        header = [tiled(factors.scale[..., None])]
        if layout & OFFSETS:
            header.append(tiled(factors.offset[..., None]))
        packed = np.concatenate(header + [packed.reshape(tiles, supers, -1)], axis=2)
    return torch.from_numpy(np.ascontiguousarray(packed)), layout


@dataclass
class PackedMatrix:
    """A matrix in the kernel's tiles (:func:`pack`), with what its product needs to know of it.

    Attributes:
        weight: ``(tiles, groups, bytes)`` uint8.
        format: the layout's format (:func:`layout_format`).
        shape: ``(out, in)``.
        types: the GGUF types it came from.
    """

    weight: torch.Tensor
    format: int
    shape: tuple[int, int]
    types: tuple[str, ...]

    @classmethod
    def of(cls, matrix: QuantizedMatrix) -> PackedMatrix:
        weight, layout = pack(matrix)
        return cls(weight, layout, tuple(matrix.shape), matrix.types)


class MatrixSource(ABC):
    """Where a forward takes block-quantised products from: the model modules (projections, the output head) it
    has a matrix for, and the packed product of several of them stacked by outputs (a fused projection)."""

    @abstractmethod
    def __contains__(self, module: object) -> bool: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Any]: ...

    @abstractmethod
    def packed(self, modules: tuple[Any, ...]) -> PackedMatrix:
        """The product of ``modules``' matrices stacked in that order, packed."""


def packed_product(source: Any, modules: tuple[Any, ...]) -> PackedMatrix:
    """``modules``' matrices from ``source`` (a :class:`MatrixSource`, or a mapping of modules to
    :class:`QuantizedMatrix`) stacked by outputs and packed."""
    if isinstance(source, MatrixSource):
        return source.packed(modules)
    return PackedMatrix.of(QuantizedMatrix.stack([source[module] for module in modules]))


def quantization_name(types: Iterable[str]) -> str:
    """How a product's block types are named to users, e.g. ``q4_k+q6_k``."""
    return "+".join(kind.lower() for kind in types)


class QuantizedLinear(Linear):
    """``y = x @ W.T + bias`` over float32 rows, ``W`` kept block-quantised and repacked once (see the module notes):
    a :class:`~draftwise.backend.weights.products.Linear` whose rows need no padding (``min_rows`` 1 gives every row
    its bits alone).

    Args:
        matrix: the weights (:func:`decode` of a GGUF file's blocks or of :func:`quantize`'s), or them packed.
        bias: ``(out_features,)`` or ``None`` (kept in float32).
        kernels: the compiled kernels' module (:func:`draftwise.backend.native.load_kernels`).
        min_rows, fixed_rows: as :class:`~draftwise.backend.weights.products.Linear`'s.
        activation_bits: each row's activations quantised to 8 bits (llama.cpp's precision; per group of 32
            inputs, per 128 over a factored k-quant packing) or to 16 (two int8 parts: closer to the float product, twice the integer multiplies); see
            :data:`ACTIVATION_BITS`.
    """

    def __init__(self, matrix: QuantizedMatrix | PackedMatrix, bias: torch.Tensor | None, kernels: Any,
                 min_rows: int = 1, fixed_rows: bool = False, activation_bits: int = 16) -> None:
        check_activation_bits(activation_bits)
        if matrix.shape[1] % BLOCK_INPUTS:
            raise ValueError(f"quantised products need inputs in multiples of {BLOCK_INPUTS}, not {matrix.shape[1]}")
        packed = matrix if isinstance(matrix, PackedMatrix) else PackedMatrix.of(matrix)
        self.weight, self.format = packed.weight, packed.format
        self.types = matrix.types
        self.kernels = kernels
        self.out_features, self.in_features = matrix.shape
        self.blocked = None
        self.packed = False
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.min_rows = min_rows
        self.fixed_rows = fixed_rows
        self.activation_bits = activation_bits

    @property
    def quantization(self) -> str:
        return quantization_name(self.types)

    def tile_product(self, tiles: torch.Tensor | slice) -> QuantizedLinear:
        """The product over the outputs of ``tiles`` only (tile ``t`` holds outputs ``8t .. 8t + 7``; a slice takes a
        view of the packed weights, indices a copy), without bias: each output bitwise this product's, since every
        tile's outputs are computed alone."""
        weight = self.weight[tiles] if isinstance(tiles, slice) else self.weight.index_select(0, tiles)
        shape = (weight.shape[0] * TILE_OUTPUTS, self.in_features)
        return QuantizedLinear(PackedMatrix(weight, self.format, shape, self.types), None, self.kernels,
                               self.min_rows, self.fixed_rows, self.activation_bits)

    def _product(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.dtype != torch.float32:
            raise TypeError(f"quantised products take float32 rows, not {inputs.dtype}")
        if inputs.stride(-1) != 1:
            inputs = inputs.contiguous()
        return self.kernels.quantized_linear(inputs, self.weight, self.format, self.bias, self.out_features,
                                             self.activation_bits)


def _dequantized(quants: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """Float32 weights ``(..., in)`` of quants ``(..., in)`` int8, scales ``(..., in / 32, 2)`` and offsets ``(..., in
    / 32)``: the arithmetic of :meth:`QuantizedMatrix.dequantize` (an exact product, then one rounding adding the
    offset), so bitwise its values on any device."""
    *rows, inputs = quants.shape
    values = quants.reshape(*rows, inputs // 16, 16).float() * scales.reshape(*rows, inputs // 16, 1)
    if offsets is not None:
        values = values.reshape(*rows, inputs // BLOCK_INPUTS, BLOCK_INPUTS) + offsets.unsqueeze(-1)
    return values.reshape(*rows, inputs)


class DequantizedLinear(Linear):
    """``y = x @ W.T + bias`` over float32 rows, ``W`` kept block-quantised on its device (int8 quants, float32
    scales and offsets: about 1.3 bytes a weight) and dequantised to float32 once per call: the correct path where the
    compiled CPU kernels do not run (CUDA devices, CPUs they cannot be built on). The float32 weights are exactly the
    quantised model's (:meth:`QuantizedMatrix.dequantize`), and the product is the device library's, padded as
    :class:`~draftwise.backend.weights.products.Linear`'s: row invariance comes from its ``min_rows`` and
    ``fixed_rows``, as for float weights.

    Args:
        matrix: the weights in the common form (:func:`decode`).
        bias: ``(out_features,)`` or ``None`` (kept in float32).
        device: where the quants and the products live.
        min_rows, fixed_rows: as :class:`~draftwise.backend.weights.products.Linear`'s.
        keep_dequantized: dequantise once here and keep the float32 weights (4 bytes a weight) instead of the blocks:
            the same weights in the same products, without the per-call work (see :func:`fits_dequantized`).
    """

    def __init__(self, matrix: QuantizedMatrix, bias: torch.Tensor | None, device: torch.device | str,
                 min_rows: int = 1, fixed_rows: bool = False, keep_dequantized: bool = False) -> None:
        self.out_features, self.in_features = matrix.shape
        if self.in_features % BLOCK_INPUTS:
            raise ValueError(f"quantised products need inputs in multiples of {BLOCK_INPUTS}, not {self.in_features}")
        self.rows: DequantizedRows | None = DequantizedRows(matrix, device)
        self.types = matrix.types
        self.blocked = None
        self.packed = False
        #: The float32 weights, where kept (else ``None``: dequantised per call).
        self.kept: torch.Tensor | None = None
        if keep_dequantized:
            self.kept = self.rows.all()
            self.rows = None
        self.weight = self.kept if self.kept is not None else self.rows.quants  # (what memory is counted by)
        self.bias = None if bias is None else bias.detach().float().to(device).contiguous()
        self.min_rows = min_rows
        self.fixed_rows = fixed_rows

    @property
    def quantization(self) -> str:
        return quantization_name(self.types)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights ``(out, in)``."""
        return self.kept if self.kept is not None else self.rows.all()

    def _bound_product(self) -> Any:
        weight = self.dequantize()  # once per call (where not kept), whatever the number of fixed-row pieces

        def product(inputs: torch.Tensor) -> torch.Tensor:
            if inputs.dtype != torch.float32:
                raise TypeError(f"quantised products take float32 rows, not {inputs.dtype}")
            return F.linear(inputs, weight, self.bias)

        return product


def fits_dequantized(shape: tuple[int, int], device: torch.device | str, headroom: float = 0.25) -> bool:
    """Whether a CUDA device has room for a matrix of ``shape`` in float32 and still ``headroom`` of its memory free
    (for the caches, the step's buffers and the other matrices' blocks): measured when asked, so a load keeps the
    matrices dequantised while they fit and the rest as blocks. Never on other devices (the CPU kernels read the
    blocks themselves)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    free, total = torch.cuda.mem_get_info(device)
    return 4 * shape[0] * shape[1] <= free - headroom * total


class DequantizedRows:
    """A block-quantised token embedding on a device (int8 quants, float32 scales and offsets), the rows a forward
    looks up dequantised there: by device operations alone, so a captured CUDA graph can hold the lookup."""

    def __init__(self, matrix: QuantizedMatrix, device: torch.device | str) -> None:
        self.quants = torch.from_numpy(matrix.quants).to(device)
        self.scales = torch.from_numpy(matrix.scales).to(device)
        self.offsets = None if matrix.offsets is None else torch.from_numpy(matrix.offsets).to(device)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.quants.shape)

    def to(self, device: torch.device | str) -> DequantizedRows:
        if torch.device(device) != self.quants.device:
            raise ValueError("dequantised embedding rows stay on the device they were made for")
        return self

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        return _dequantized(self.quants[tokens], self.scales[tokens],
                            None if self.offsets is None else self.offsets[tokens])

    def all(self) -> torch.Tensor:
        """Every row, float32 ``(rows, in)``."""
        return _dequantized(self.quants, self.scales, self.offsets)
