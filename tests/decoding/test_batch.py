"""Batched generation: every sequence gets exactly its batch-1 output, with ragged prompts, ends at different steps,
sequences joining mid-flight, every method, greedy and seeded sampling."""

from __future__ import annotations

import random

import pytest
from tiny import ChatCharTokenizer, drafter_for, repetitive_prompt

import draftwise
from draftwise.backend.target import Target, as_target
from draftwise.decoding.batch import Scheduler
from draftwise.decoding.drafter import NoDrafter
from draftwise.decoding.engine import Decoder, FinishReason
from draftwise.decoding.sampling import SamplingParams
from draftwise.errors import InvalidRequestError

METHODS = sorted(draftwise.METHODS)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [repetitive_prompt(rng, low=5, high=70) for _ in range(count)]


def with_eos(target, eos):
    model = target.model if isinstance(target, Target) else target
    model.generation_config.eos_token_id = eos


@pytest.mark.parametrize("method", METHODS)
def test_every_sequence_gets_its_batch_1_ids(target, method):
    batch = prompts(7, seed=METHODS.index(method))
    drafter = drafter_for(method, target)
    alone = [
        draftwise.generate(target, None, prompt_ids=prompt, method=drafter, max_new_tokens=30).token_ids
        for prompt in batch
    ]
    for max_batch in (1, 3, 16):
        results = draftwise.generate(target, None, prompt_ids=batch, method=drafter, max_new_tokens=30, max_batch=max_batch)
        assert [result.token_ids for result in results] == alone, max_batch


def test_sequences_end_at_different_steps(target):
    """An EOS token ends each sequence where it ends alone, mid-batch; the others go on."""
    batch = prompts(6, seed=11)
    first = draftwise.generate(target, None, prompt_ids=batch, method="ar", max_new_tokens=24)
    eos = first[0].token_ids[5]
    with_eos(target, eos)
    try:
        alone = [draftwise.generate(target, None, prompt_ids=prompt, method="pld", max_new_tokens=24) for prompt in batch]
        together = draftwise.generate(target, None, prompt_ids=batch, method="pld", max_new_tokens=24, max_batch=4)
    finally:
        with_eos(target, None)
    assert [result.token_ids for result in together] == [result.token_ids for result in alone]
    assert [result.finish_reason for result in together] == [result.finish_reason for result in alone]
    assert together[0].finish_reason == FinishReason.EOS and len({len(result.token_ids) for result in together}) > 1


def test_sequences_join_between_steps(target):
    """The continuous-batching core: a sequence submitted while others run joins at the next step and still gets
    its batch-1 tokens; finished sequences free their slot."""
    batch = prompts(5, seed=12)
    expected = [
        draftwise.generate(target, None, prompt_ids=prompt, method="pld", max_new_tokens=16 + 4 * index).token_ids
        for index, prompt in enumerate(batch)
    ]
    decoder = Decoder(target)
    scheduler = Scheduler(decoder, max_batch=3)
    states = [
        decoder.start(prompt, draftwise.make_drafter("pld"), max_new_tokens=16 + 4 * index)
        for index, prompt in enumerate(batch)
    ]
    scheduler.submit(states[:2])
    steps = 0
    while not scheduler.idle:
        if steps == 3:
            scheduler.submit(states[2:])  # join mid-flight
        scheduler.step()
        assert len(scheduler.running) <= 3
        steps += 1
    assert [state.output for state in states] == expected


@pytest.mark.parametrize("method", ["ar", "pld", "recycling"])
def test_long_prompts_are_prefilled_in_pieces_between_decoding_steps(target, method):
    """Chunked prefill: with a few prompt rows a step, long prompts are prefilled over several steps while the
    running sequences go on decoding, and several short ones share a step; every sequence gets its batch-1 tokens
    (greedy and seeded sampling). A target that cannot prefill in pieces prefills each admitted prompt whole."""
    rng = random.Random(METHODS.index(method))
    batch = [repetitive_prompt(rng, low=low, high=low + 3) for low in (3, 4, 60, 75, 5, 40)]
    for options in ({}, {"temperature": 0.8, "top_k": 30}):
        alone = [
            draftwise.generate(target, None, prompt_ids=prompt, method=method, max_new_tokens=12 + index, seed=index,
                               **options).token_ids
            for index, prompt in enumerate(batch)
        ]
        decoder = Decoder(target)
        scheduler = Scheduler(decoder, max_batch=4, max_prefill_rows=16)
        states = [
            decoder.start(prompt, draftwise.make_drafter(method), max_new_tokens=12 + index,
                          sampling=SamplingParams(seed=index, **options))
            for index, prompt in enumerate(batch)
        ]
        scheduler.submit(states[:3])
        mixed_steps = shared_steps = 0
        first_tokens = []
        while not scheduler.idle:
            if states[3].submitted is None and scheduler.running:
                scheduler.submit(states[3:])  # join mid-flight
            prefilled_before = [state for state in states if state.output]
            events = scheduler.step()
            started = [state for state in states if state.output and state not in prefilled_before]
            first_tokens += started
            mixed_steps += bool(scheduler.prefilling and scheduler.running)
            shared_steps += len(started) > 1
            assert all(state.prefilled == len(state.prompt_ids) for state, _ in events)
            assert len(scheduler.running) + len(scheduler.prefilling) <= 4
        assert [state.output for state in states] == alone, options
        assert first_tokens == sorted(first_tokens, key=states.index)  # first tokens in order of arrival
        if as_target(target).chunked_prefill:
            assert mixed_steps and shared_steps
        else:
            assert not mixed_steps


def test_cancelled_sequence_frees_its_slot(target):
    batch = prompts(3, seed=13)
    decoder = Decoder(target)
    scheduler = Scheduler(decoder, max_batch=2)
    states = [decoder.start(prompt, NoDrafter(), max_new_tokens=10) for prompt in batch]
    scheduler.submit(states)
    scheduler.step()
    assert scheduler.running == states[:2]
    scheduler.cancel(states[0])
    scheduler.step()
    assert states[2] in scheduler.running and states[0] not in scheduler.running
    with pytest.raises(InvalidRequestError):
        Scheduler(decoder, max_batch=0)


def test_seeded_sampling_is_the_same_alone_batched_and_plain(target):
    """Each token is drawn with a number tied to the seed and its position: a seeded request samples the same
    tokens alone or in a batch, and speculative sampling the same tokens as plain sampling."""
    batch = prompts(4, seed=14)
    options = dict(max_new_tokens=24, temperature=0.9, top_k=20)
    plain = [
        draftwise.generate(target, None, prompt_ids=prompt, method="ar", seed=100 + index, **options).token_ids
        for index, prompt in enumerate(batch)
    ]
    for method in ("ar", "pld", "recycling"):
        alone = [
            draftwise.generate(target, None, prompt_ids=prompt, method=method, seed=100 + index, **options).token_ids
            for index, prompt in enumerate(batch)
        ]
        assert alone == plain, method
    # A batch shares one sampling configuration: compare with requests of the same seed decoded alone.
    together = draftwise.generate(target, None, prompt_ids=batch, method="pld", seed=7, **options)
    assert [result.token_ids for result in together] == [
        draftwise.generate(target, None, prompt_ids=prompt, method="pld", seed=7, **options).token_ids for prompt in batch
    ]


def test_streaming_a_batch(tiny_llama):
    tokenizer = ChatCharTokenizer()
    texts = ["ĀāĂăĀāĂă", "ĆćĈĉĆćĈĉĆć", "ĊċČč"]
    expected = draftwise.generate(tiny_llama, tokenizer, texts, method="pld", max_new_tokens=12)
    stream = draftwise.stream(tiny_llama, tokenizer, texts, method="pld", max_new_tokens=12, max_batch=2)
    pieces = {index: "" for index in range(len(texts))}
    for index, piece in stream:
        pieces[index] += piece
    assert [pieces[index] for index in range(len(texts))] == [result.text for result in expected]
    assert [result.token_ids for result in stream.results] == [result.token_ids for result in expected]
    with pytest.raises(RuntimeError, match="results"):
        stream.result


def test_batch_inputs_are_checked(tiny_llama):
    with pytest.raises(InvalidRequestError, match="empty"):
        draftwise.generate(tiny_llama, None, prompt_ids=[[1, 2], []], max_new_tokens=4)
    with pytest.raises(InvalidRequestError, match="prompt must be"):
        draftwise.generate(tiny_llama, ChatCharTokenizer(), ["a", 3], max_new_tokens=4)
    with pytest.raises(InvalidRequestError, match="max_batch"):
        draftwise.generate(tiny_llama, None, prompt_ids=[[1, 2], [3]], max_new_tokens=4, max_batch=0)


def test_a_batch_on_a_target_with_lean_chains_verifies_chains(target, monkeypatch):
    """Where chains take the leaner path in a batch (the lean forward on a CPU), a batch's drafts are cut to their
    best path; elsewhere trees stay; the ids are the same either way."""
    batch = prompts(4, seed=21)
    alone = [draftwise.generate(target, None, prompt_ids=prompt, method="pld", max_new_tokens=24).token_ids
             for prompt in batch]
    model_target = as_target(target)
    shapes = []
    forward = type(model_target).forward

    def spy(self, caches, blocks, **options):
        if len(blocks) > 1:
            shapes.extend(block.parents == tuple(range(-1, len(block) - 1)) for block in blocks)
        return forward(self, caches, blocks, **options)

    monkeypatch.setattr(type(model_target), "forward", spy)
    together = draftwise.generate(model_target, None, prompt_ids=batch, method="pld:max_matches=4", max_new_tokens=24,
                                  max_batch=4)
    assert [result.token_ids for result in together] == alone
    assert shapes
    if model_target.batch_chains:
        assert all(shapes)
