"""Spec-Bench question loading and the benchmark summary (hand-computed), plus a tiny end-to-end bench run."""

from __future__ import annotations

import json
import random

import pytest
from rich.console import Console

from draftwise import data
from draftwise.bench import OVERALL, Record, run_bench, run_hf, summarize, validate_methods, write_json
from draftwise.data import Prompt, load_spec_bench
from draftwise.errors import InvalidRequestError, UnknownMethodError
from draftwise.report import summary_tables

from tiny import ChatCharTokenizer, repetitive_prompt

# ----------------------------------------------------------------------------------------------------------------
# load_spec_bench

ROWS = [
    {"question_id": 1, "category": "writing", "turns": ["w1", "second turn"]},
    {"question_id": 2, "category": "writing", "turns": ["w2"]},
    {"question_id": 3, "category": "roleplay", "turns": ["r1"]},
    {"question_id": 4, "category": "translation", "turns": ["t1"]},
    {"question_id": 5, "category": "math", "turns": ["m1"]},
    {"question_id": 6, "category": "translation", "turns": ["t2"]},
    {"question_id": 7, "category": "writing", "turns": ["w3"]},
    {"question_id": 8, "category": "translation", "turns": ["t3"]},
    {"question_id": 9, "category": "qa", "turns": ["q1"]},
    {"category": "roleplay", "turns": ["r2"]},  # no question_id: the line number stands in
]


@pytest.fixture
def question_file(tmp_path):
    path = tmp_path / "question.jsonl"
    lines = [json.dumps(row) for row in ROWS]
    lines.insert(3, "")  # blank lines are skipped
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def ids(prompts):
    return [prompt.question_id for prompt in prompts]


def test_load_all(question_file):
    prompts = load_spec_bench(question_file)
    assert len(prompts) == len(ROWS)
    # Categories in order of first appearance; MT-Bench sub-categories form one task, taken round-robin.
    assert [prompt.category for prompt in prompts] == ["mt_bench"] * 6 + ["translation"] * 3 + ["qa"]
    assert ids(prompts[:6]) == [1, 3, 5, 2, 11, 7]
    assert ids(prompts[6:]) == [4, 6, 8, 9]
    first = prompts[0]
    assert first == Prompt(question_id=1, category="mt_bench", subcategory="writing", text="w1")
    assert prompts[-1] == Prompt(9, "qa", "qa", "q1")


def test_per_category(question_file):
    prompts = load_spec_bench(question_file, per_category=2)
    assert ids(prompts) == [1, 3, 4, 6, 9]
    assert {prompt.subcategory for prompt in prompts if prompt.category == "mt_bench"} == {"writing", "roleplay"}
    prompts = load_spec_bench(question_file, per_category=3)
    mt_bench = [prompt for prompt in prompts if prompt.category == "mt_bench"]
    assert [prompt.subcategory for prompt in mt_bench] == ["writing", "roleplay", "math"]
    assert ids(load_spec_bench(question_file, per_category=100)) == ids(load_spec_bench(question_file))


def test_missing_question_id_uses_line_number(question_file):
    prompts = load_spec_bench(question_file)
    roleplay = [prompt for prompt in prompts if prompt.subcategory == "roleplay"]
    assert [prompt.question_id for prompt in roleplay] == [3, 11]  # line 11 (a blank line was inserted)
    assert roleplay[1].text == "r2"


def test_missing_file(tmp_path):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        load_spec_bench(tmp_path / "nope.jsonl")


def test_no_default_file(monkeypatch):
    monkeypatch.setattr(data, "default_spec_bench_path", lambda: None)
    with pytest.raises(InvalidRequestError, match="--data"):
        load_spec_bench(None)


@pytest.mark.parametrize("line", ["{not json", json.dumps({"category": "qa"}), json.dumps(["a", "list"])])
def test_bad_rows(tmp_path, line):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(InvalidRequestError, match=":2:"):
        load_spec_bench(path)


def test_empty_turns_is_an_invalid_row(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": []}) + "\n", encoding="utf-8")
    with pytest.raises(InvalidRequestError):
        load_spec_bench(path)


def test_real_spec_bench_file_if_present():
    path = data.default_spec_bench_path()
    if path is None:
        pytest.skip("Spec-Bench's question.jsonl is not beside this checkout")
    prompts = load_spec_bench(path, per_category=5)
    categories = {}
    for prompt in prompts:
        categories.setdefault(prompt.category, []).append(prompt)
    assert all(len(group) == 5 for group in categories.values())
    assert "mt_bench" in categories
    assert len({prompt.subcategory for prompt in categories["mt_bench"]}) == 5


# ----------------------------------------------------------------------------------------------------------------
# summarize


def make_records():
    same_1, same_2 = [1, 2, 3], [4, 5, 6]
    return [
        Record("ar", 1, "A", 10, 1.0, 10, same_1),
        Record("ar", 2, "B", 20, 4.0, 20, same_2),
        Record("pld", 1, "A", 10, 0.5, 4, same_1),
        Record("pld", 2, "B", 20, 1.0, 8, [4, 5, 7]),  # differs from ar
        Record("hf", 1, "A", 10, 0.8, None, same_1),
        Record("hf", 2, "B", 20, 2.0, None, same_2),
    ]


def test_record_tokens_per_s():
    assert Record("ar", 1, "A", 10, 2.0, 10, []).tokens_per_s == 5.0
    assert Record("ar", 1, "A", 10, 0.0, 10, []).tokens_per_s == 0.0


def test_summarize_overall_hand_computed():
    summary = summarize(make_records(), ["ar", "pld", "hf"])
    assert list(summary) == ["A", "B", OVERALL]
    overall = summary[OVERALL]
    assert list(overall) == ["ar", "pld", "hf"]

    ar, pld, hf = overall["ar"], overall["pld"], overall["hf"]
    assert ar["prompts"] == 2 and ar["new_tokens"] == 30 and ar["time_s"] == pytest.approx(5.0)
    assert ar["tokens_per_s"] == pytest.approx(6.0)
    assert ar["mean_rate"] == pytest.approx((10 / 1 + 20 / 4) / 2)  # 7.5
    assert ar["mat"] == pytest.approx(1.0)
    assert ar["exact_match_vs_ar"] == 1.0
    assert ar["speedup_vs_ar"] == pytest.approx(1.0)

    assert pld["tokens_per_s"] == pytest.approx(30 / 1.5)  # 20
    assert pld["speedup_vs_ar"] == pytest.approx(20 / 6)
    assert pld["mean_rate"] == pytest.approx((10 / 0.5 + 20 / 1.0) / 2)  # 20
    assert pld["speedup_vs_ar_mean_rate"] == pytest.approx(20 / 7.5)
    assert pld["mat"] == pytest.approx(30 / 12)
    assert pld["exact_match_vs_ar"] == pytest.approx(0.5)

    assert hf["tokens_per_s"] == pytest.approx(30 / 2.8)
    assert hf["mat"] is None  # transformers rows have no step counts
    assert hf["exact_match_vs_ar"] == 1.0
    assert pld["speedup_vs_hf"] == pytest.approx(20 / (30 / 2.8))
    assert pld["speedup_vs_hf_mean_rate"] == pytest.approx(20 / ((10 / 0.8 + 20 / 2.0) / 2))
    assert ar["speedup_vs_hf"] == pytest.approx(6 / (30 / 2.8))


def test_summarize_per_category_hand_computed():
    summary = summarize(make_records(), ["ar", "pld", "hf"])
    a, b = summary["A"], summary["B"]
    assert a["ar"]["tokens_per_s"] == pytest.approx(10.0)
    assert a["pld"]["tokens_per_s"] == pytest.approx(20.0)
    assert a["pld"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert a["pld"]["mat"] == pytest.approx(2.5)
    assert a["pld"]["exact_match_vs_ar"] == 1.0
    assert b["pld"]["speedup_vs_ar"] == pytest.approx(20.0 / 5.0)
    assert b["pld"]["mat"] == pytest.approx(20 / 8)
    assert b["pld"]["exact_match_vs_ar"] == 0.0
    assert b["hf"]["speedup_vs_ar"] == pytest.approx(10.0 / 5.0)


def test_summarize_without_baselines():
    records = [record for record in make_records() if record.method == "pld"]
    summary = summarize(records, ["ar", "pld", "hf"])
    row = summary[OVERALL]["pld"]
    assert list(summary[OVERALL]) == ["pld"]
    assert row["speedup_vs_ar"] is None and row["speedup_vs_hf"] is None
    assert row["speedup_vs_ar_mean_rate"] is None
    assert row["exact_match_vs_ar"] == 0.0  # no reference to match


def test_validate_methods():
    assert validate_methods(["pld", "hf"]) == ["ar", "pld", "hf"]
    assert validate_methods(["pld", "ar", "pld"]) == ["ar", "pld"]
    assert validate_methods(["hf-pld", "pld:max_ngram=3"]) == ["ar", "hf-pld", "pld:max_ngram=3"]
    with pytest.raises(UnknownMethodError):
        validate_methods(["ar", "nope"])


def test_write_json_and_tables(tmp_path):
    records = make_records()
    summary = summarize(records, ["ar", "pld", "hf"])
    path = tmp_path / "out" / "results.json"
    write_json(path, summary, records, {"model": "tiny"}, {"max_new_tokens": 8})
    payload = json.loads(path.read_text())
    assert payload["environment"] == {"model": "tiny"}
    assert payload["methods"]["pld"]["mat"] == pytest.approx(2.5)
    assert set(payload["categories"]) == {"A", "B"}
    assert len(payload["records"]) == len(records)
    assert payload["records"][3]["token_ids"] == [4, 5, 7]
    assert payload["records"][0]["tokens_per_s"] == pytest.approx(10.0)

    tables = summary_tables(summary)
    assert len(tables) == 3
    console = Console(record=True, width=200)
    for table in tables:
        console.print(table)
    text = console.export_text()
    assert "overall" in text and "3.33x" in text and "50%" in text


# ----------------------------------------------------------------------------------------------------------------
# a tiny end-to-end run


def test_run_bench_end_to_end(tiny_llama, monkeypatch):
    monkeypatch.setattr(tiny_llama.generation_config, "eos_token_id", 95)
    rng = random.Random(3)
    texts = ["".join(chr(0x100 + token) for token in repetitive_prompt(rng, low=12, high=30)) for _ in range(3)]
    prompts = [Prompt(index, category, category, text) for index, (category, text) in
               enumerate(zip(["x", "y", "x"], texts))]
    methods = validate_methods(["pld", "hf", "hf-pld"])
    seen = []
    records = run_bench(tiny_llama, ChatCharTokenizer(), prompts, methods, 12,
                        on_progress=lambda method, prompt, rate: seen.append((method, prompt.question_id)))
    assert len(records) == len(prompts) * len(methods)
    assert seen == [(method, prompt.question_id) for prompt in prompts for method in methods]
    summary = summarize(records, methods)
    for method in methods:
        assert summary[OVERALL][method]["exact_match_vs_ar"] == 1.0, method
    assert summary[OVERALL]["ar"]["mat"] == pytest.approx(1.0)
    assert summary[OVERALL]["hf"]["mat"] is None


def test_run_hf_without_eos(tiny_llama):
    ids, seconds = run_hf(tiny_llama, [1, 2, 3, 4], 5, [], lookup=False)
    assert len(ids) == 5 and seconds > 0
