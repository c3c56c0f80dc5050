"""``draftwise bench --interleave``: two configurations compared round by round in one process (parsing, the rounds'
arithmetic, a tiny end-to-end run, the command)."""

from __future__ import annotations

import json
import random

import pytest
from rich.console import Console
from tiny import ChatCharTokenizer, repetitive_prompt

from draftwise import cli
from draftwise.bench import InterleaveResult, InterleaveRound, Record, Row, parse_interleave, run_interleaved
from draftwise.bench.prompts import Prompt
from draftwise.bench.report import interleave_line, interleave_table
from draftwise.decoding.sampling import SamplingParams
from draftwise.errors import InvalidRequestError, UnknownMethodError

# ----------------------------------------------------------------------------------------------------------------
# parsing


@pytest.mark.parametrize("text, expected", [
    ("ar;aded", (Row("ar"), Row("aded"))),
    ("ar,pld", (Row("ar"), Row("pld"))),
    ("pld@8;pld@16", (Row("pld", 8), Row("pld", 16))),
    ("pld:max_ngram=4,draft_length=6;pld:max_ngram=3@4",
     (Row("pld:max_ngram=4,draft_length=6"), Row("pld:max_ngram=3", 4))),
    ("aded;aded", (Row("aded"), Row("aded"))),
    ("ar;hf", (Row("ar"), Row("hf"))),
])
def test_parse_interleave(text, expected):
    assert parse_interleave(text) == expected


@pytest.mark.parametrize("text, error, message", [
    ("ar", InvalidRequestError, "two configurations"),
    ("ar;pld;aded", InvalidRequestError, "got 3"),
    ("hf@4;ar", InvalidRequestError, "no draft budget"),
    ("nope;ar", UnknownMethodError, "nope"),
    ("@4;ar", InvalidRequestError, "method spec"),
])
def test_parse_interleave_errors(text, error, message):
    with pytest.raises(error, match=message):
        parse_interleave(text)


# ----------------------------------------------------------------------------------------------------------------
# the rounds' arithmetic, by hand


def run_records(method, seconds, ids=(1, 2, 3, 4)):
    """Two prompts of 10 tokens each, ``seconds`` each."""
    return [Record(method, question, "x", 10, seconds, 10, list(ids)) for question in (1, 2)]


def hand_result():
    """A at 10 tok/s every round; B at 15, 20, 30 and 12.5 tok/s: ratios 1.5, 2, 3, 1.25."""
    rounds = []
    for number, b_seconds in enumerate([2 / 3, 0.5, 1 / 3, 0.8], 1):
        records = {"A": run_records("ar", 1.0), "B": run_records("pld", b_seconds)}
        rounds.append(InterleaveRound(number, "A" if number % 2 else "B", records, identical_ids=2))
    rounds[3].identical_ids = 1
    return InterleaveResult(Row("ar"), Row("pld"), rounds, greedy=True)


def test_summary_hand_computed():
    result = hand_result()
    assert result.ratios == pytest.approx([1.5, 2.0, 3.0, 1.25])
    summary = result.summary()
    assert summary["a"] == "ar" and summary["b"] == "pld"
    assert summary["rounds"] == 4 and summary["prompts"] == 2
    assert summary["a_tokens_per_s"] == pytest.approx(10.0)
    assert summary["b_tokens_per_s"] == pytest.approx((15 + 20) / 2)
    assert summary["ratio"] == pytest.approx((1.5 + 2.0) / 2)
    assert (summary["ratio_min"], summary["ratio_max"]) == pytest.approx((1.25, 3.0))
    assert summary["ratio_q1"] == pytest.approx(1.4375)  # inclusive quartiles of 1.25, 1.5, 2, 3
    assert summary["ratio_q3"] == pytest.approx(2.25)
    assert (summary["identical_ids"], summary["compared_runs"]) == (7, 8)
    assert result.rounds[1].summary() == {"round": 2, "first": "B", "a_tokens_per_s": 10.0, "b_tokens_per_s": 20.0,
                                          "ratio": 2.0, "identical_ids": 2, "prompts": 2}


def test_table_and_line():
    result = hand_result()
    summary = result.summary()
    console = Console(record=True, width=200)
    console.print(interleave_table([round_.summary() for round_ in result.rounds], summary, 16))
    text = console.export_text()
    assert "A = ar, B = pld: 4 rounds over 2 prompts, 16 new tokens each" in text
    assert "3.000x" in text and "1.750x" in text and "7/8" in text and "median" in text
    line = interleave_line(summary)
    assert line.startswith("B/A (pld over ar): median 1.750x over 4 rounds, interquartile 1.438-2.250x")
    assert "min-max 1.250-3.000x" in line and "identical ids in 7 of 8 runs" in line
    sampled = InterleaveResult(result.a, result.b, result.rounds, greedy=False).summary()
    assert sampled["identical_ids"] is None and "identical" not in interleave_line(sampled)


# ----------------------------------------------------------------------------------------------------------------
# a tiny end-to-end run


def tiny_prompts(count=3):
    rng = random.Random(5)
    texts = ["".join(chr(0x100 + token) for token in repetitive_prompt(rng, low=12, high=30)) for _ in range(count)]
    return [Prompt(index, "x", "x", text) for index, text in enumerate(texts)]


def test_run_interleaved_rounds_ratio_spread_and_identical_ids(tiny_llama):
    prompts = tiny_prompts()
    progress, finished = [], []
    result = run_interleaved(tiny_llama, ChatCharTokenizer(), prompts, parse_interleave("ar;pld"), 3, 8,
                             on_progress=lambda side, prompt, rate: progress.append((side, prompt.question_id)),
                             on_round=finished.append)
    assert len(result.rounds) == 3 and finished == result.rounds
    assert [round_.first for round_ in result.rounds] == ["A", "B", "A"]
    # Every prompt under both sides, one right after the other, the round's first side first.
    assert progress[:6] == [(side, question) for question in range(3) for side in "AB"]
    assert progress[6:12] == [(side, question) for question in range(3) for side in "BA"]
    for index, round_ in enumerate(result.rounds):
        assert [record.question_id for record in round_.records["A"]] == [0, 1, 2]
        assert {record.method for record in round_.records["B"]} == {"pld"}
        assert {record.repeat for record in round_.records["A"] + round_.records["B"]} == {index}
        assert round_.identical_ids == 3  # pld is lossless: ar's very ids
        assert round_.ratio > 0
    summary = result.summary()
    assert summary["rounds"] == 3 and summary["prompts"] == 3
    spread = [summary[key] for key in ("ratio_min", "ratio_q1", "ratio", "ratio_q3", "ratio_max")]
    assert spread == sorted(spread) and spread[0] > 0
    assert summary["a_tokens_per_s"] > 0 and summary["b_tokens_per_s"] > 0
    assert (summary["identical_ids"], summary["compared_runs"]) == (9, 9)


def test_run_interleaved_sampling_and_errors(tiny_llama):
    prompts = tiny_prompts(1)
    sampled = run_interleaved(tiny_llama, ChatCharTokenizer(), prompts, (Row("ar"), Row("pld", 4)), 1, 6,
                              SamplingParams(temperature=1.0, seed=3), warmup=False)
    assert sampled.rounds[0].identical_ids is None and sampled.summary()["identical_ids"] is None
    with pytest.raises(InvalidRequestError, match="--rounds"):
        run_interleaved(tiny_llama, ChatCharTokenizer(), prompts, (Row("ar"), Row("pld")), 0, 6)
    with pytest.raises(InvalidRequestError, match="no prompts"):
        run_interleaved(tiny_llama, ChatCharTokenizer(), [], (Row("ar"), Row("pld")), 1, 6)
    with pytest.raises(InvalidRequestError, match="draft model"):
        run_interleaved(tiny_llama, ChatCharTokenizer(), prompts, (Row("ar"), Row("hf-assisted")), 1, 6)


# ----------------------------------------------------------------------------------------------------------------
# the command


@pytest.fixture
def tiny_cli(tiny_llama, monkeypatch):
    monkeypatch.setattr(cli.common, "load", lambda args, options=None: (tiny_llama, ChatCharTokenizer()))


@pytest.fixture
def data(tmp_path):
    rows = [{"id": "a", "category": "copy", "prompt": "ĀāĂăĄąĀāĂăĄą"},
            {"id": "b", "category": "writing", "prompt": "ĆćĈĉĆćĈĉ"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    return path


def test_interleave_command(tiny_cli, data, tmp_path, capsys):
    out = tmp_path / "ab.json"
    arguments = ["bench", "--model", "tiny", "--data", str(data), "--max-new-tokens", "6",
                 "--interleave", "ar;pld:max_ngram=3,min_ngram=1", "--rounds", "2", "--json", str(out)]
    assert cli.main(arguments) == 0
    captured = capsys.readouterr()
    assert "A = ar, B = pld:max_ngram=3,min_ngram=1: 2 rounds over 2 prompts, 6 new tokens each" in captured.out
    assert "B/A (pld:max_ngram=3,min_ngram=1 over ar): median" in captured.out
    assert "identical ids in 4 of 4 runs" in captured.out
    assert "round 1 (A first)" in captured.err and "round 2 (B first)" in captured.err
    saved = json.loads(out.read_text())
    assert saved["settings"]["interleave"] == ["ar", "pld:max_ngram=3,min_ngram=1"] and saved["settings"]["rounds"] == 2
    assert saved["interleave"]["rounds"] == 2 and saved["interleave"]["identical_ids"] == 4
    assert [line["first"] for line in saved["rounds"]] == ["A", "B"]
    assert len(saved["records"]) == 2 * 2 * 2  # rounds x sides x prompts
    assert {(record["side"], record["round"]) for record in saved["records"]} == {
        (side, number) for side in "AB" for number in (1, 2)}


@pytest.mark.parametrize("arguments, message", [
    (["--interleave", "ar;pld", "--methods", "ar,aded"], "drop --methods"),
    (["--interleave", "ar;pld", "--sweep", "budget=2", "--out", "x.jsonl"], "drop --sweep, --out"),
    (["--interleave", "ar;pld", "--rounds", "0"], "--rounds"),
    (["--interleave", "ar"], "two configurations"),
    (["--rounds", "3"], "--rounds goes with --interleave"),
])
def test_interleave_command_errors(tiny_cli, data, capsys, arguments, message):
    assert cli.main(["bench", "--data", str(data), "--max-new-tokens", "4", *arguments]) == 2
    assert message in capsys.readouterr().err
