"""The arithmetic of the compiled quantised product (``native/quantized.cpp``) in numpy, step by step: activations
quantised per group of 32 inputs to 8 bits, or to 16-bit fixed point (an int8 and an int8 residual), exact integer
sums per half group, then the float32 operations in the kernel's order. The kernel must equal it bit for bit."""

from __future__ import annotations

import numpy as np
import torch

from draftwise.backend.weights.quantized import BLOCK_INPUTS, SUPER_GROUPS, QuantizedMatrix

#: Largest relative error (in norm) of a quantised product against the float64 product of its dequantised weights, by
#: activation bits: activations in 8 bits per group of 32 put it near 5e-3 on Gaussian rows, in 16-bit fixed point
#: near 2e-5.
PRODUCT_TOLERANCE = {8: 1e-2, 16: 1e-3}


def relative_error(ours: torch.Tensor, exact: torch.Tensor) -> float:
    """``ours`` against ``exact``, relative, in norm (float64)."""
    return ((ours.double() - exact.double()).norm() / exact.double().norm()).item()


def quantized_activations(inputs: np.ndarray, activation_bits: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``inputs`` ``(rows, in)`` float32 per group: fixed-point activations ``(rows, groups, 32)`` (256 q + r, with
    r = 0 at 8 bits) and their unit ``(rows, groups)`` (d / 256)."""
    rows, features = inputs.shape
    groups = inputs.reshape(rows, features // BLOCK_INPUTS, BLOCK_INPUTS).astype(np.float32)
    scales = (np.abs(groups).max(axis=-1) / np.float32(127)).astype(np.float32)
    inverse = np.zeros_like(scales)
    np.divide(np.float32(1), scales, out=inverse, where=scales != 0)
    quants = np.clip(np.rint(groups * inverse[..., None]), -127, 127).astype(np.float32)
    residuals = (groups - scales[..., None] * quants).astype(np.float32)
    residuals = np.clip(np.rint(residuals * (inverse * np.float32(256))[..., None]), -127, 127)
    if activation_bits == 8:
        residuals = np.zeros_like(residuals)
    fixed = 256 * quants.astype(np.int64) + residuals.astype(np.int64)
    return fixed, (scales / np.float32(256)).astype(np.float32)


def ordered_sum(values: np.ndarray, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's last steps: ``values`` ``(rows, out, parts)`` float32 added into each output one part after the
    other from zero, then the bias."""
    total = np.zeros(values.shape[:2], np.float32)
    for part in range(values.shape[2]):
        total = total + values[:, :, part]
    if bias is not None:
        total = total + bias.numpy().astype(np.float32)
    return torch.from_numpy(total.astype(np.float32))


def reference_product(inputs: torch.Tensor, matrix: QuantizedMatrix, bias: torch.Tensor | None,
                      activation_bits: int = 16) -> torch.Tensor:
    """What ``quantized_linear`` computes for ``inputs`` over ``matrix`` (and ``bias``) with activations in
    ``activation_bits``, in float32."""
    if activation_bits == 8 and super_blocks(matrix):
        return super_block_product(inputs, matrix, bias)
    quants, scales = quantized_activations(inputs.numpy(), activation_bits)
    rows, groups = scales.shape
    out = matrix.shape[0]
    weights = matrix.quants.astype(np.int64).reshape(out, groups, 2, BLOCK_INPUTS // 2)
    halves = np.einsum("rghi,oghi->rogh", quants.reshape(rows, groups, 2, -1), weights)  # exact
    if matrix.halves:
        values = (matrix.scales[None, :, :, 0] * halves[..., 0].astype(np.float32)
                  + matrix.scales[None, :, :, 1] * halves[..., 1].astype(np.float32))
    else:
        values = matrix.scales[None, :, :, 0] * halves.sum(-1).astype(np.float32)
    values = (values * scales[:, None, :]).astype(np.float32)
    if matrix.offsets is not None:
        scaled_sums = (scales * quants.sum(-1).astype(np.float32)).astype(np.float32)
        values = values + matrix.offsets[None] * scaled_sums[:, None, :]
    return ordered_sum(values, bias)


#: Groups of 32 inputs sharing one activation scale in the super-block arithmetic.
SCALE_GROUPS = 4


def super_blocks(matrix: QuantizedMatrix) -> bool:
    """Whether 8-bit products over ``matrix`` take the super-block arithmetic (a factored packing: k-quants whose
    inputs fill super-blocks)."""
    return matrix.factors is not None and matrix.shape[1] % (SUPER_GROUPS * BLOCK_INPUTS) == 0


def super_block_product(inputs: torch.Tensor, matrix: QuantizedMatrix, bias: torch.Tensor | None) -> torch.Tensor:
    """The super-block arithmetic: activations quantised to 8 bits per 256 inputs, exact integer sums of each
    super-block weighted by its small scales (and offsets), then per super-block the float32 steps
    ``((super_scale * I) * d) + ((super_offset * M) * d)``, summed in order, the bias last."""
    x = inputs.numpy().astype(np.float32)
    rows, features = x.shape
    supers, groups = features // (SCALE_GROUPS * BLOCK_INPUTS), features // BLOCK_INPUTS
    blocks = x.reshape(rows, supers, SCALE_GROUPS * BLOCK_INPUTS)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    inverse = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inverse, where=d != 0)
    q = np.clip(np.rint((blocks * inverse[..., None]).astype(np.float32)), -127, 127).astype(np.int64)
    q = q.reshape(rows, groups, 2, BLOCK_INPUTS // 2)
    out = matrix.shape[0]
    weights = matrix.quants.astype(np.int64).reshape(out, groups, 2, BLOCK_INPUTS // 2)
    halves = np.einsum("rghi,oghi->rogh", q, weights)  # exact
    factors = matrix.factors
    small = factors.small_scales.astype(np.int64)  # (out, groups, 2)
    integers = (halves * small[None]).reshape(rows, out, supers, SCALE_GROUPS * 2).sum(-1)
    per_block = SUPER_GROUPS // SCALE_GROUPS  # (each activation block's super-block factors)
    super_scale = np.repeat(factors.scale, per_block, axis=1)
    values = (super_scale[None] * integers.astype(np.float32)).astype(np.float32)
    values = (values * d[:, None, :]).astype(np.float32)
    if factors.offset is not None:
        group_sums = q.sum(axis=(2, 3))  # (rows, groups)
        offsets = np.einsum("rg,og->rog", group_sums, factors.small_offsets.astype(np.int64))
        offsets = offsets.reshape(rows, out, supers, SCALE_GROUPS).sum(-1)
        super_offset = np.repeat(factors.offset, per_block, axis=1)
        shifted = (super_offset[None] * offsets.astype(np.float32)).astype(np.float32)
        values = (values + (shifted * d[:, None, :]).astype(np.float32)).astype(np.float32)
    return ordered_sum(values, bias)
