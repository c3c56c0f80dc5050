"""Building a C++ extension once per machine and sharing the build, safely.

:func:`load_extension` compiles an extension's sources with torch's builder (:func:`torch.utils.cpp_extension.load`)
the first time they are needed and keeps the library in a folder named by :attr:`ExtensionBuild.key`, a digest of
what the build depends on: the sources' and headers' contents (not their paths), the compiler flags, torch's and
Python's versions, the machine and its CPU flags. Whatever folder the sources sit in (two checkouts, a moved virtual
environment), the same sources find the same finished library and load it without starting the compiler.

Three things make the first build safe to interrupt and to race:

- the build runs in a fresh staging folder of its own, on copies of the sources, and only a finished library is
  moved into place, with a marker written last; a half-built folder is never taken for a build;
- one process builds at a time, under an operating-system lock (:class:`filelock.FileLock`: ``flock`` on POSIX)
  that the system releases when its holder exits, however it exits; a process that finds the lock taken says so,
  waits, then loads what the holder built. So a build killed mid-way leaves nothing that blocks the next one: its
  staging folder is cleared by the next build (torch's own lock file lies inside it);
- the compile says what it does: a line when it starts (with a rough duration for the machine's cores), one each time
  a source finishes, and one when the library is ready.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import ModuleType

import torch
from filelock import FileLock, Timeout

from ..calibration.machine import cpu_flags

#: Compile seconds per source file on one core, roughly (the kernels' seven files took three and a half minutes on two
#: Zen 4 cores): only for the estimate printed when a build starts.
SECONDS_PER_SOURCE = 55.0
#: Seconds between the waiting process's reminders that another process is still building.
WAIT_REMINDER_SECONDS = 30.0
#: The file, in a build's folder, written once its library is in place.
MARKER = "build.json"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ExtensionBuild:
    """What to build and where builds are kept.

    Attributes:
        name: the extension's name (the library is ``{name}_{key}``, the name its module is compiled under).
        sources: the C++ files compiled into it.
        headers: files the sources include (copied beside them; part of the key).
        cflags: extra compiler flags.
        root: the folder that holds one folder per build key.
        title: what the messages call it ("draftwise's kernels").
    """

    name: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    cflags: tuple[str, ...]
    root: Path
    title: str = "the extension"

    @cached_property
    def key(self) -> str:
        """A digest of everything the built library depends on, and of nothing else (no path)."""
        digest = hashlib.sha256()
        parts = [*(path.name.encode() + b"\0" + path.read_bytes() for path in sorted(self.sources + self.headers)),
                 " ".join(self.cflags).encode(), torch.__version__.encode(), sys.implementation.cache_tag.encode(),
                 platform.machine().encode(), " ".join(sorted(cpu_flags())).encode()]
        for part in parts:
            digest.update(part)
            digest.update(b"\0")
        return digest.hexdigest()[:16]

    @property
    def module_name(self) -> str:
        return f"{self.name}_{self.key}"

    @property
    def folder(self) -> Path:
        return self.root / self.key

    @property
    def library(self) -> Path:
        suffix = ".pyd" if sys.platform == "win32" else ".so"
        return self.folder / f"{self.module_name}{suffix}"

    def is_built(self) -> bool:
        """Whether a finished library is in place (its marker is written after it)."""
        return (self.folder / MARKER).is_file() and self.library.is_file()


def load_extension(build: ExtensionBuild, announce: Callable[[str], None] = _stderr) -> ModuleType:
    """The extension's module: the finished library of ``build.key`` loaded as it is, or built first (see the
    module notes). ``announce`` receives the progress lines.

    Raises:
        Exception: whatever the compiler or torch's builder raised when the build failed (nothing is left in place).
    """
    if build.is_built():
        return _import_library(build)
    build.folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(build.folder / "build.lock"))
    owner = build.folder / "builder.pid"
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _wait_for_builder(lock, owner, build, announce)
    try:
        if build.is_built():  # (another process finished it while this one waited)
            return _import_library(build)
        owner.write_text(str(os.getpid()))
        return _build(build, announce)
    finally:
        lock.release()


def _wait_for_builder(lock: FileLock, owner: Path, build: ExtensionBuild, announce: Callable[[str], None]) -> None:
    """Wait, saying so, for the process that holds the build lock (the system frees it if that process dies)."""
    try:
        pid = owner.read_text().strip()
    except OSError:
        pid = "?"
    announce(f"waiting for process {pid}, which is compiling {build.title} for this machine ({build.folder})")
    started = time.monotonic()
    while True:
        try:
            lock.acquire(timeout=WAIT_REMINDER_SECONDS)
            return
        except Timeout:
            announce(f"still waiting for {build.title} to be compiled ({time.monotonic() - started:.0f} s)")


def _build(build: ExtensionBuild, announce: Callable[[str], None]) -> ModuleType:
    """Compile in a fresh staging folder and move the finished library into place (the caller holds the lock)."""
    from torch.utils.cpp_extension import load

    for stale in build.folder.glob("staging-*"):  # a build that was killed: no process works there any more
        shutil.rmtree(stale, ignore_errors=True)
    cores = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    estimate = SECONDS_PER_SOURCE * len(build.sources) / cores
    announce(f"compiling {build.title} for this machine, once ({len(build.sources)} sources, roughly "
             f"{_duration(estimate)} on {cores} core{'s' if cores > 1 else ''}); later runs load the build from "
             f"{build.folder}")
    staging = Path(tempfile.mkdtemp(prefix="staging-", dir=build.folder))
    started = time.monotonic()
    try:
        sources_folder, build_folder = staging / "src", staging / "build"
        sources_folder.mkdir()
        build_folder.mkdir()
        for path in build.sources + build.headers:
            shutil.copyfile(path, sources_folder / path.name)
        with _ObjectCounter(build_folder, len(build.sources), started, announce):
            module = load(name=build.module_name, sources=[str(sources_folder / path.name) for path in build.sources],
                          extra_cflags=list(build.cflags), build_directory=str(build_folder), verbose=False)
        os.replace(build_folder / build.library.name, build.library)
        marker = staging / MARKER
        marker.write_text(json.dumps({"key": build.key, "torch": torch.__version__, "python": sys.version.split()[0],
                                      "cflags": list(build.cflags), "seconds": round(time.monotonic() - started, 1)}))
        os.replace(marker, build.folder / MARKER)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    announce(f"{build.title} compiled in {_duration(time.monotonic() - started)}")
    return module


def _import_library(build: ExtensionBuild) -> ModuleType:
    spec = importlib.util.spec_from_file_location(build.module_name, build.library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{build.library} cannot be loaded as a Python extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} minutes"


class _ObjectCounter:
    """While a build runs, a line each time another source's object file appears in its folder."""

    def __init__(self, folder: Path, total: int, started: float, announce: Callable[[str], None]) -> None:
        self.folder, self.total, self.started, self.announce = folder, total, started, announce
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="extension-build-progress", daemon=True)

    def __enter__(self) -> _ObjectCounter:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.done.set()
        self.thread.join()

    def _watch(self) -> None:
        reported = 0
        while not self.done.wait(1.0):
            finished = sum(1 for _ in self.folder.glob("*.o"))
            if finished > reported:
                reported = finished
                self.announce(f"  {min(finished, self.total)} of {self.total} sources compiled "
                              f"({time.monotonic() - self.started:.0f} s)")

