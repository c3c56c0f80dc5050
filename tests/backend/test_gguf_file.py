"""A GGUF file's own block types run as shipped: every type decodes to exactly gguf's dequantised values, its product
equals the float32 blocked product of those values bit for bit (alone, stacked with other types, any row count), and
a real file's quantised forward equals the float32 forward of the model transformers de-quantised from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.backend import native
from draftwise.backend.weights.quantized import FILE_TYPES, QuantizedLinear, QuantizedMatrix, decode

kernels = native.load_kernels(warn=False)
pytestmark = pytest.mark.skipif(kernels is None, reason="the kernels cannot be built here")
exact = kernels is not None and "float32" in kernels.blocked_linear_dtypes()


def random_blocks(type_name: str, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Random bytes in ``type_name``'s block layout, with finite, small float16 scales (and offsets)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    block_inputs, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    count = in_features // block_inputs
    blocks = rng.integers(0, 256, size=(out_features, count, block_bytes), dtype=np.uint8)

    def halves() -> np.ndarray:
        return (rng.standard_normal((out_features, count)) * 0.01).astype(np.float16).view(np.uint8).reshape(
            out_features, count, 2)

    if type_name == "Q6_K":
        blocks[..., 208:210] = halves()
    else:
        blocks[..., 0:2] = halves()
        if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            blocks[..., 2:4] = halves()
    return blocks.reshape(out_features, -1)


def gguf_values(blocks: np.ndarray, type_name: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[type_name]))


@pytest.mark.parametrize("type_name", FILE_TYPES)
def test_every_type_decodes_to_ggufs_values_bit_for_bit(type_name):
    blocks = random_blocks(type_name, 70, 512)
    ours = decode(blocks, type_name).dequantize().numpy()
    assert np.array_equal(ours.view(np.uint32), gguf_values(blocks, type_name).numpy().view(np.uint32))


def blocked(inputs: torch.Tensor, weights: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return kernels.blocked_linear(inputs, kernels.pack_blocked_weight(weights), bias, weights.shape[0])


@pytest.mark.parametrize("type_name", FILE_TYPES)
def test_every_types_product_is_the_float_product_of_its_values(type_name):
    blocks = random_blocks(type_name, 200, 512, seed=1)
    linear = QuantizedLinear(decode(blocks, type_name), None, kernels)
    assert linear.quantization == type_name.lower()
    inputs = torch.randn(9, 512, generator=torch.Generator().manual_seed(2))
    output = linear(inputs)
    expected = inputs.double() @ gguf_values(blocks, type_name).double().T
    assert torch.allclose(output.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    if exact:
        assert torch.equal(output, blocked(inputs, gguf_values(blocks, type_name), None))
    for row in range(9):
        assert torch.equal(linear(inputs[row : row + 1])[0], output[row])


@pytest.mark.parametrize("threads", [1, 2])
def test_stacked_types_keep_every_value_and_every_row_alone(threads):
    """Fused projections of different types (a Q4_K_M file's Q4_K queries and Q6_K values) share one product."""
    types = ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_1")
    parts = [decode(random_blocks(name, 70, 256, seed=index), name) for index, name in enumerate(types)]
    stacked = QuantizedMatrix.stack(parts)
    values = torch.cat([part.dequantize() for part in parts])
    assert torch.equal(stacked.dequantize(), values) and stacked.types == types
    bias = torch.randn(350)
    linear = QuantizedLinear(stacked, bias, kernels)
    inputs = torch.randn(21, 256, generator=torch.Generator().manual_seed(3))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = linear(inputs)
        if exact:
            assert torch.equal(together, blocked(inputs, values, bias))
        for count in (1, 2, 3, 5, 20):
            assert torch.equal(linear(inputs[:count]), together[:count])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.slow
def test_the_shipped_files_own_blocks_run_bitwise_as_its_float_model(tmp_path):
    """SmolLM2-135M's file (Q4_1 layers, a Q8_0 head) as shipped: its quantised forward equals the float32 forward
    of the model transformers de-quantised from the file, prefill and verification rows; drafting keeps plain
    greedy's ids."""
    from tiny import prefill_and_chain_logits

    import draftwise
    from draftwise.backend.forward.lean import LeanTarget

    target, tokenizer = draftwise.load_model("smollm2-135m", weights="file", cache_dir=tmp_path)
    assert target.quantization == "q4_1+q8_0" and target.linear_path == "kernel-q4_1+q8_0"
    reference = LeanTarget(target.model)
    prompt, chain = list(range(3, 140)), [5, 9, 11, 2]
    outputs = [prefill_and_chain_logits(model, prompt, chain, 256) for model in (target, reference)]
    for ours, theirs in zip(*outputs):
        assert torch.equal(ours, theirs) if exact else torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    messages = [{"role": "user", "content": "Repeat this list twice: apple, pear, plum, fig, kiwi, lime."}]
    plain = draftwise.generate(target, tokenizer, messages, method="ar", max_new_tokens=40)
    drafted = draftwise.generate(target, tokenizer, messages, method="pld", max_new_tokens=40)
    assert drafted.token_ids == plain.token_ids


def test_file_weights_refuse_what_they_cannot_run(tmp_path):
    from tiny import make_tiny_model

    import draftwise
    from draftwise.errors import ModelLoadError
    from draftwise.models import make_target

    with pytest.raises(ModelLoadError, match="give the file"):
        make_target(make_tiny_model("llama", seed=0), weights="file", calibrate=False)
    folder = tmp_path / "checkpoint"
    make_tiny_model("llama", seed=0).save_pretrained(folder)
    with pytest.raises(ModelLoadError, match="checkpoint folder"):
        draftwise.load_model(str(folder), weights="file", calibrate=False)
