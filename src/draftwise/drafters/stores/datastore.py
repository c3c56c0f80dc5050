"""A retrieval datastore for REST: a token corpus with its suffix array, for longest-suffix look-ups and counted
continuations.

The corpus is one int32 array in which every document is followed by :data:`SEPARATOR`; the suffix array lists the
positions of all non-separator tokens in the lexicographic order of the suffixes that start there (built by
libdivsufsort through ``pydivsufsort``). Every occurrence of a token sequence is then one contiguous range of the
suffix array, found by binary search, and the continuations of the occurrences in that range come out sorted, so
counting them into a trie needs no hashing.

A datastore is saved as a plain ``.npz`` (no pickles) with the tokenizer's name, vocabulary size and a fingerprint of
its vocabulary, so that loading it for another tokenizer is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pydivsufsort

from ...errors import InvalidRequestError
from ...files import read_npz

#: Token id that ends every document; it never matches and a continuation stops at it.
SEPARATOR = -1
#: Default bound on the corpus tokens a datastore holds (about 160 MB on disk).
DEFAULT_MAX_TOKENS = 20_000_000
#: Hard bound: positions are stored as int32.
MAX_TOKENS_LIMIT = 1_000_000_000
FORMAT_VERSION = 1
#: Arrays of a saved datastore.
DATASTORE_FIELDS = ("format_version", "tokens", "suffixes", "vocab_size", "tokenizer_name", "tokenizer_fingerprint")


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Positions of the non-separator tokens of ``tokens`` (int32, separators < 0), sorted by the suffix starting
    at each. Separators sort below every token, so the suffixes that start with one form a block at the front,
    which is dropped."""
    if len(tokens) == 0:
        return np.zeros(0, dtype=np.int32)
    # pydivsufsort sorts integer arrays as fixed-width big-endian bytes and keeps the suffixes at token boundaries.
    order = pydivsufsort.divsufsort(np.ascontiguousarray(tokens, dtype=np.int32))
    separators = int(np.count_nonzero(tokens < 0))
    return np.ascontiguousarray(order[separators:], dtype=np.int32)


def join_documents(documents: Iterable[np.ndarray]) -> np.ndarray:
    """One int32 array holding every document followed by :data:`SEPARATOR` (empty documents skipped)."""
    pieces: list[np.ndarray] = []
    ending = np.array([SEPARATOR], dtype=np.int32)
    for document in documents:
        if len(document):
            pieces.extend((np.asarray(document, dtype=np.int32), ending))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """Number of token ids the tokenizer can produce (added tokens included)."""
    try:
        return len(tokenizer)
    except TypeError:
        return int(tokenizer.vocab_size)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's vocabulary (token -> id), or ``""`` when it does not expose one."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return ""
    vocabulary = sorted(get_vocab().items())
    return hashlib.sha256(json.dumps(vocabulary, ensure_ascii=False).encode("utf-8")).hexdigest()


def continuation_trie(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Count lexicographically sorted continuation rows into a trie.

    Args:
        rows: ``(matches, depth)`` token ids, sorted row-wise; a row holds :data:`SEPARATOR` from where its document
            ends onwards.

    Returns:
        ``(tokens, parents, counts, depths)`` of the trie nodes, shallower nodes first (parents precede children;
        ``parents`` is ``-1`` below the root). ``counts`` is the number of rows that start with the node's path.
    """
    matches, depth = rows.shape
    node_tokens, node_parents, node_counts, node_depths = [], [], [], []
    if matches and depth:
        # A row opens a new node at depth d when it differs from the row above somewhere in its first d tokens.
        opens = np.ones((matches, depth), dtype=bool)
        opens[1:] = np.logical_or.accumulate(rows[1:] != rows[:-1], axis=1)
        offset = 0
        row_node = np.full(matches, -1, dtype=np.int64)  # node (global index) of each row at the previous depth
        for column in range(depth):
            opening_rows = np.flatnonzero(opens[:, column])
            node_tokens.append(rows[opening_rows, column])
            node_parents.append(row_node[opening_rows])
            node_counts.append(np.diff(np.append(opening_rows, matches)))
            node_depths.append(np.full(len(opening_rows), column + 1))
            row_node = offset + np.cumsum(opens[:, column]) - 1
            offset += len(opening_rows)
    if not node_tokens:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    tokens = np.concatenate(node_tokens).astype(np.int64)
    parents = np.concatenate(node_parents)
    counts = np.concatenate(node_counts)
    depths = np.concatenate(node_depths)
    # Separator nodes go, and with them everything below (rows hold separators from the first one on).
    keep = tokens >= 0
    renumber = np.cumsum(keep) - 1
    parents = np.where(parents >= 0, renumber[np.maximum(parents, 0)], -1)
    return tokens[keep], parents[keep], counts[keep], depths[keep]


def evenly_spaced(count: int, limit: int) -> np.ndarray:
    """Indices of at most ``limit`` of ``count`` sorted items, evenly spaced (sorted continuations keep their
    shares)."""
    if count <= limit:
        return np.arange(count, dtype=np.int64)
    return (np.arange(limit, dtype=np.int64) * count) // limit


def context_continuations(
    context: Sequence[int], min_length: int, max_length: int, depth: int, max_matches: int
) -> tuple[int, np.ndarray]:
    """Longest-suffix retrieval from a sequence itself (its own end excluded), as :meth:`Datastore.longest_match`
    and :meth:`Datastore.continuations` would give on it, without building an index.

    A sequence of a few thousand tokens is scanned in a fraction of a millisecond, which beats sorting its suffixes
    again at every step as it grows.

    Returns:
        ``(length, rows)``: the matched suffix length (0 if none reaches ``min_length``) and the sorted continuation
        rows (see :meth:`Datastore.continuations`).
    """
    tokens = np.asarray(context, dtype=np.int32)
    size = len(tokens)
    longest = min(max_length, size - 1)
    if longest < max(min_length, 1) or depth <= 0:
        return 0, np.zeros((0, max(depth, 0)), dtype=np.int32)
    # matched[e - 1, k - 1]: the k-th token before position e equals the sequence's k-th last token.
    ends = np.arange(1, size)
    back = np.arange(1, longest + 1)
    before = ends[:, None] - back[None, :]
    matched = (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[size - back][None, :])
    lengths = np.cumprod(matched, axis=1, dtype=np.int8).sum(axis=1)
    length = int(lengths.max())
    if length < min_length:
        return 0, np.zeros((0, depth), dtype=np.int32)
    starts = ends[lengths == length]
    padded = np.concatenate((tokens, np.full(depth, SEPARATOR, dtype=np.int32)))
    rows = padded[starts[:, None] + np.arange(depth)]
    rows = rows[np.lexsort(rows.T[::-1])]
    return length, rows[evenly_spaced(len(rows), max_matches)]


@dataclass(frozen=True, eq=False)
class Datastore:
    """A token corpus indexed by its suffix array.

    Attributes:
        tokens: int32 corpus; every document is followed by :data:`SEPARATOR`.
        suffixes: positions of the non-separator tokens in suffix order (see :func:`suffix_array`).
        vocab_size: vocabulary size of the tokenizer that produced the tokens (0 = unknown).
        tokenizer_name: that tokenizer's name or path, for messages.
        tokenizer_fingerprint: hash of that tokenizer's vocabulary (``""`` = unknown), for the mismatch check.
    """

    tokens: np.ndarray
    suffixes: np.ndarray
    vocab_size: int = 0
    tokenizer_name: str = ""
    tokenizer_fingerprint: str = ""
    _bucket_starts: np.ndarray = field(default=None, init=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.suffixes.ndim != 1:
            raise InvalidRequestError("a datastore's tokens and suffixes must be one-dimensional")
        if len(self.tokens) and self.tokens[-1] != SEPARATOR:
            raise InvalidRequestError("a datastore's tokens must end with the separator")
        content = self.tokens[self.tokens >= 0]
        if len(self.suffixes) != len(content):
            raise InvalidRequestError(
                f"datastore holds {len(content)} tokens but {len(self.suffixes)} suffixes: the file is damaged"
            )
        # Suffixes are sorted by their first token: bucket t of the suffix array is [starts[t], starts[t + 1]).
        counts = np.bincount(content, minlength=1) if len(content) else np.zeros(1, dtype=np.int64)
        object.__setattr__(self, "_bucket_starts", np.concatenate(([0], np.cumsum(counts))))

    @classmethod
    def from_documents(
        cls,
        documents: Iterable[np.ndarray],
        vocab_size: int = 0,
        tokenizer_name: str = "",
        tokenizer_fingerprint: str = "",
    ) -> Datastore:
        """Index token arrays (one per document)."""
        tokens = join_documents(documents)
        if vocab_size and len(tokens) and int(tokens.max()) >= vocab_size:
            raise InvalidRequestError(f"token id {int(tokens.max())} is outside the vocabulary of {vocab_size}")
        return cls(tokens, suffix_array(tokens), vocab_size, tokenizer_name, tokenizer_fingerprint)

    def __len__(self) -> int:
        """Number of corpus tokens (separators excluded)."""
        return len(self.suffixes)

    @property
    def documents(self) -> int:
        return int(np.count_nonzero(self.tokens == SEPARATOR))

    # ------------------------------------------------------------------------------------------------ look-up

    def _prefix(self, index: int, length: int) -> tuple[int, ...]:
        start = int(self.suffixes[index])
        return tuple(self.tokens[start : start + length].tolist())

    def _lower_bound(self, pattern: tuple[int, ...], low: int, high: int) -> int:
        """First suffix index in ``[low, high)`` whose suffix is not below ``pattern`` (compared on its length)."""
        length = len(pattern)
        while low < high:
            middle = (low + high) // 2
            if self._prefix(middle, length) < pattern:
                low = middle + 1
            else:
                high = middle
        return low

    def match_range(self, pattern: Iterable[int]) -> tuple[int, int]:
        """``(low, high)``: the suffix-array range of the occurrences of ``pattern`` (empty when ``low == high``)."""
        pattern = tuple(int(token) for token in pattern)
        if not pattern or not 0 <= pattern[0] < len(self._bucket_starts) - 1:
            return 0, 0
        low, high = int(self._bucket_starts[pattern[0]]), int(self._bucket_starts[pattern[0] + 1])
        if len(pattern) == 1 or low == high:
            return low, high
        low = self._lower_bound(pattern, low, high)
        # Everything that starts with the pattern sorts below the pattern with its last token increased by one.
        high = self._lower_bound((*pattern[:-1], pattern[-1] + 1), low, high)
        return low, high

    def _has_continuation(self, low: int, high: int, length: int) -> bool:
        """Whether some occurrence in the range is followed by a token. Occurrences followed by a separator (a
        document's end, or a sequence's own end) sort first, so the last one decides."""
        return high > low and bool(self.tokens[int(self.suffixes[high - 1]) + length] >= 0)

    def longest_match(self, context: Sequence[int], min_length: int, max_length: int) -> tuple[int, int, int]:
        """The longest suffix of ``context`` (between ``min_length`` and ``max_length`` tokens) that occurs followed
        by a token: ``(length, low, high)``, where ``[low, high)`` is the suffix-array range of its occurrences that
        are followed by a token; ``(0, 0, 0)`` if there is none.

        If a suffix occurs, so does every shorter one, so the lengths are bisected."""
        context = [int(token) for token in context[max(len(context) - max_length, 0) :]]
        best = (0, 0, 0)
        shortest, longest = max(min_length, 1), min(max_length, len(context))
        while shortest <= longest:
            length = (shortest + longest) // 2
            low, high = self.match_range(context[len(context) - length :])
            if self._has_continuation(low, high, length):
                best = (length, low, high)
                shortest = length + 1
            else:
                longest = length - 1
        length, low, high = best
        if length:
            # Skip the occurrences that end a document: they sort first, below any continuation token.
            low = self._lower_bound((*context[len(context) - length :], 0), low, high)
        return length, low, high

    def continuations(self, low: int, high: int, offset: int, depth: int, max_matches: int) -> np.ndarray:
        """The ``depth`` tokens that follow up to ``max_matches`` occurrences in the range ``[low, high)`` of a
        pattern of ``offset`` tokens, as sorted rows; a row holds :data:`SEPARATOR` from its document's end on.

        When the range holds more occurrences, evenly spaced ones are taken: the range is sorted by continuation, so
        the sample keeps each continuation's share."""
        count = high - low
        if count <= 0 or depth <= 0:
            return np.zeros((0, max(depth, 0)), dtype=np.int32)
        picked = low + evenly_spaced(count, max_matches)
        starts = self.suffixes[picked].astype(np.int64) + offset
        # The corpus ends with a separator, so clipping to its last position reads a separator.
        positions = np.minimum(starts[:, None] + np.arange(depth), len(self.tokens) - 1)
        rows = self.tokens[positions]
        return np.where(np.logical_or.accumulate(rows < 0, axis=1), SEPARATOR, rows)

    # ----------------------------------------------------------------------------------------------- files

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Refuse a tokenizer other than the one the datastore was built with."""
        size = tokenizer_vocab_size(tokenizer)
        fingerprint = tokenizer_fingerprint(tokenizer)
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        if (self.vocab_size and size != self.vocab_size) or (
            fingerprint and self.tokenizer_fingerprint and fingerprint != self.tokenizer_fingerprint
        ):
            raise InvalidRequestError(
                f"the datastore was built with tokenizer {self.tokenizer_name or '?'} ({self.vocab_size} tokens), "
                f"not {name} ({size} tokens): build one with this model's tokenizer (draftwise datastore build)"
            )

    def check_token_ids(self, token_ids: Iterable[int]) -> None:
        """Refuse token ids outside the datastore's vocabulary: they come from another tokenizer."""
        if not self.vocab_size:
            return
        largest = max((int(token) for token in token_ids), default=-1)
        if largest >= self.vocab_size:
            raise InvalidRequestError(
                f"token id {largest} is outside the datastore's vocabulary of {self.vocab_size} "
                f"(tokenizer {self.tokenizer_name or '?'}): build a datastore with this model's tokenizer"
            )

    def save(self, path: str | os.PathLike) -> None:
        """Write the datastore to ``path`` (an uncompressed ``.npz``: it loads in a fraction of a second)."""
        with open(path, "wb") as handle:
            np.savez(
                handle,
                format_version=np.int64(FORMAT_VERSION),
                tokens=self.tokens,
                suffixes=self.suffixes,
                vocab_size=np.int64(self.vocab_size),
                tokenizer_name=np.str_(self.tokenizer_name),
                tokenizer_fingerprint=np.str_(self.tokenizer_fingerprint),
            )

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer: Any = None) -> Datastore:
        """Read a datastore written by :meth:`save`; with ``tokenizer``, refuse it if it was built with another."""
        path = Path(path)
        if not path.exists():
            raise InvalidRequestError(f"datastore {path} does not exist: build one with `draftwise datastore build`")
        data = read_npz(path, "datastore")
        missing = sorted(set(DATASTORE_FIELDS) - set(data))
        if missing:
            raise InvalidRequestError(f"datastore {path} is not a draftwise datastore (no {', '.join(missing)})")
        try:
            version = int(data["format_version"])
            if version != FORMAT_VERSION:
                raise InvalidRequestError(f"datastore {path} has format {version}; this version reads {FORMAT_VERSION}")
            datastore = cls(
                data["tokens"].astype(np.int32, copy=False),
                data["suffixes"].astype(np.int32, copy=False),
                int(data["vocab_size"]),
                str(data["tokenizer_name"]),
                str(data["tokenizer_fingerprint"]),
            )
        except (TypeError, ValueError) as error:
            if isinstance(error, InvalidRequestError):
                raise
            raise InvalidRequestError(f"datastore {path} is damaged ({error})") from None
        if tokenizer is not None:
            datastore.check_tokenizer(tokenizer)
        return datastore


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What a datastore records of its tokenizer (keyword arguments of :meth:`Datastore.from_documents`)."""
    return {
        "vocab_size": tokenizer_vocab_size(tokenizer),
        "tokenizer_name": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
    }
