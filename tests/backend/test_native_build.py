"""Building the kernels once, safely (:mod:`draftwise.backend.native.build`), on a tiny extension that compiles in a
second: a build killed mid-way leaves nothing that stops the next one, a second process waits for the first one's
build and loads it, and two source folders with the same files share one build."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and "CXX" not in os.environ, reason="no C++ compiler")

#: A Python extension without torch's headers (they would take half a minute to compile), named as torch's builder
#: names it.
SOURCE = textwrap.dedent("""
    #include <Python.h>
    #define JOIN(a, b) a##b
    #define INIT(name) JOIN(PyInit_, name)
    #define TEXT(name) #name
    #define NAME(name) TEXT(name)
    static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
    static struct PyModuleDef definition = {PyModuleDef_HEAD_INIT, NAME(TORCH_EXTENSION_NAME), "", -1, methods};
    PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&definition); }
""")

#: Builds the tiny extension from argv[1] into the builds folder argv[2], printing its progress lines and answer.
BUILDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from draftwise.backend.native.build import ExtensionBuild, load_extension
    sources = Path(sys.argv[1])
    build = ExtensionBuild("tiny_extension", (sources / "tiny.cpp",), (sources / "tiny.h",), ("-O0",),
                           Path(sys.argv[2]), "the tiny extension")
    module = load_extension(build, announce=lambda line: print(line, flush=True))
    print("answer", module.answer(), build.key, flush=True)
""")


def _sources(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "tiny.cpp").write_text(SOURCE)
    (folder / "tiny.h").write_text("// a header the key covers\n")
    return folder


def _builder(sources: Path, builds: Path, compiler: Path | None = None) -> subprocess.Popen:
    environment = dict(os.environ)
    if compiler is not None:
        environment["CXX"] = str(compiler)
    return subprocess.Popen([sys.executable, "-c", BUILDER, str(sources), str(builds)], env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(process: subprocess.Popen, timeout: float = 240) -> list[str]:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output
    return output.splitlines()


def _slow_compiler(folder: Path, started: Path, seconds: int) -> Path:
    """A compiler that marks that it started, then waits ``seconds`` before each call (time to kill its build)."""
    real = shutil.which(os.environ.get("CXX", "c++"))
    script = folder / "slow-c++"
    script.write_text(f"#!/bin/sh\ntouch {started}\nsleep {seconds}\nexec {real} \"$@\"\n")
    script.chmod(0o755)
    return script


def _wait_for_the_compiler(builder: subprocess.Popen, started: Path) -> None:
    """Until ``builder``'s slow compiler has started (it then holds the build lock)."""
    deadline = time.monotonic() + 120
    while not started.exists():
        assert builder.poll() is None, builder.stdout.read()
        assert time.monotonic() < deadline, "the build never reached the compiler"
        time.sleep(0.1)


def test_a_build_killed_mid_way_leaves_nothing_that_blocks_the_next(tmp_path):
    sources, builds = _sources(tmp_path / "sources"), tmp_path / "builds"
    started = tmp_path / "compiler-started"
    killed = _builder(sources, builds, _slow_compiler(tmp_path, started, 60))
    _wait_for_the_compiler(killed, started)
    os.killpg(killed.pid, signal.SIGKILL)  # the build and its compiler, mid-way
    killed.wait()
    assert list(builds.glob("*/staging-*")), "the killed build should have left its staging folder"
    began = time.monotonic()
    lines = _finish(_builder(sources, builds))
    assert lines[-1].startswith("answer 42")
    assert any(line.startswith("compiling the tiny extension") for line in lines)
    assert any(line.startswith("the tiny extension compiled in") for line in lines)
    assert time.monotonic() - began < 120
    assert not list(builds.glob("*/staging-*")), "the stale staging folder is cleared"


def test_a_second_process_waits_for_the_build_and_loads_it(tmp_path):
    sources, builds = _sources(tmp_path / "sources"), tmp_path / "builds"
    started = tmp_path / "compiler-started"
    first = _builder(sources, builds, _slow_compiler(tmp_path, started, 3))
    _wait_for_the_compiler(first, started)
    second = _builder(sources, builds)
    second_lines = _finish(second)
    first_lines = _finish(first)
    assert first_lines[-1].startswith("answer 42") and second_lines[-1].startswith("answer 42")
    assert any(line.startswith("waiting for process") for line in second_lines)
    assert not any(line.startswith("compiling") for line in second_lines), "only one process compiles"


def test_two_source_folders_with_the_same_files_share_one_build(tmp_path):
    builds = tmp_path / "builds"
    first = _finish(_builder(_sources(tmp_path / "checkout-a"), builds))
    second = _finish(_builder(_sources(tmp_path / "checkout-b"), builds))
    assert first[-1] == second[-1]  # (the same answer and build key)
    assert any(line.startswith("compiling") for line in first)
    assert not any(line.startswith("compiling") for line in second), "the second folder's sources are the first's"
    assert len(list(builds.iterdir())) == 1
    library = next(builds.glob("*/tiny_extension_*.so"))
    built_at = library.stat().st_mtime_ns
    third = _finish(_builder(tmp_path / "checkout-a", builds))  # (and back again: nothing rebuilds)
    assert library.stat().st_mtime_ns == built_at and not any(line.startswith("compiling") for line in third)
    (tmp_path / "checkout-b" / "tiny.h").write_text("// another header: another build\n")
    fourth = _finish(_builder(tmp_path / "checkout-b", builds))
    assert any(line.startswith("compiling") for line in fourth) and len(list(builds.iterdir())) == 2
