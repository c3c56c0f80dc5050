"""The repository alone is the product: a copy of the repository's files in an empty folder (nothing beside it, as a
user's clone) runs the benchmark's prompt loading and, with the real default model, one plain generation through the
benchmark command. The package is imported from the copy itself, so anything it reads from outside its own tree
fails here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent


def _repository_files() -> list[str]:
    """The repository's files as a clone of it has them: tracked ones, and new ones not ignored."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPOSITORY,
                            capture_output=True, check=True).stdout.decode()
    return [name for name in listed.split("\0") if name and (REPOSITORY / name).is_file()]


@pytest.fixture(scope="module")
def bare_clone(tmp_path_factory) -> Path:
    """The repository's files in a folder of their own, in an empty parent folder."""
    if shutil.which("git") is None or not (REPOSITORY / ".git").exists():
        pytest.skip("the repository's file list comes from git")
    clone = tmp_path_factory.mktemp("empty") / "draftwise"
    for name in _repository_files():
        destination = clone / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPOSITORY / name, destination)
    assert sorted(path.name for path in clone.parent.iterdir()) == ["draftwise"]
    return clone


def _run_in(clone: Path, code: str) -> subprocess.CompletedProcess:
    """``code`` run by this Python with the copy's package first on the path, from the copy's folder."""
    environment = {**os.environ, "PYTHONPATH": str(clone / "src")}
    return subprocess.run([sys.executable, "-c", code], cwd=clone, env=environment, capture_output=True, text=True,
                          timeout=600)


def test_the_bench_prompts_load_from_the_copy_alone(bare_clone):
    code = """
import json, draftwise
from draftwise.bench.prompts import load_dataset, spec_bench_path
prompts = load_dataset("spec_bench", per_category=2)
print(json.dumps({"package": draftwise.__file__, "file": str(spec_bench_path()), "prompts": len(prompts),
                  "categories": sorted({prompt.category for prompt in prompts})}))
"""
    finished = _run_in(bare_clone, code)
    assert finished.returncode == 0, finished.stderr
    found = json.loads(finished.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(bare_clone)
    assert Path(found["file"]).is_relative_to(bare_clone / "src")
    assert found["prompts"] == 12 and len(found["categories"]) == 6


@pytest.mark.slow
def test_the_bench_runs_ar_from_the_copy_alone(bare_clone, tmp_path):
    results = tmp_path / "bench.json"
    code = f"""
import sys
from draftwise.cli import main
sys.exit(main(["bench", "--methods", "ar", "--prompts", "1", "--per-category", "1", "--max-new-tokens", "4",
               "--json", {str(results)!r}]))
"""
    finished = _run_in(bare_clone, code)
    assert finished.returncode == 0, finished.stderr
    written = json.loads(results.read_text())
    assert [record["method"] for record in written["records"]] == ["ar"]
    assert written["records"][0]["new_tokens"] == 4
