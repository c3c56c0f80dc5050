"""The compiled linear product (blocked weights; float32 and bfloat16 with AVX2 and FMA, or with AVX-512 (bfloat16 there
with avx512_bf16)): agreement with a float64 product, every row
bitwise its result alone (whatever else shares the call, at any thread count), bias and ragged output counts, and
clear refusals."""

from __future__ import annotations

import pytest
import torch
from tiny import make_tiny_model, torch_threads

from draftwise.backend import native
from draftwise.backend.forward.lean import LeanTarget
from draftwise.backend.weights.products import Linear, blocked_available

kernels = native.load_kernels(warn=False)
pytestmark = pytest.mark.skipif(kernels is None or not kernels.blocked_linear_dtypes(),
                                reason="the blocked product needs the kernels built for a CPU with AVX2 and FMA or AVX-512")
DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(
    kernels is None or name not in kernels.blocked_linear_dtypes(), reason=f"no blocked {name} product here"))
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"))]


def weights(out_features: int, in_features: int, seed: int = 0, bias: bool = True, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)
    offsets = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    return weight, offsets


@pytest.mark.parametrize(("out_features", "in_features"), [(64, 32), (960, 576), (100, 2), (17, 1536), (1, 8)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_a_float64_product(out_features, in_features, bias, dtype):
    weight, offsets = weights(out_features, in_features, bias=bias, dtype=dtype)
    inputs = torch.randn(9, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    packed = kernels.pack_blocked_weight(weight)
    output = kernels.blocked_linear(inputs, packed, offsets, out_features)
    expected = inputs.double() @ weight.double().T + (offsets.double() if bias else 0)
    assert output.shape == (9, out_features) and output.dtype == dtype
    # A float32 sum (rounded once to bfloat16 there): within the dtype's relative step of the exact result.
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(output.double(), expected, rtol=rtol, atol=rtol * expected.abs().max().item())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("in_features", [96, 200])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_is_bitwise_its_result_alone(threads, in_features, dtype):
    # 2-32 rows take the weights in chunks of input steps (sums kept between chunks), 1 and more than 32 in one pass:
    # widths with a last chunk full and short, row counts on both sides.
    weight, offsets = weights(200, in_features, dtype=dtype)
    inputs = torch.randn(45, in_features, generator=torch.Generator().manual_seed(2)).to(dtype)
    packed = kernels.pack_blocked_weight(weight)
    with torch_threads(threads):
        together = kernels.blocked_linear(inputs, packed, offsets, 200)
        for rows in (1, 2, 5, 6, 7, 13, 16, 17, 31, 32, 33, 44):
            assert torch.equal(kernels.blocked_linear(inputs[:rows], packed, offsets, 200), together[:rows])
        for row in (0, 17, 32, 44):
            assert torch.equal(kernels.blocked_linear(inputs[row : row + 1], packed, offsets, 200)[0], together[row])
        shuffled = inputs.clone()
        shuffled[1:] = shuffled[1:].flip(0)
        assert torch.equal(kernels.blocked_linear(shuffled, packed, offsets, 200)[0], together[0])


@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_strided_rows_and_empty_calls(dtype):
    weight, offsets = weights(64, 32)
    packed = kernels.pack_blocked_weight(weight)
    wide = torch.randn(5, 48).to(torch.bfloat16)
    assert torch.equal(kernels.blocked_linear(wide[:, :32], packed, offsets, 64),
                       kernels.blocked_linear(wide[:, :32].contiguous(), packed, offsets, 64))
    assert kernels.blocked_linear(wide[:0, :32], packed, offsets, 64).shape == (0, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_uses_it_and_needs_no_padding(dtype):
    weight, offsets = weights(130, 64, dtype=dtype)
    assert blocked_available(kernels, weight) and not blocked_available(kernels, weight.half())
    assert not blocked_available(None, weight)
    product = Linear(weight, offsets, packed=False, kernels=kernels)
    assert product.blocked is not None
    inputs = torch.randn(3, 64).to(dtype)
    assert torch.equal(product(inputs), kernels.blocked_linear(inputs, product.weight, offsets, 130))
    assert Linear(weight.half(), None, packed=False, kernels=kernels).blocked is None


@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_odd_bfloat16_widths_keep_the_library(dtype):
    assert not blocked_available(kernels, weights(8, 7)[0])


@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_bad_arguments_are_refused(dtype):
    weight, _ = weights(64, 32)
    packed = kernels.pack_blocked_weight(weight)
    with pytest.raises(RuntimeError, match="even"):
        kernels.pack_blocked_weight(weights(8, 7)[0])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.pack_blocked_weight(weight.half())
    with pytest.raises(RuntimeError, match="features"):
        kernels.blocked_linear(torch.randn(2, 30).to(torch.bfloat16), packed, None, 64)
    with pytest.raises(RuntimeError, match="out_features"):
        kernels.blocked_linear(torch.randn(2, 32).to(torch.bfloat16), packed, None, 65)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.blocked_linear(torch.randn(2, 32).to(torch.bfloat16), packed, torch.zeros(63, dtype=torch.bfloat16), 64)
    with pytest.raises(RuntimeError, match="inputs"):
        kernels.blocked_linear(torch.randn(2, 32), packed, None, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_lean_forward_runs_its_products_on_it(dtype):
    model = make_tiny_model("llama", seed=0).to(dtype)
    target = LeanTarget(model, kernel=True)
    assert target.linear_path == "kernel" and target.linear_min_rows == 1
    assert all(linear.blocked is not None for layer in target.layers
               for linear in (layer.qkv, layer.output, layer.gate_up, layer.down))
    assert LeanTarget(model, kernel=False).linear_path in ("onednn", "library")
