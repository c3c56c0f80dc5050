"""``logit_bias``, ``presence_penalty`` and ``frequency_penalty`` (OpenAI's and vLLM's meanings): the arithmetic on
each row, from that row's own history (the penalties count the output alone), and every method giving plain
decoding's ids with them, greedy and seeded, alone and batched."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import FixedCosts, drafter_for, make_tiny_model, planned, repetitive_prompt

import draftwise
from draftwise.decoding.sampling import SamplingParams, penalized_logits
from draftwise.decoding.tree import DraftTree
from draftwise.errors import InvalidRequestError

METHODS = sorted(set(draftwise.METHODS) - {"ar"})
OPTIONS = dict(presence_penalty=0.3, frequency_penalty=0.1, repetition_penalty=1.05, logit_bias={7: 3.0, 11: -100})


def test_each_row_is_transformed_from_its_own_history():
    """Bias first, then the repetition penalty (prompt and output), then frequency and presence (output only)."""
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={1: 1.0})
    context = [3, 4, 1, 4]  # prompt [3, 4], output [1, 4]
    tree = DraftTree((4, 2), (-1, 0))  # row 1: output [1, 4, 4]; row 2: output [1, 4, 4, 2]
    logits = torch.full((3, 6), 2.0)
    out = penalized_logits(logits, params, context, tree, output_start=2)
    # Row 0: token 1 (biased to 3, seen: /2 = 1.5, once in the output: -0.5 - 0.25); token 3 (prompt only: /2);
    # token 4 (prompt and output once: /2, -0.5 - 0.25).
    assert out[0].tolist() == [2.0, 0.75, 2.0, 1.0, 0.25, 2.0]
    assert out[1, 4].item() == pytest.approx(1.0 - 2 * 0.5 - 0.25)  # twice in row 1's output
    assert out[2, 2].item() == pytest.approx(1.0 - 0.5 - 0.25) and out[1, 2].item() == 2.0
    assert torch.equal(logits, torch.full((3, 6), 2.0)), "the logits themselves are left as they were"
    assert penalized_logits(logits, SamplingParams(), context, tree) is logits


@pytest.mark.parametrize("bad", [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"logit_bias": {1: 101}},
                                 {"logit_bias": {-1: 1}}, {"logit_bias": {"x": 1}}])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return planned(make_tiny_model("qwen2", seed=4), tmp_path_factory.mktemp("machine"))


def _prompts(count: int = 6) -> list[list[int]]:
    rng = random.Random(9)
    return [repetitive_prompt(rng, low=10, high=40) for _ in range(count)]


def test_the_options_change_plain_decoding(target):
    prompt = _prompts(1)[0]
    plain = draftwise.generate(target, None, prompt_ids=prompt, method="ar", max_new_tokens=24).token_ids
    shaped = draftwise.generate(target, None, prompt_ids=prompt, method="ar", max_new_tokens=24, **OPTIONS).token_ids
    assert plain != shaped and 11 not in shaped


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_plain_decodings_ids(target, method):
    prompts = _prompts()
    expected = [draftwise.generate(target, None, prompt_ids=prompt, method="ar", max_new_tokens=24,
                                   **OPTIONS).token_ids for prompt in prompts]
    drafter = drafter_for(method, target)
    free_rows = FixedCosts(prior={1: 1.0, 64: 1.0})  # (drafting always pays: the test does not hang on timings)
    alone = [draftwise.generate(target, None, prompt_ids=prompt, method=drafter, max_new_tokens=24, **OPTIONS,
                                latency=free_rows) for prompt in prompts]
    assert [result.token_ids for result in alone] == expected
    assert sum(result.stats.accepted_tokens for result in alone) > 0, "drafts were accepted: the rows were verified"
    batched = draftwise.generate(target, None, prompt_ids=prompts, method=drafter, max_new_tokens=24,
                                 max_batch=4, latency=free_rows, **OPTIONS)
    assert [result.token_ids for result in batched] == expected


def test_seeded_sampling_gives_plain_samplings_tokens(target):
    for prompt in _prompts(4):
        options = dict(max_new_tokens=24, temperature=0.9, seed=5, **OPTIONS)
        plain = draftwise.generate(target, None, prompt_ids=prompt, method="ar", **options)
        assert draftwise.generate(target, None, prompt_ids=prompt, method="pld", **options).token_ids == \
            plain.token_ids


def test_a_bias_outside_the_vocabulary_is_refused(target):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        draftwise.generate(target, None, prompt_ids=[1, 2, 3], logit_bias={10**6: 1.0})
