"""The batched benchmark: every row at every batch size, exact match against batch size 1, the table and JSON."""

from __future__ import annotations

import json
import random

import pytest
from tiny import ChatCharTokenizer, repetitive_prompt

from draftwise.bench.batched import batch_table_rows, parse_batch_sizes, run_batched, write_batched_json
from draftwise.drafters import make_drafter
from draftwise.errors import InvalidRequestError


def counting_maker(made: list[str]):
    """``maker(method)``: a function making that method's drafter that notes each call in ``made``."""
    def maker(method):
        def make():
            made.append(method)
            return make_drafter(method)
        return make
    return maker


def test_parse_batch_sizes_adds_the_reference():
    assert parse_batch_sizes("8,4") == [1, 4, 8]
    assert parse_batch_sizes("1") == [1]
    for bad in ("", "0", "a,2", "-3"):
        with pytest.raises(InvalidRequestError, match="batch-size"):
            parse_batch_sizes(bad)


def test_run_batched_rows_exact_and_table(tiny_llama, tmp_path):
    rng = random.Random(5)
    prompt_ids = [repetitive_prompt(rng, low=6, high=40) for _ in range(6)]
    made: list[str] = []
    maker = counting_maker(made)
    drafters = {"ar": maker("ar"), "pld": maker("pld")}
    seen = []
    records = run_batched(tiny_llama, ChatCharTokenizer(), prompt_ids, drafters, [4], 20,
                          warm_up_ids=prompt_ids[0], on_record=seen.append)
    assert [(record.label, record.batch_size) for record in records] == [("ar", 1), ("ar", 4), ("pld", 1), ("pld", 4)]
    # Run by batch size, the rows of one size one after the other (close in time to the ar they are compared with).
    assert [(record.label, record.batch_size) for record in seen] == [("ar", 1), ("pld", 1), ("ar", 4), ("pld", 4)]
    assert made == ["ar", "pld", "ar", "pld"]  # every batch size starts from a fresh drafter
    for record in records:
        assert record.exact == record.prompts == 6 and record.exact_vs_ar == 6
        assert record.new_tokens == sum(len(ids) for ids in record.token_ids) == 6 * 20
        assert len(record.latency_s) == 6 and all(q >= t > 0 for q, t in zip(record.queued_latency_s, record.latency_s))
    batched_ar = records[1]
    assert batched_ar.steps == 6 * 20 and batched_ar.mean_accepted_tokens == pytest.approx(1.0)
    rows = batch_table_rows(records)
    assert rows[0]["vs_batch_1"] == 1.0 and rows[0]["vs_ar"] == 1.0 and rows[3]["exact_vs_batch_1"] == "6/6"
    path = tmp_path / "batched.json"
    write_batched_json(str(path), rows, records, {"cpu": "x"}, {"batch_sizes": [1, 4]})
    saved = json.loads(path.read_text())
    assert saved["summary"] == rows and saved["records"][1]["token_ids"] == batched_ar.token_ids


def test_run_batched_repeats_interleave_passes_and_report_the_median(tiny_llama):
    rng = random.Random(6)
    prompt_ids = [repetitive_prompt(rng, low=6, high=30) for _ in range(4)]
    made: list[str] = []
    maker = counting_maker(made)
    records = run_batched(tiny_llama, ChatCharTokenizer(), prompt_ids, {"ar": maker("ar"), "pld": maker("pld")}, [2],
                          12, repeats=3)
    # Each batch size runs all its rows, then all again (fresh drafters every pass).
    assert made == ["ar", "pld"] * 6
    for record in records:
        assert len(record.pass_tokens_per_s) == 3
        assert record.tokens_per_s == sorted(record.pass_tokens_per_s)[1]
        assert record.exact == record.exact_vs_ar == 4
        summary = record.summary()
        assert summary["passes"] == 3 and summary["tokens_per_s_range"][0] <= summary["tokens_per_s"]
    with pytest.raises(InvalidRequestError, match="repeats"):
        run_batched(tiny_llama, None, [[1, 2]], {"ar": maker("ar")}, [2], 4, repeats=0)


def test_run_batched_needs_ar_and_prompts(tiny_llama):
    with pytest.raises(InvalidRequestError, match="ar"):
        run_batched(tiny_llama, None, [[1, 2]], {"pld": lambda: make_drafter("pld")}, [2], 4)
    with pytest.raises(InvalidRequestError, match="prompts"):
        run_batched(tiny_llama, None, [], {"ar": lambda: make_drafter("ar")}, [2], 4)
