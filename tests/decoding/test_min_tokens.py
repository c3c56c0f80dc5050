"""``min_new_tokens`` (vLLM's ``min_tokens``): a sequence emits at least that many tokens before an end-of-sequence
token, a stop token or a stop sequence may end it. Its end tokens are impossible at every row that decides one of
those first tokens, in plain decoding and in every verification row alike, so every method still gives plain
decoding's ids (greedy, seeded sampling, alone and in a batch)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import CharTokenizer, FixedCosts, drafter_for, make_tiny_model, planned, repetitive_prompt

import draftwise
from draftwise.decoding.engine import FinishReason
from draftwise.decoding.sampling import BarredEnds
from draftwise.decoding.tree import DraftTree
from draftwise.errors import InvalidRequestError

METHODS = sorted(set(draftwise.METHODS) - {"ar"})
MIN = 12


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A lean target whose greedy answers hit an end token early: the token its first prompt's answer starts with."""
    target = planned(make_tiny_model("llama", seed=3), tmp_path_factory.mktemp("machine"))
    answers = [draftwise.generate(target, None, prompt_ids=prompt, method="ar", max_new_tokens=30).token_ids
               for prompt in _prompts()]
    counts: dict[int, int] = {}
    for answer in answers:
        for token in set(answer[1:MIN]):
            counts[token] = counts.get(token, 0) + 1
    target.model.generation_config.eos_token_id = max(counts, key=counts.get)  # (ends most answers early)
    yield target
    target.model.generation_config.eos_token_id = None


def _prompts(count: int = 6, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [repetitive_prompt(rng, low=10, high=40) for _ in range(count)]


def _ar(target, prompt, **options):
    return draftwise.generate(target, None, prompt_ids=prompt, method="ar", max_new_tokens=30, **options)


def test_an_end_token_cannot_come_before_the_minimum(target):
    eos = target.model.generation_config.eos_token_id
    early = [_ar(target, prompt) for prompt in _prompts()]
    assert any(result.finish_reason == FinishReason.EOS and len(result.token_ids) < MIN for result in early)
    for result in (_ar(target, prompt, min_new_tokens=MIN) for prompt in _prompts()):
        assert len(result.token_ids) >= MIN
        assert eos not in result.token_ids[:MIN]
        if result.finish_reason == FinishReason.EOS:
            assert result.token_ids[-1] == eos and result.token_ids.count(eos) == 1


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_plain_decodings_ids_alone_and_batched(target, method):
    prompts = _prompts()
    expected = [_ar(target, prompt, min_new_tokens=MIN).token_ids for prompt in prompts]
    drafter = drafter_for(method, target)
    free_rows = FixedCosts(prior={1: 1.0, 64: 1.0})  # (drafting always pays: the test does not hang on timings)
    alone = [draftwise.generate(target, None, prompt_ids=prompt, method=drafter, max_new_tokens=30,
                                min_new_tokens=MIN, latency=free_rows) for prompt in prompts]
    assert [result.token_ids for result in alone] == expected
    assert sum(result.stats.accepted_tokens for result in alone) > 0, "drafts were accepted: the rows were verified"
    batched = draftwise.generate(target, None, prompt_ids=prompts, method=drafter, max_new_tokens=30,
                                 min_new_tokens=MIN, max_batch=4, latency=free_rows)
    assert [result.token_ids for result in batched] == expected


def test_seeded_sampling_gives_plain_samplings_tokens(target):
    options = dict(max_new_tokens=30, min_new_tokens=MIN, temperature=0.8, seed=11)
    for prompt in _prompts(4):
        plain = draftwise.generate(target, None, prompt_ids=prompt, method="ar", **options)
        drafted = draftwise.generate(target, None, prompt_ids=prompt, method="pld", **options)
        assert drafted.token_ids == plain.token_ids and len(plain.token_ids) >= MIN


def test_a_stop_sequence_is_not_looked_for_before_the_minimum(tiny_llama):
    tokenizer = CharTokenizer()
    prompt = "\u0105\u0106\u0107\u0105\u0106"
    answer = draftwise.generate(tiny_llama, tokenizer, prompt, method="ar", max_new_tokens=20)
    stop = answer.text[1:3]  # (ends plain decoding after its third character)
    cut = draftwise.generate(tiny_llama, tokenizer, prompt, method="ar", max_new_tokens=20, stop=[stop])
    assert cut.finish_reason == FinishReason.STOP and len(cut.token_ids) == 3
    options = dict(method="ar", max_new_tokens=20, stop=[stop], min_new_tokens=6)
    held = draftwise.generate(tiny_llama, tokenizer, prompt, **options)
    assert len(held.token_ids) >= 6 and held.token_ids[:3] == cut.token_ids
    assert held.text.startswith(answer.text[:3]), "the early stop sequence stays in the text, as generated"
    assert "".join(draftwise.stream(tiny_llama, tokenizer, prompt, **options)) == held.text


def test_barred_rows_are_those_that_decide_the_first_tokens():
    tree = DraftTree((1, 2, 3, 4), (-1, 0, 1, -1))  # depths 1, 2, 3, 1
    logits = torch.zeros(5, 8)
    barred = BarredEnds((2, 5), depth=2).apply(logits, tree)
    rows = [row for row in range(5) if torch.isinf(barred[row]).any()]
    assert rows == [0, 1, 4]  # the root (depth 0) and the depth-1 nodes decide output tokens 1 and 2
    assert torch.isinf(barred[0, [2, 5]]).all() and torch.isfinite(barred[0, [0, 1, 3, 4, 6, 7]]).all()
    assert BarredEnds((2,), depth=0).apply(logits, tree) is logits
    assert torch.equal(logits, torch.zeros(5, 8)), "the logits themselves are left as they were"


@pytest.mark.parametrize("value", [-1, 31, 2.5, True, "3"])
def test_a_bad_minimum_is_refused(tiny_llama, value):
    with pytest.raises(InvalidRequestError, match="min_new_tokens"):
        draftwise.generate(tiny_llama, None, prompt_ids=[1, 2, 3], max_new_tokens=30, min_new_tokens=value)
