"""Real-model tests on the default preset (SmolLM2-135M-Instruct). Slow, and run in CI too."""

from __future__ import annotations

import time

import pytest
import torch

import draftwise
from draftwise.data import load_spec_bench

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    torch.set_num_threads(2)
    return draftwise.load_model("smollm2-135m")


def _top2_gap(model, ids: list[int]) -> float:
    """Gap between the two largest logits after ``ids`` in a plain forward: tells a near-tie from a bug."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def test_preset_reloads_fast(smollm):
    started = time.perf_counter()
    model, tokenizer = draftwise.load_model("smollm2-135m")
    assert time.perf_counter() - started < 10
    assert tokenizer is not None and model.config.model_type == "llama"


def test_pld_matches_ar_on_spec_bench(smollm):
    model, tokenizer = smollm
    prompts = load_spec_bench(None, per_category=5)
    assert len(prompts) >= 30
    mismatches = []
    total_steps = {"ar": 0, "pld": 0}
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt.text}]
        reference = draftwise.generate(model, tokenizer, messages, method="ar", max_new_tokens=128)
        drafted = draftwise.generate(model, tokenizer, messages, method="pld", max_new_tokens=128)
        total_steps["ar"] += reference.stats.steps
        total_steps["pld"] += drafted.stats.steps
        if drafted.token_ids != reference.token_ids:
            position = next(
                (i for i, (a, b) in enumerate(zip(reference.token_ids, drafted.token_ids)) if a != b),
                min(len(reference.token_ids), len(drafted.token_ids)),
            )
            gap = _top2_gap(model, reference.prompt_ids + reference.token_ids[:position])
            mismatches.append(f"question {prompt.question_id}: first divergence at {position}, top-2 gap {gap:.2e}")
    assert not mismatches, "pld differs from ar:\n" + "\n".join(mismatches)
    assert total_steps["pld"] < total_steps["ar"], "prompt lookup saved no steps at all"


def test_stop_sequence_inside_accepted_draft(smollm):
    model, tokenizer = smollm
    # A prompt the model copies from, so that drafts get accepted across the stop sequence.
    text = "Repeat exactly: the quick brown fox jumps over the lazy dog near the river bank every single morning."
    messages = [{"role": "user", "content": text}]
    plain = draftwise.generate(model, tokenizer, messages, method="ar", max_new_tokens=40)
    assert "lazy" in plain.text
    for method in ("ar", "pld"):
        result = draftwise.generate(model, tokenizer, messages, method=method, max_new_tokens=40, stop=["lazy"])
        assert result.finish_reason == "stop"
        assert "lazy" not in result.text
        assert result.text == plain.text[: plain.text.index("lazy")]
        stopped = draftwise.generate(model, tokenizer, messages, method="ar", max_new_tokens=40, stop=["lazy"])
        assert result.token_ids == stopped.token_ids
        assert tokenizer.decode(result.token_ids).count("lazy") == 1


def test_streaming_pieces_join_to_the_text(smollm):
    model, tokenizer = smollm
    messages = [{"role": "user", "content": "List three colours, then list them again in the same order."}]
    stream = draftwise.stream(model, tokenizer, messages, method="pld", max_new_tokens=48)
    pieces = list(stream)
    assert len(pieces) > 1
    assert "".join(pieces) == stream.result.text
    assert stream.result.token_ids == draftwise.generate(model, tokenizer, messages, "ar", 48).token_ids


def test_string_prompt_and_chat_template(smollm):
    model, tokenizer = smollm
    as_chat = draftwise.generate(model, tokenizer, "Say hello.", method="ar", max_new_tokens=8, chat_template=True)
    as_messages = draftwise.generate(model, tokenizer, [{"role": "user", "content": "Say hello."}], "ar", 8)
    assert as_chat.prompt_ids == as_messages.prompt_ids
    raw = draftwise.generate(model, tokenizer, "Say hello.", method="ar", max_new_tokens=8)
    assert raw.prompt_ids == tokenizer("Say hello.")["input_ids"]


def test_ar_matches_transformers_generate(smollm):
    model, tokenizer = smollm
    from draftwise.api import eos_token_ids
    from draftwise.bench import run_hf

    messages = [{"role": "user", "content": "Explain what a binary search does in two sentences."}]
    result = draftwise.generate(model, tokenizer, messages, method="ar", max_new_tokens=48)
    hf_ids, _ = run_hf(model, result.prompt_ids, 48, eos_token_ids(model, tokenizer), lookup=False)
    assert hf_ids == result.token_ids
