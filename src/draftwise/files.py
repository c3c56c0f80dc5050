"""Reading the files a user names (prompt files, corpora, datastores, drafter state): every failure becomes one
:class:`~draftwise.errors.InvalidRequestError` naming the file and what is wrong with it, never a traceback from
deep inside a reader."""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .errors import InvalidRequestError


def readable_file(path: str | os.PathLike, what: str) -> Path:
    """``path``, refused with a clear message where it is missing, a folder or empty (``what`` it is, for the
    message)."""
    path = Path(path)
    if not path.exists():
        raise InvalidRequestError(f"{what} {path} does not exist")
    if path.is_dir():
        raise InvalidRequestError(f"{what} {path} is a folder, not a file")
    try:
        size = path.stat().st_size
    except OSError as error:
        raise InvalidRequestError(f"{what} {path} cannot be read: {error.strerror or error}") from None
    if size == 0:
        raise InvalidRequestError(f"{what} {path} is empty")
    return path


def read_text_file(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of a file a user named; one clear error where it is missing, a folder, unreadable, binary or not
    UTF-8."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InvalidRequestError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise InvalidRequestError(f"{what} {path} is a folder, not a file") from None
    except OSError as error:
        raise InvalidRequestError(f"{what} {path} cannot be read: {error.strerror or error}") from None
    if b"\0" in data:
        raise InvalidRequestError(f"{what} {path} is a binary file, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequestError(f"{what} {path} is not UTF-8 text (byte {error.start})") from None


def read_npz(path: str | os.PathLike, what: str) -> dict[str, np.ndarray]:
    """Every array of a numpy ``.npz`` archive a user named (``what`` it is, for the messages), read whole; one clear
    error where the file is missing, empty, a folder, not an archive (binary, text, a single ``.npy`` array) or a
    truncated or damaged one. No pickles are loaded."""
    path = readable_file(path, what)
    with open(path, "rb") as handle:
        start = handle.read(6)
    if start == b"\x93NUMPY":
        raise InvalidRequestError(f"{what} {path} is a single numpy array, not an .npz archive")
    if not start.startswith(b"PK"):
        raise InvalidRequestError(f"{what} {path} is not a numpy .npz archive (no zip header)")
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise InvalidRequestError(f"{what} {path} is not a numpy .npz archive ({_reason(error)})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise InvalidRequestError(f"{what} {path} is a single numpy array, not an .npz archive")
    try:
        with loaded as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as error:
        raise InvalidRequestError(f"{what} {path} is truncated or damaged ({_reason(error)})") from None


def _reason(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__
