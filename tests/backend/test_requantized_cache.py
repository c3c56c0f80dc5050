"""A model quantised on load (``weights="q4_0"``/``"q8_0"``) is quantised and packed once: later loads read the packed
products from the cache folder, hold no float copy of them, and compute the same bits. A GGUF file is quantised again
from its blocks, without a float checkpoint, to the bits a float checkpoint of it gets."""

from __future__ import annotations

import pytest
import torch
import transformers
from gguf_files import TINY_QWEN, write_random_gguf

import draftwise
from draftwise.backend import native
from draftwise.backend.rows import RowBlock

pytestmark = pytest.mark.skipif("native.load_kernels(warn=False) is None", reason="the kernels cannot be built here")

PROMPT = [5, 17, 99, 3, 250, 41, 8, 300]


def _logits(target) -> torch.Tensor:
    cache = target.new_cache(64)
    return target.forward([cache], [RowBlock.chain(PROMPT)]).logits[0]


@pytest.mark.parametrize("weights", ["q4_0", "q8_0"])
def test_a_second_load_reads_the_packed_products(tmp_path, monkeypatch, weights):
    path = write_random_gguf(tmp_path / "model.gguf", TINY_QWEN, "Q8_0")
    first, _ = draftwise.load_model(str(path), weights=weights, calibrate=False, cache_dir=tmp_path)
    assert first.weights == weights and first.quantization == weights
    assert list((tmp_path / "quantized-packed").glob("*/packed.safetensors"))

    def no_float_load(*args, **kwargs):
        raise AssertionError("the float checkpoint was read again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_float_load)
    second, _ = draftwise.load_model(str(path), weights=weights, calibrate=False, cache_dir=tmp_path)
    assert second.weights == weights and second.quantization == weights
    for target in (first, second):
        assert target.model.model.layers[0].mlp.down_proj.weight.device.type == "meta"
    with torch.inference_mode():
        assert torch.equal(_logits(first), _logits(second))
    plain = draftwise.generate(first, None, prompt_ids=PROMPT, method="ar", max_new_tokens=12, ignore_eos=True)
    again = draftwise.generate(second, None, prompt_ids=PROMPT, method="ar", max_new_tokens=12, ignore_eos=True)
    assert plain.token_ids == again.token_ids


def test_a_damaged_cache_file_is_quantised_again(tmp_path):
    path = write_random_gguf(tmp_path / "model.gguf", TINY_QWEN, "Q8_0")
    first, _ = draftwise.load_model(str(path), weights="q4_0", calibrate=False, cache_dir=tmp_path)
    (packed,) = (tmp_path / "quantized-packed").glob("*/packed.safetensors")
    packed.write_bytes(b"not a safetensors file")
    second, _ = draftwise.load_model(str(path), weights="q4_0", calibrate=False, cache_dir=tmp_path)
    with torch.inference_mode():
        assert torch.equal(_logits(first), _logits(second))
    assert packed.stat().st_size > 1000  # written again


def test_a_gguf_file_is_quantised_again_without_a_float_checkpoint(tmp_path):
    path = write_random_gguf(tmp_path / "model.gguf", TINY_QWEN, "Q4_K")
    from_file, _ = draftwise.load_model(str(path), weights="q4_0", calibrate=False, cache_dir=tmp_path)
    assert not list(tmp_path.glob("gguf-[0-9a-f]*"))  # (the float checkpoint a conversion would write)
    assert from_file.model.get_input_embeddings().weight.device.type == "meta"  # (looked up from the file's blocks)
    folder = draftwise.models.resolve_checkpoint(str(path), tmp_path)
    from_folder, _ = draftwise.load_model(str(folder), weights="q4_0", calibrate=False, cache_dir=tmp_path)
    with torch.inference_mode():
        assert torch.equal(_logits(from_file), _logits(from_folder))
