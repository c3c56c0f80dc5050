"""Predicted outputs: the expected text drafted beside every method's drafts, resynchronised after an edit, and the
output exactly plain decoding's whatever the prediction says (right, edited, or hostile), alone and in a batch."""

from __future__ import annotations

import random

import pytest
from tiny import drafter_for, repetitive_prompt

import draftwise

pytestmark = pytest.mark.usefixtures("transformers_rows_trusted")

METHODS = sorted(draftwise.METHODS)
PROMPT = [3, 17, 29, 41, 5, 8, 13]


def plain(model, prompt=PROMPT, tokens=48):
    return draftwise.generate(model, None, prompt_ids=prompt, method="ar", max_new_tokens=tokens).token_ids


@pytest.mark.parametrize("method", METHODS)
def test_any_prediction_leaves_the_output_plain_decodings(target, method):
    expected = plain(target)
    edited = expected[:15] + [7, 7, 9] + expected[20:]  # an edit in the middle: a deletion and an insertion
    hostile = [random.Random(0).randrange(90) for _ in range(80)]
    for prediction in (expected, edited, hostile, expected[::-1]):
        result = draftwise.generate(target, None, prompt_ids=PROMPT, method=drafter_for(method, target),
                                    max_new_tokens=48, prediction=prediction)
        assert result.token_ids == expected, (method, prediction[:5])
        stats = result.stats
        assert stats.accepted_prediction_tokens + stats.rejected_prediction_tokens == len(prediction)


def test_a_right_prediction_goes_in_long_steps_and_an_edited_one_resynchronises(target):
    expected = plain(target)
    right = draftwise.generate(target, None, prompt_ids=PROMPT, method="ar", max_new_tokens=48, prediction=expected)
    assert right.stats.accepted_prediction_tokens >= 40 and right.stats.mean_accepted_tokens > 4
    edited = expected[:15] + [7, 7, 9] + expected[20:]
    result = draftwise.generate(target, None, prompt_ids=PROMPT, method="ar", max_new_tokens=48, prediction=edited)
    assert result.stats.accepted_prediction_tokens >= 30  # the text after the edit was drafted again
    seeded = draftwise.generate(target, None, prompt_ids=PROMPT, method="pld", max_new_tokens=48, prediction=expected,
                                temperature=0.8, seed=3)
    assert seeded.token_ids == draftwise.generate(target, None, prompt_ids=PROMPT, method="ar", max_new_tokens=48,
                                                  temperature=0.8, seed=3).token_ids


def test_a_batch_takes_one_prediction_per_prompt(target):
    prompts = [repetitive_prompt(random.Random(seed), low=8, high=20) for seed in range(3)]
    expected = [plain(target, prompt, 24) for prompt in prompts]
    results = draftwise.generate(target, None, prompt_ids=prompts, method="pld", max_new_tokens=24,
                                 prediction=[expected[0], None, expected[2][::-1]])
    assert [result.token_ids for result in results] == expected
    # Each sequence accounts for its own prediction, whole, and the one without any for none (whether a step drafts
    # at this batch size is the throughput rule's measured choice, so how much is accepted is not asserted here).
    counts = [(result.stats.accepted_prediction_tokens, result.stats.rejected_prediction_tokens) for result in results]
    assert sum(counts[0]) == len(expected[0]) and counts[1] == (0, 0) and sum(counts[2]) == len(expected[2])


@pytest.mark.parametrize("prediction, message", [
    ([[1, 2]], "list of 2 predictions"),
    ("text", "tokenizer"),
    ([1.5, 2], "string or a list of token ids"),
    ([1, 10**9], r"\[0, "),
])
def test_bad_predictions_are_refused(tiny_qwen2, prediction, message):
    prompt_ids = [[1, 2, 3], [4, 5, 6]] if message.startswith("list of") else [1, 2, 3]
    with pytest.raises(draftwise.InvalidRequestError, match=message):
        draftwise.generate(tiny_qwen2, None, prompt_ids=prompt_ids, max_new_tokens=4, prediction=prediction)


def test_the_server_drafts_a_prediction_and_reports_its_use(tmp_path):
    """OpenAI's ``prediction`` field on both routes, streaming too: the answer is the plain one, and the usage says
    how many predicted tokens were accepted and rejected."""
    from servers import MODEL, RunningServer
    from tiny import ChatCharTokenizer, make_tiny_model

    from draftwise.backend.calibration.invariance import plan_rows
    from draftwise.backend.calibration.machine import MeasurementStore
    from draftwise.backend.forward.lean import LeanTarget
    from draftwise.serve import ServingEngine

    target = LeanTarget(make_tiny_model("qwen2", seed=0))
    plan_rows(target, MeasurementStore(tmp_path))
    running = RunningServer(ServingEngine(target, ChatCharTokenizer(), "ar"))
    try:
        prompt = "".join(chr(0x100 + token) for token in PROMPT)
        expected = draftwise.generate(target, ChatCharTokenizer(), prompt, method="ar", max_new_tokens=40).text
        client = running.client
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                           extra_body={"prediction": {"type": "content", "content": expected}})
        assert answer.choices[0].text == expected
        details = answer.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= 30
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == len(expected)
        wrong = expected[::-1]
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True},
            prediction={"type": "content", "content": [{"type": "text", "text": wrong}]}))
        chat_expected = draftwise.generate(target, ChatCharTokenizer(), [{"role": "user", "content": prompt}],
                                           method="ar", max_new_tokens=20).text
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == chat_expected
        assert chunks[-1].usage.completion_tokens_details.rejected_prediction_tokens > 0
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert plain.usage.completion_tokens_details is None
        import openai

        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                      extra_body={"prediction": {"type": "other", "content": "x"}})
    finally:
        running.stop()
