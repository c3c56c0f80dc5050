"""What only a CUDA device runs: the transformers backend on the GPU giving transformers' own greedy ids with
drafting methods, and speculative sampling through the graphed forward keeping the distribution.

The equivalence suite's device-parametrised tests (the ``device`` fixture: the lean forward against transformers,
bitwise verification rows in every dtype, every method alone and batched giving plain greedy decoding's ids) run
on CUDA too, beside their CPU cases. Everything here is skipped where no CUDA device is present (CI machines have
none); run ``pytest -m cuda`` on a GPU machine.
"""

from __future__ import annotations

import random

import pytest
import torch
from distributions import check_speculative_sampling
from equivalence import ar_token_ids, assert_same_ids_as_ar
from tiny import make_tiny_model, noisy_copy, planned, repetitive_prompt

from draftwise.drafters.draft_model import DraftModelDrafter

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def test_transformers_backend_matches_generate():
    model = make_tiny_model("llama", seed=0).to("cuda")
    prompt = repetitive_prompt(random.Random(2), low=30, high=40)
    with torch.inference_mode():
        expected = model.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=30, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), device="cuda"),
        )[0, len(prompt):].tolist()
    assert ar_token_ids(model, None, [prompt], max_new_tokens=30) == [expected]
    assert_same_ids_as_ar(model, None, [prompt], "pld", max_new_tokens=30, expected=[expected])
    assert_same_ids_as_ar(model, None, [prompt], "aded", max_new_tokens=30, expected=[expected], require_drafting=False)


@pytest.mark.parametrize("method", ["pld", "draft"])
def test_speculative_sampling_keeps_the_distribution(method, tmp_path):
    """The first three tokens' marginals equal plain sampling's; four tokens to generate let the first step draft
    two levels (point-mass drafts for pld, draft distributions for the draft model), and drafts are accepted, so
    tokens come out of the verification walk. (Layer skipping's case runs on every device in test_layer_skip.)
    pld's point-mass drafts copy the prompt's pattern, which a random model over 24 tokens follows too rarely (about
    20 accepted in 1200 draws, on the CPU as on an H200); over 6 tokens about 240 are."""
    vocab = {"pld": 6, "draft": 24}[method]
    model = make_tiny_model("llama", seed=3, vocab=vocab, scale=1.5, num_hidden_layers=4).to("cuda")
    target = planned(model, tmp_path)
    prompt = [token % vocab for token in [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]]
    drafter = {
        "pld": "pld",
        "draft": DraftModelDrafter(model=noisy_copy(model, noise=0.5, seed=4), width=3, depth=3, adaptive=False),
    }[method]
    accepted = check_speculative_sampling(target, model, prompt, drafter, {"temperature": 0.8, "top_p": 0.95},
                                          draws=1200)
    assert accepted > 100, f"{method}: only {accepted} draft tokens accepted in 1200 draws"
