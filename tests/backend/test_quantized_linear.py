"""The compiled product over GGUF block-quantised weights (Q8_0, Q4_0): the packing keeps gguf's own values, the
product is bit for bit its stated integer arithmetic (``quantized_reference``), stays close to the float64 product of
the dequantised matrix, gives every row its result alone at any thread count, and refuses bad calls clearly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantized_reference import PRODUCT_TOLERANCE, reference_product, relative_error
from tiny import torch_threads

from draftwise.backend import native
from draftwise.backend.weights.quantized import (CENTRE_SHIFT, HALF_FLOATS, KINDS, NIBBLES, SIGNED, QuantizedLinear,
                                                 decode, dequantize, pack, quantize)

#: The largest relative error (in norm) of a tiny model's logits after every layer's products, by activation bits.
LOGITS_TOLERANCE = {8: 1e-2, 16: 1e-3}
#: The least share of its rows whose top token is the float forward's, by activation bits (a random tiny model's
#: logits are close to ties; the shipped model's test asks 98 % of real text at both precisions).
TOP_AGREEMENT = {8: 0.95, 16: 0.98}

kernels = native.load_kernels(warn=False)
pytestmark = pytest.mark.skipif(kernels is None, reason="the kernels cannot be built here")


def matrix(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator) / in_features**0.5


def rows(count: int, in_features: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, in_features, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 32), (200, 96), (17, 576), (960, 576)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bits", [8, 16])
def test_is_its_integer_arithmetic_and_close_to_the_float_product(kind, out_features, in_features, bias, bits):

    blocks = quantize(matrix(out_features, in_features), kind)
    weights = dequantize(blocks, kind)
    offsets = torch.randn(out_features, generator=torch.Generator().manual_seed(3)) if bias else None
    linear = QuantizedLinear(decode(blocks, kind), offsets, kernels, activation_bits=bits)
    inputs = rows(9, in_features)
    output = linear(inputs)
    assert output.shape == (9, out_features) and output.dtype == torch.float32
    assert torch.equal(output, reference_product(inputs, decode(blocks, kind), offsets, bits))
    exact = inputs.double() @ weights.double().T + (offsets.double() if bias else 0)
    assert relative_error(output, exact) < PRODUCT_TOLERANCE[bits]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fixed_rows", [False, True])
def test_weights_dequantised_once_are_the_per_call_product(kind, fixed_rows):
    from draftwise.backend.weights.quantized import DequantizedLinear, fits_dequantized

    blocks = decode(quantize(matrix(48, 96), kind), kind)
    bias = torch.randn(48)
    per_call = DequantizedLinear(blocks, bias, "cpu", min_rows=4, fixed_rows=fixed_rows)
    kept = DequantizedLinear(blocks, bias, "cpu", min_rows=4, fixed_rows=fixed_rows, keep_dequantized=True)
    assert per_call.kept is None and kept.rows is None and kept.weight.dtype == torch.float32
    for count in (1, 3, 9):
        inputs = rows(count, 96)
        assert torch.equal(kept(inputs), per_call(inputs))
    assert not fits_dequantized((48, 96), "cpu")  # (the CPU kernels read blocks: nothing to keep there)


def awkward_rows(in_features: int) -> torch.Tensor:
    """Rows whose groups test the activations' quantisation at its edges: a group of zeros, groups whose scaled
    values fall on rounding ties, subnormal and huge magnitudes, one value far above the rest, negative zeros."""
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(8, in_features, generator=generator)
    groups = base.view(8, -1, 32)
    groups[0] = 0.0
    groups[1] = torch.arange(-16, 16, dtype=torch.float32) + 0.5
    groups[1, :, 0] = 127.0  # d = 1 exactly: every other value falls on a rounding tie (x.5)
    groups[2] *= 1e-39  # subnormal
    groups[3] *= 1e30
    groups[4, :, 7] = 1e6  # one outlier: the rest quantise to 0 and live in their residuals
    groups[5] = -0.0
    groups[6, :, ::2] = 0.5 * groups[6, :, 1::2]
    return base


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("bits", [8, 16])
def test_activation_quantisation_at_its_edges_is_the_reference(kind, bits):
    blocks = quantize(matrix(40, 96), kind)
    linear = QuantizedLinear(decode(blocks, kind), None, kernels, activation_bits=bits)
    inputs = awkward_rows(96)
    assert torch.equal(linear(inputs), reference_product(inputs, decode(blocks, kind), None, bits))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits", [8, 16])
def test_every_row_is_bitwise_its_result_alone(kind, threads, bits):
    blocks = quantize(matrix(200, 160), kind)
    linear = QuantizedLinear(decode(blocks, kind), torch.randn(200), kernels, activation_bits=bits)
    inputs = rows(45, 160)
    with torch_threads(threads):
        together = linear(inputs)
        for count in (1, 2, 3, 4, 5, 8, 13, 44):
            assert torch.equal(linear(inputs[:count]), together[:count])
        for row in (0, 17, 44):
            assert torch.equal(linear(inputs[row : row + 1])[0], together[row])
        shuffled = inputs.clone()
        shuffled[1:] = shuffled[1:].flip(0)
        assert torch.equal(linear(shuffled)[0], together[0])
        assert torch.equal(linear(inputs[:, :].T.contiguous().T[:3]), together[:3])  # strided rows


@pytest.mark.parametrize("kind", list(KINDS))
def test_packing_keeps_every_block_value(kind):
    """The packed scales and quants (less the centre) give back exactly gguf's values, padding outputs zero."""
    blocks = quantize(matrix(70, 64, seed=5), kind)
    weights = dequantize(blocks, kind)
    packed, layout = pack(decode(blocks, kind))
    packed = packed.numpy()
    quants = SIGNED if kind == "q8_0" else NIBBLES | 8 << CENTRE_SHIFT  # Q4_0: + 8
    assert packed.shape[:2] == (9, 2) and layout == quants | HALF_FLOATS  # the file's float16 scales, as they are
    scales = packed[:, :, :16].copy().view(np.float16).astype(np.float32)  # (tiles, groups, 8 outputs)
    body = packed[:, :, 16:]
    if kind == "q8_0":
        quants = body.reshape(9, 2, 8, 8, 4).view(np.int8).astype(np.float32)  # (tiles, groups, quads, outputs, 4)
    else:
        nibbles = body.reshape(9, 2, 4, 8, 4)
        quants = np.concatenate([nibbles & 15, nibbles >> 4], axis=2).astype(np.float32) - 8
    quants = quants.transpose(0, 3, 1, 2, 4).reshape(72, 64)  # (outputs, inputs)
    values = np.repeat(scales.transpose(0, 2, 1).reshape(72, 2), 32, axis=1) * quants
    assert np.array_equal(values[:70].view(np.uint32), weights.numpy().view(np.uint32))  # signed zeros too
    assert not values[70:].any()


def test_clear_refusals():
    blocks = quantize(matrix(64, 64), "q8_0")
    linear = QuantizedLinear(decode(blocks, "q8_0"), None, kernels)
    with pytest.raises(TypeError, match="float32"):
        linear(rows(2, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="features"):
        kernels.quantized_linear(rows(2, 32), linear.weight, linear.format, None, 64, 8)
    with pytest.raises(RuntimeError, match="packing"):
        kernels.quantized_linear(rows(2, 64), linear.weight, 1, None, 64, 8)  # Q8_0 bytes read as nibbles
    with pytest.raises(RuntimeError, match="format"):
        kernels.quantized_linear(rows(2, 64), linear.weight, 9, None, 64, 8)  # signed nibbles
    with pytest.raises(RuntimeError, match="activation_bits"):
        kernels.quantized_linear(rows(2, 64), linear.weight, linear.format, None, 64, 4)
    with pytest.raises(ValueError, match="activation_bits"):
        QuantizedLinear(decode(blocks, "q8_0"), None, kernels, activation_bits=12)
    with pytest.raises(ValueError, match="unknown quantisation"):
        quantize(matrix(64, 64), "q3_k")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(matrix(64, 48), "q4_0")
    with pytest.raises(ValueError, match="no quantised product"):
        decode(blocks, "q2_k")
    with pytest.raises(ValueError, match="34-byte blocks"):
        decode(blocks[:, :30], "q8_0")
    assert linear(rows(0, 64)).shape == (0, 64)


def dequantised_copy(model, kind: str):
    """``model`` with every linear weight replaced by its ``kind`` blocks' gguf dequantisation."""
    import copy

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for module in twin.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantize(quantize(module.weight, kind), kind))
    return twin


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("bits", [8, 16])
def test_a_quantised_forward_is_close_to_the_float_forward_of_the_dequantised_model(kind, family, bits, tmp_path):
    """Prefill and verification rows of the quantised target against the float32 lean forward of the same model with
    gguf-dequantised weights: within LOGITS_TOLERANCE, and the same top token on nearly every row (a float32 cache, as
    the reference's: the products' error alone)."""
    from tiny import make_tiny_model, planned, prefill_and_chain_logits

    from draftwise.backend.forward.lean import LeanTarget

    model = make_tiny_model(family, seed=0)
    quantised = LeanTarget(model, quantization=kind, activation_bits=bits, kv_cache_dtype="float32")
    reference = planned(dequantised_copy(model, kind), tmp_path)
    assert quantised.linear_path == f"kernel-{kind}" and quantised.quantization == kind
    prompt, chain = list(range(3, 40)), list(range(5, 45))
    outputs = [prefill_and_chain_logits(target, prompt, chain, 128) for target in (quantised, reference)]
    for ours, theirs in zip(outputs[0], outputs[1]):
        assert relative_error(ours, theirs) < LOGITS_TOLERANCE[bits]
    ours, theirs = outputs[0][1], outputs[1][1]
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= TOP_AGREEMENT[bits]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("method", ["pld", "aded"])
@pytest.mark.parametrize("bits", [8, 16])
def test_every_method_gives_plain_greedy_ids_on_quantised_weights(kind, method, bits, tmp_path):
    import random

    from equivalence import assert_same_ids_as_ar
    from tiny import make_tiny_model, repetitive_prompt

    from draftwise.backend.calibration.invariance import plan_rows, probe_linear_rows
    from draftwise.backend.calibration.machine import MeasurementStore
    from draftwise.backend.forward.lean import LeanTarget

    target = LeanTarget(make_tiny_model("qwen2", seed=0), quantization=kind, activation_bits=bits)
    assert probe_linear_rows(target) == 1  # rows need no padding to be exact (a padding may still be taken for speed)
    assert plan_rows(target, MeasurementStore(tmp_path)).exact
    prompts = [repetitive_prompt(random.Random(seed), low=30, high=40) for seed in range(3)]
    assert_same_ids_as_ar(target, None, prompts, method, max_new_tokens=40)
    assert_same_ids_as_ar(target, None, prompts, method, max_new_tokens=40, max_batch=3)


def test_quantised_weights_refuse_what_they_cannot_run(tmp_path):
    from tiny import make_tiny_model

    import draftwise
    from draftwise.backend.forward.lean import LeanTarget
    from draftwise.errors import ModelLoadError, UnsupportedModelError
    from draftwise.models import make_target

    with pytest.raises(UnsupportedModelError, match="float32"):
        LeanTarget(make_tiny_model("llama", seed=0).to(torch.bfloat16), quantization="q8_0")
    with pytest.raises(UnsupportedModelError, match="unknown weights"):
        LeanTarget(make_tiny_model("llama", seed=0), quantization="q3_k")
    with pytest.raises(UnsupportedModelError, match="multiples of 32"):
        LeanTarget(make_tiny_model("llama", seed=0, hidden_size=48, intermediate_size=96), quantization="q4_0")
    with pytest.raises(UnsupportedModelError, match="lean backend"):
        make_target(make_tiny_model("llama", seed=0), backend="transformers", weights="q8_0", calibrate=False)
    with pytest.raises(ModelLoadError, match="unknown weights"):
        draftwise.load_model("smollm2-135m", weights="int3", cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="unknown activation_bits 4"):
        draftwise.load_model("smollm2-135m", activation_bits=4, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="activation_bits"):
        LeanTarget(make_tiny_model("llama", seed=0), quantization="q8_0", activation_bits=32)
