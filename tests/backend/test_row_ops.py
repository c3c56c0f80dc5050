"""The compiled row-wise kernels (RMSNorm, rotary embedding, SiLU gating): agreement with torch's operations, every
row bitwise its result alone (whatever else shares the call, at any thread count), and the padding rows."""

from __future__ import annotations

import pytest
import torch
from tiny import torch_threads

from draftwise.backend import native

pytestmark = pytest.mark.skipif(native.load_kernels(warn=False) is None,
                                reason=f"the kernels cannot be built here: {native.unavailable_reason()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: Agreement with the torch reference computed in float64, relative to the values' scale, by dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    scale = expected.abs().max().item() or 1.0
    return (actual.double() - expected.double()).abs().max().item() <= TOLERANCE[dtype] * scale


def reference_rms_norm(hidden, weight, eps):
    hidden64 = hidden.double()
    return weight.double() * hidden64 * torch.rsqrt(hidden64.pow(2).mean(-1, keepdim=True) + eps)


def reference_rotate(qkv, cos, signed_sin, heads, kv_heads, scale):
    rows, dim = cos.shape
    states = qkv[:, : (heads + kv_heads) * dim].double().view(rows, heads + kv_heads, dim)
    rotated = states * cos.double()[:, None] + torch.roll(states, dim // 2, -1) * signed_sin.double()[:, None]
    return rotated[:, :heads] * scale, rotated[:, heads:]


def rope_tables(positions, dim, dtype):
    inverse = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.tensor(positions, dtype=torch.float32), inverse)
    angles = torch.cat([angles, angles], -1)
    sin = angles.sin()
    signed = torch.cat([-sin[:, : dim // 2], sin[:, dim // 2 :]], -1)
    return angles.cos().to(dtype).contiguous(), signed.to(dtype).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [8, 64, 576, 100])
def test_rms_norm_matches_torch(dtype, dim):
    generator = torch.Generator().manual_seed(dim)
    hidden = (torch.randn(5, dim, generator=generator) * 3).to(dtype)
    weight = torch.rand(dim, generator=generator).to(dtype) + 0.5
    assert close(native.rms_norm(hidden, weight, 1e-5), reference_rms_norm(hidden, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [16, 1536, 40, 13])
def test_silu_mul_matches_torch(dtype, width):
    generator = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(6, 2 * width, generator=generator) * 6).to(dtype)
    gate, up = gate_up[:, :width].double(), gate_up[:, width:].double()
    assert close(native.silu_mul(gate_up, 6), torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "heads", "kv_heads"), [(64, 9, 3), (8, 2, 2), (128, 4, 1)])
def test_rotation_matches_torch(dtype, dim, heads, kv_heads):
    generator = torch.Generator().manual_seed(dim)
    positions = [0, 1, 7, 300, 4095]
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    cos, signed_sin = rope_tables(positions, dim, dtype)
    queries, keys = native.rotate_queries_keys(qkv, cos, signed_sin, len(positions), heads, kv_heads, 0.125)
    expected_queries, expected_keys = reference_rotate(qkv, cos, signed_sin, heads, kv_heads, 0.125)
    assert queries.shape == (len(positions), heads, dim) and keys.shape == (len(positions), kv_heads, dim)
    assert close(queries, expected_queries, dtype) and close(keys, expected_keys, dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_is_bitwise_its_result_alone(dtype, threads):
    generator = torch.Generator().manual_seed(0)
    rows, dim, width, heads, kv_heads, head_dim = 37, 96, 80, 6, 2, 16
    hidden = torch.randn(rows, dim, generator=generator).to(dtype)
    weight = torch.rand(dim, generator=generator).to(dtype)
    gate_up = torch.randn(rows, 2 * width, generator=generator).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    cos, signed_sin = rope_tables(list(range(100, 100 + rows)), head_dim, dtype)
    with torch_threads(threads):
        norms = native.rms_norm(hidden, weight, 1e-6)
        gated = native.silu_mul(gate_up, rows)
        queries, keys = native.rotate_queries_keys(qkv, cos, signed_sin, rows, heads, kv_heads, 0.25)
        for row in (0, 1, 17, rows - 1):
            alone = slice(row, row + 1)
            assert torch.equal(native.rms_norm(hidden[alone], weight, 1e-6), norms[alone])
            assert torch.equal(native.silu_mul(gate_up[alone], 1), gated[alone])
            alone_queries, alone_keys = native.rotate_queries_keys(qkv[alone], cos[alone], signed_sin[alone], 1, heads,
                                                                   kv_heads, 0.25)
            assert torch.equal(alone_queries, queries[alone]) and torch.equal(alone_keys, keys[alone])
        # A row's result does not depend on the other rows' contents either.
        shuffled = hidden.clone()
        shuffled[1:] = shuffled[1:].flip(0)
        assert torch.equal(native.rms_norm(shuffled, weight, 1e-6)[0], norms[0])


def test_padding_rows_are_zero_and_only_the_given_rows_are_read():
    hidden = torch.randn(2, 32, dtype=torch.bfloat16)
    weight = torch.ones(32, dtype=torch.bfloat16)
    padded = native.rms_norm(hidden, weight, 1e-6, 4)
    assert padded.shape == (4, 32) and not padded[2:].any()
    assert torch.equal(padded[:2], native.rms_norm(hidden, weight, 1e-6))
    gate_up = torch.randn(4, 64, dtype=torch.bfloat16)
    gated = native.silu_mul(gate_up, 1, 4)
    assert gated.shape == (4, 32) and not gated[1:].any()
    assert torch.equal(gated[:1], native.silu_mul(gate_up[:1], 1))


def test_bad_shapes_are_refused():
    with pytest.raises(RuntimeError, match="weight"):
        native.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="even"):
        native.silu_mul(torch.randn(2, 7), 2)
    with pytest.raises(RuntimeError, match="qkv"):
        cos, sin = rope_tables([0, 1], 8, torch.float32)
        native.rotate_queries_keys(torch.randn(2, 30), cos, sin, 2, 2, 1, 1.0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        native.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot, first, count", [(0, 0, 1), (5, 2, 3), (62, 0, 7), (60, 1, 70)])
def test_write_rows_matches_slice_copies(dtype, slot, first, count):
    """Rows' keys and values land at their block and offset in every layer, across block boundaries, nothing else
    touched."""
    layers, kv_heads, block, dim, blocks = 3, 2, 64, 8, 3
    generator = torch.Generator().manual_seed(slot + count)
    caches = [torch.randn(layers, blocks, kv_heads, block, dim, generator=generator).to(dtype) for _ in range(2)]
    rows = [torch.randn(layers, first + count + 2, kv_heads, dim, generator=generator).to(dtype) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    for position in range(slot, slot + count):
        for cache, source in zip(expected, rows):
            cache[:, position // block, :, position % block] = source[:, first + position - slot]
    native.load_kernels().write_rows(*caches, *rows, slot, first, count)
    assert all(torch.equal(cache, reference) for cache, reference in zip(caches, expected))
    with pytest.raises(RuntimeError, match="past the cache"):
        native.load_kernels().write_rows(*caches, *rows, blocks * block - count + 1, first, count)
