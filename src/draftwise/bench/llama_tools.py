"""llama.cpp's own speculative decoding as benchmark rows, through its command-line tool.

llama-cpp-python runs plain decoding and a prompt-lookup draft (the ``llama.cpp`` and ``llama.cpp-pld`` rows of
:mod:`~draftwise.bench.anchors`), not llama.cpp's draft-model and n-gram speculation: those live in its tool
``llama-speculative-simple``. :func:`build_tools` builds that tool once per machine from the llama-cpp-python source
distribution of the installed version (the one the ``[anchors]`` extra installs), with the machine's own instruction
set (``GGML_NATIVE``), into the cache folder::

    python -m draftwise.bench.build_llama_tools      # build (a few minutes on two cores), or say where it is

Rows (greedy only, as llama.cpp's speculation verifies greedily):

- ``llama.cpp-draft:model=qwen2.5-coder-0.5b`` - draft-model speculation with the draft preset's (or ``.gguf``
  file's) own file, at llama.cpp's defaults unless ``n_max=`` (``--spec-draft-n-max``) or ``p_min=``
  (``--spec-draft-p-min``) say otherwise;
- ``llama.cpp-ngram`` - n-gram speculation, ``type=`` one of :data:`NGRAM_TYPES` (default
  :data:`DEFAULT_NGRAM_TYPE`), optional ``n_max=``.

Each run starts the tool on the prompt and times what its own clocks time: the prompt's processing and the decoding
(loading the model left out), as the ``llama.cpp`` row times prompt and decode. The tool prints text, not token ids:
the row's ids are its printed answer tokenized again, so its exact-match rate against ``ar`` is approximate. Where the
tool is not built the bench leaves these rows out and says why.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..decoding.sampling import SamplingParams
from ..errors import InvalidRequestError, UnsupportedOptionError
from .results import Measurement

#: The tool the rows run.
TOOL = "llama-speculative-simple"
#: The rows this module runs.
TOOL_ROWS = ("llama.cpp-draft", "llama.cpp-ngram")
#: llama.cpp's n-gram speculation modes (``--spec-type``).
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
#: The n-gram mode of ``llama.cpp-ngram`` unless told (its simplest; on a Zen 4 over Spec-Bench coding and math prompts
#: the first four modes ran within 2 % of one another, ngram-cache a fifth slower).
DEFAULT_NGRAM_TYPE = "ngram-simple"
#: Each row's options.
ROW_OPTIONS = {"llama.cpp-draft": ("model", "n_max", "p_min"), "llama.cpp-ngram": ("type", "n_max")}
#: The file written once a build is in place.
MARKER = "built.txt"


def tool_row(method: str) -> str | None:
    """The tool row ``method`` names (``"llama.cpp-draft:model=x"`` -> ``"llama.cpp-draft"``), else ``None``."""
    name = method.partition(":")[0]
    return name if name in TOOL_ROWS else None


@dataclass(frozen=True)
class ToolRow:
    """A tool row's settings, from its spec.

    Attributes:
        name: the row (one of :data:`TOOL_ROWS`).
        draft_model: the draft preset or ``.gguf`` file (``llama.cpp-draft``).
        ngram_type: the n-gram mode (``llama.cpp-ngram``).
        n_max: most tokens drafted a step (``None``: llama.cpp's default).
        p_min: least draft probability to go on drafting (``None``: llama.cpp's default).
    """

    name: str
    draft_model: str | None = None
    ngram_type: str | None = None
    n_max: int | None = None
    p_min: float | None = None

    @classmethod
    def parse(cls, method: str) -> ToolRow:
        """The settings of ``method`` (``name[:key=value,...]``), checked.

        Raises:
            UnsupportedOptionError: an unknown row or option, or a bad value.
        """
        name, _, text = method.partition(":")
        if name not in TOOL_ROWS:
            raise UnsupportedOptionError(f"unknown llama.cpp tool row {name!r}; rows: {', '.join(TOOL_ROWS)}")
        options: dict[str, str] = {}
        for piece in filter(None, (part.strip() for part in text.split(","))):
            key, has_value, value = piece.partition("=")
            if not has_value or key not in ROW_OPTIONS[name]:
                raise UnsupportedOptionError(f"{name} takes {', '.join(ROW_OPTIONS[name])}=..., not {piece!r}")
            options[key] = value
        try:
            n_max = int(options["n_max"]) if "n_max" in options else None
            p_min = float(options["p_min"]) if "p_min" in options else None
        except ValueError:
            raise UnsupportedOptionError(f"bad number in {method!r}") from None
        if n_max is not None and n_max < 1 or p_min is not None and not 0.0 <= p_min <= 1.0:
            raise UnsupportedOptionError(f"{method!r}: n_max is at least 1, p_min between 0 and 1")
        if name == "llama.cpp-draft":
            if "model" not in options:
                raise UnsupportedOptionError("llama.cpp-draft needs its draft model: llama.cpp-draft:model=NAME")
            return cls(name, draft_model=options["model"], n_max=n_max, p_min=p_min)
        ngram_type = options.get("type", DEFAULT_NGRAM_TYPE)
        if ngram_type not in NGRAM_TYPES:
            raise UnsupportedOptionError(f"unknown n-gram type {ngram_type!r}; types: {', '.join(NGRAM_TYPES)}")
        return cls(name, ngram_type=ngram_type, n_max=n_max)


def _llama_cpp_version() -> str:
    try:
        import llama_cpp
    except ImportError as error:
        raise InvalidRequestError("llama.cpp's tools are built from llama-cpp-python's source: "
                                  "pip install 'draftwise[anchors]'") from error
    return str(llama_cpp.__version__)


def tools_folder(cache_dir: str | os.PathLike | None = None, version: str | None = None) -> Path:
    """Where the tools of the installed llama-cpp-python version are built for this machine (its CPU's flags are
    part of the name: a native build runs on the CPU it was built for)."""
    from ..backend.calibration.machine import cache_root, cpu_flags

    version = version or _llama_cpp_version()
    digest = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / "llama.cpp" / f"{version}-{digest}"


def find_tool(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The built tool, or ``None`` where it is not built (or llama-cpp-python is not installed)."""
    try:
        folder = tools_folder(cache_dir)
    except InvalidRequestError:
        return None
    tool = folder / "bin" / TOOL
    return tool if (folder / MARKER).is_file() and tool.is_file() else None


def _run(command: Sequence[str], cwd: Path | None = None, on_line: Callable[[str], None] | None = None) -> None:
    """Run ``command``; its output goes to ``on_line`` line by line, and, when it fails, the end of it into the
    error."""
    process = subprocess.Popen(list(command), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert process.stdout is not None
    for line in process.stdout:
        tail = (tail + [line.rstrip()])[-30:]
        if on_line is not None:
            on_line(line.rstrip())
    if process.wait() != 0:
        raise InvalidRequestError(f"{' '.join(command[:3])} ... failed:\n" + "\n".join(tail))


def build_tools(cache_dir: str | os.PathLike | None = None, say: Callable[[str], None] = print) -> Path:
    """Build :data:`TOOL` from the installed llama-cpp-python version's source distribution (downloaded by pip) for
    this machine, unless built already; returns its path.

    The build runs in a staging folder and only a finished tool is moved into place (with :data:`MARKER` written
    last), so an interrupted build leaves nothing that passes for a build.
    """
    found = find_tool(cache_dir)
    if found is not None:
        say(f"{TOOL} is built: {found}")
        return found
    if shutil.which("cmake") is None:
        raise InvalidRequestError("building llama.cpp's tools needs cmake (pip install cmake, or the system's)")
    version = _llama_cpp_version()
    folder = tools_folder(cache_dir, version)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder.parent))
    try:
        say(f"downloading llama-cpp-python {version}'s source distribution")
        _run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:",
              "--no-deps", "-d", str(staging / "download")])
        archives = sorted((staging / "download").glob("*.tar.gz"))
        if not archives:
            raise InvalidRequestError(f"pip found no source distribution of llama-cpp-python {version}")
        with tarfile.open(archives[0]) as archive:
            if hasattr(tarfile, "data_filter"):  # (members that would leave the folder refused)
                archive.extractall(staging / "source", filter="data")
            else:
                archive.extractall(staging / "source")
        sources = next((staging / "source").glob("*/vendor/llama.cpp"), None)
        if sources is None:
            raise InvalidRequestError("the source distribution holds no vendor/llama.cpp")
        build = staging / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        say(f"configuring llama.cpp {version} with the machine's instruction set (GGML_NATIVE)")
        _run(["cmake", "-S", str(sources), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
              "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
              "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=OFF"])
        say(f"compiling {TOOL} (a few minutes on two cores)")
        shown = [-1]

        def progress(line: str) -> None:  # ninja's and make's "[done/total]" as a line every tenth
            match = re.match(r"\[\s*(\d+)/(\d+)\]", line) or re.match(r"\[\s*(\d+)%\]", line)
            if match is None:
                return
            share = int(match.group(1)) * 100 // int(match.group(2)) if match.lastindex == 2 else int(match.group(1))
            if share // 10 > shown[0]:
                shown[0] = share // 10
                say(f"  {share} %")

        _run(["cmake", "--build", str(build), "--target", TOOL, "-j", str(os.cpu_count() or 1)], on_line=progress)
        built = next(iter(build.glob(f"**/bin/{TOOL}")), None)
        if built is None:
            raise InvalidRequestError(f"the build made no {TOOL}")
        finished = staging / "finished"
        (finished / "bin").mkdir(parents=True)
        shutil.copy2(built, finished / "bin" / TOOL)
        (finished / MARKER).write_text(f"llama-cpp-python {version}\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(finished, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"{TOOL} built: {folder / 'bin' / TOOL}")
    return folder / "bin" / TOOL


#: What the tool prints of a run (on its standard error).
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_COUNTS = re.compile(r"(n_drafted|n_accept)\s*=\s*(\d+)")


class LlamaToolRunner:
    """One tool row: runs :data:`TOOL` on each prompt (the same interface as
    :class:`~draftwise.bench.anchors.LlamaCppRunner`).

    Args:
        tool: the built tool.
        row: the row's settings.
        gguf_path: the target's file; draft_gguf: the draft's (``llama.cpp-draft``).
        tokenizer: the target's tokenizer (prompts go to the tool as text, its answers come back as ids).
        context: positions to allocate; threads: CPU threads.
    """

    def __init__(self, tool: Path, row: ToolRow, gguf_path: Path, draft_gguf: Path | None, tokenizer: Any,
                 context: int, threads: int) -> None:
        self.tool, self.row, self.gguf_path, self.draft_gguf = tool, row, gguf_path, draft_gguf
        self.tokenizer, self.context, self.threads = tokenizer, context, threads
        #: Tokens drafted and accepted over every run so far (the tool's counts).
        self.drafted = self.accepted = 0

    def command(self, prompt_file: Path, max_new_tokens: int) -> list[str]:
        """The tool's command line for one run."""
        command = [str(self.tool), "-m", str(self.gguf_path), "-f", str(prompt_file), "-n", str(max_new_tokens),
                   "--temp", "0", "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.context),
                   "--no-escape"]  # (the prompt as written: a backslash in it stays one)
        if self.row.draft_model is not None:
            command += ["-md", str(self.draft_gguf), "-td", str(self.threads), "--spec-type", "draft-simple"]
        else:
            command += ["--spec-type", str(self.row.ngram_type)]
        if self.row.n_max is not None:
            command += ["--spec-draft-n-max", str(self.row.n_max)]
        if self.row.p_min is not None:
            command += ["--spec-draft-p-min", str(self.row.p_min)]
        return command

    def measure(self, prompt_ids: Sequence[int], max_new_tokens: int, eos: Sequence[int],
                sampling: SamplingParams) -> Measurement:
        """One run on ``prompt_ids``: the answer's ids (its text tokenized again), the tool's prompt and decoding
        seconds, and its prompt seconds as the time to the first token."""
        if not sampling.greedy:
            raise UnsupportedOptionError(f"{self.row.name} rows decode greedily")
        prompt = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        with tempfile.TemporaryDirectory() as scratch:
            prompt_file = Path(scratch) / "prompt.txt"
            prompt_file.write_text(prompt + "\n")  # (the tool drops a file's last newline: the prompt's own stays)
            done = subprocess.run(self.command(prompt_file, max_new_tokens), capture_output=True, text=True,
                                  check=False)
        if done.returncode != 0:
            raise InvalidRequestError(f"{TOOL} failed ({done.returncode}): {done.stderr[-2000:]}")
        printed = done.stderr + done.stdout  # (its log lines go to either, by version)
        encoded, decoded = _ENCODED.search(printed), _DECODED.search(printed)
        if encoded is None or decoded is None:
            raise InvalidRequestError(f"{TOOL} printed no timings: {printed[-2000:]}")
        counts = dict(_COUNTS.findall(printed))
        self.drafted += int(counts.get("n_drafted", 0))
        self.accepted += int(counts.get("n_accept", 0))
        answer = done.stdout
        start = answer.find(prompt)
        answer = answer[start + len(prompt):] if start >= 0 else answer
        answer = answer.split("\nencoded ", 1)[0]  # (where its log lines share the output)
        # (a last step's accepted drafts may carry it past max_new_tokens: those are cut, and their share of the
        # decoding time with them)
        count = int(decoded.group(1))
        kept = min(count, max_new_tokens)
        ids = self.tokenizer.encode(answer.rstrip("\n"), add_special_tokens=False)[:kept]
        prompt_seconds = float(encoded.group(2))
        decode_seconds = float(decoded.group(2)) * (kept / count if count else 1.0)
        return Measurement(list(ids), prompt_seconds + decode_seconds, prompt_seconds)
