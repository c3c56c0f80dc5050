"""A draft model loaded by name takes the kind of weights its target was loaded with (a GGUF file's blocks for a target
that runs them), or the kind it is given; ``draft:model=self`` drafts with the target's own model quantised on load.
The output stays plain greedy decoding's whatever the draft's weights."""

from __future__ import annotations

import pytest
import torch
from gguf_files import TINY_LLAMA, TINY_QWEN, write_random_gguf
from tiny import make_tiny_model

import draftwise
from draftwise.backend import native
from draftwise.drafters.draft_model import DraftModelDrafter
from draftwise.errors import UnsupportedModelError
from draftwise.models import make_target

# (a condition string: evaluated when a test that needs the kernels runs, so the others never build them)
needs_kernels = pytest.mark.skipif("native.load_kernels(warn=False) is None",
                                   reason="the kernels cannot be built here")

PROMPT = [5, 17, 99, 3, 250, 41, 8, 300, 5, 17, 99]


def _generate(target, method, tokens=24):
    return draftwise.generate(target, None, prompt_ids=PROMPT, method=method, max_new_tokens=tokens, ignore_eos=True)


@needs_kernels
def test_a_draft_by_name_of_a_quantised_target_runs_q4_0_or_the_weights_it_is_given(tmp_path):
    path = write_random_gguf(tmp_path / "model.gguf", TINY_QWEN, "Q4_K")
    target, _ = draftwise.load_model(str(path), weights="file", calibrate=False, cache_dir=tmp_path)
    assert target.source == str(path) and target.weights == "file"
    plain = _generate(target, "ar").token_ids
    drafter = DraftModelDrafter(model=str(path), depth=4, adaptive=False, cache_dir=str(tmp_path))
    assert _generate(target, drafter).token_ids == plain
    assert drafter.draft.weights == "q4_0" and drafter.draft.quantization == "q4_0"
    drafter = DraftModelDrafter(model=str(path), depth=4, adaptive=False, weights="file", cache_dir=str(tmp_path))
    assert _generate(target, drafter).token_ids == plain
    assert drafter.draft.weights == "file" and drafter.draft.quantization == target.quantization


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_self_drafts_with_the_targets_model_quantised(tmp_path, dtype):
    path = write_random_gguf(tmp_path / "model.gguf", TINY_LLAMA, "Q8_0")
    target, _ = draftwise.load_model(str(path), dtype=dtype, calibrate=False, cache_dir=tmp_path)
    assert target.weights is None  # a float target
    plain = _generate(target, "ar").token_ids
    drafter = DraftModelDrafter(model="self", depth=4, adaptive=False, cache_dir=str(tmp_path))
    assert _generate(target, drafter).token_ids == plain
    draft = drafter.draft
    assert draft.weights == "q4_0" and draft.quantization == "q4_0"
    down = target.model.model.layers[0].mlp.down_proj.weight
    if dtype == "float32":  # quantised from the target's own tensors, which stay
        assert draft.model is target.model and down.device.type == "cpu"
    else:  # loaded again in float32, quantised, its float copy freed
        assert draft.model is not target.model and down.device.type == "cpu"
        assert draft.model.model.layers[0].mlp.down_proj.weight.device.type == "meta"
    method = f"draft:model=self,weights=q8_0,depth=3,cache_dir={tmp_path}"
    assert _generate(target, method).token_ids == plain


def test_draft_weights_are_checked():
    with pytest.raises(ValueError, match="unknown draft weights"):
        DraftModelDrafter(model="smollm2-135m", weights="q5_k")
    with pytest.raises(ValueError, match="loaded by name"):
        DraftModelDrafter(model=make_tiny_model("llama"), weights="q4_0")


def test_self_needs_a_target_loaded_by_name():
    target = make_target(make_tiny_model("llama").to(torch.float32), calibrate=False)
    with pytest.raises(UnsupportedModelError, match="model=self"):
        draftwise.generate(target, None, prompt_ids=[1, 2, 3], method=DraftModelDrafter(model="self"), max_new_tokens=4)


def test_quantised_drafts_run_on_every_device(tmp_path, device):
    """A GGUF target on the device (on CUDA its blocks dequantised per step), drafted by the same file and by the
    target's model quantised on load: plain greedy decoding's ids."""
    path = write_random_gguf(tmp_path / "model.gguf", TINY_QWEN, "Q4_K")
    target, _ = draftwise.load_model(str(path), weights="file", device=device, calibrate=False, cache_dir=tmp_path)
    plain = _generate(target, "ar").token_ids
    by_file = DraftModelDrafter(model=str(path), depth=4, adaptive=False, weights="file", cache_dir=str(tmp_path))
    assert _generate(target, by_file).token_ids == plain
    assert by_file.draft.device.type == device and by_file.draft.quantization == target.quantization
    assert _generate(target, f"draft:model=self,weights=q8_0,depth=3,cache_dir={tmp_path}").token_ids == plain


@needs_kernels
def test_a_quantised_draft_head_scores_part_of_the_vocabulary_bitwise(tmp_path):
    """A draft running a GGUF file's blocks scores the lowest ids by whole tiles of its packed head and the context's
    tokens from their tiles: each logit bitwise the full head's, plain greedy decoding's ids."""
    path = write_random_gguf(tmp_path / "model.gguf", TINY_QWEN, "Q4_K")
    target, _ = draftwise.load_model(str(path), weights="file", calibrate=False, cache_dir=tmp_path)
    drafter = DraftModelDrafter(model=str(path), depth=4, adaptive=False, vocab=13, cache_dir=str(tmp_path))
    assert _generate(target, drafter).token_ids == _generate(target, "ar").token_ids
    head = drafter._shared["head"]
    assert head is not None and head.size == 16 and head.extra  # (13 rounded up to two tiles of 8)
    hidden = torch.randn(3, drafter.draft.config.hidden_size)
    assert torch.equal(head(hidden), drafter.draft.head(hidden)[:, head.ids])


def test_draft_activation_bits_are_checked():
    with pytest.raises(ValueError, match="activation bits"):
        DraftModelDrafter(model="smollm2-135m", activation_bits=4)
