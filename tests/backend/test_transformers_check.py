"""Exactness is checked on every backend: a model on the transformers backend has its verification rows compared
with one-row decoding at load, as the lean forward has, and drafts only where they are bitwise the same; unchecked
(a transformers model passed as it is) it drafts nothing. Either way the ids are plain decoding's and each
generation's statistics say why drafting was off."""

from __future__ import annotations

import random

import torch
from tiny import make_tiny_model, repetitive_prompt

import draftwise
from draftwise.backend.calibration.invariance import check_rows
from draftwise.backend.calibration.machine import MeasurementStore
from draftwise.backend.target import UNCHECKED_ROWS, TransformersTarget
from draftwise.models import make_target


class SkewedRows(TransformersTarget):
    """A backend whose rows of a forward of several rows differ from one-row decoding's in their last bits (as a
    library's many-row kernels may): its one-row steps are exact, its verification rows are not."""

    def _forward_one(self, cache, block, last_only, want_hidden):
        logits, hidden = super()._forward_one(cache, block, last_only, want_hidden)
        if len(block) > 1:
            logits = logits + torch.finfo(logits.dtype).eps * logits.abs()
        return logits, hidden


def _prompts(count: int = 4) -> list[list[int]]:
    return [repetitive_prompt(random.Random(seed), low=20, high=40) for seed in range(count)]


def test_a_backend_whose_rows_differ_ends_with_drafting_off_and_ar_ids(tmp_path, recwarn):
    target = SkewedRows(make_tiny_model("llama", seed=0))
    assert not check_rows(target, MeasurementStore(tmp_path))
    assert not target.exact_trees and "differ from one-row decoding" in target.drafting_off_reason
    assert any("not bitwise exact" in str(warning.message) for warning in recwarn)
    for prompt in _prompts():
        plain = draftwise.generate(target, None, prompt_ids=prompt, method="ar", max_new_tokens=24)
        drafted = draftwise.generate(target, None, prompt_ids=prompt, method="pld", max_new_tokens=24)
        assert drafted.token_ids == plain.token_ids
        assert drafted.stats.drafted_tokens == 0 and drafted.stats.steps == len(drafted.token_ids)
        assert drafted.stats.drafting_off == target.drafting_off_reason
        assert drafted.summary()["drafting_off"] == target.drafting_off_reason
    # The finding is kept per machine and model shape: a second target of the same shape recalls it.
    again = SkewedRows(make_tiny_model("llama", seed=1))
    store = MeasurementStore(tmp_path)
    assert not check_rows(again, store) and not again.exact_trees


def test_a_backend_whose_rows_agree_drafts(tmp_path):
    """The check's other outcome, on a target whose verification rows are plain decoding's (the lean forward run as
    the transformers backend would be checked)."""
    from tiny import planned

    target = planned(make_tiny_model("llama", seed=0), tmp_path / "plan")
    assert check_rows(target, MeasurementStore(tmp_path / "check"))
    assert target.exact_trees and target.drafting_off_reason is None
    result = draftwise.generate(target, None, prompt_ids=_prompts(1)[0], method="pld", max_new_tokens=24)
    assert result.stats.drafting_off is None


def test_an_unchecked_model_drafts_nothing(tiny_llama):
    prompt = _prompts(1)[0]
    result = draftwise.generate(tiny_llama, None, prompt_ids=prompt, method="pld", max_new_tokens=24)
    assert result.stats.drafted_tokens == 0 and result.stats.drafting_off == UNCHECKED_ROWS
    assert result.token_ids == draftwise.generate(tiny_llama, None, prompt_ids=prompt, method="ar",
                                                  max_new_tokens=24).token_ids


def test_loading_on_the_transformers_backend_checks_its_rows(tmp_path):
    model = make_tiny_model("qwen2", seed=0)
    target = make_target(model, backend="transformers", cache_dir=tmp_path)
    assert target.backend == "transformers"
    assert target.drafting_off_reason != UNCHECKED_ROWS, "the check ran"
    assert (target.drafting_off_reason is None) == target.exact_trees
    prompt = _prompts(1)[0]
    drafted = draftwise.generate(target, None, prompt_ids=prompt, method="pld", max_new_tokens=24)
    plain = draftwise.generate(target, None, prompt_ids=prompt, method="ar", max_new_tokens=24)
    assert drafted.token_ids == plain.token_ids
    if not target.exact_trees:
        assert drafted.stats.drafted_tokens == 0
