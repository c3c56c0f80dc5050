"""A sparse, bounded tri-gram store: the strongest successors ``c`` of every token pair ``(a, b)``.

Counted rows live in sorted numpy arrays (``keys`` of packed pairs, ``tokens`` and ``weights`` of shape
``(rows, top_k)``), so a store of millions of pairs takes a few bytes per successor and loads without unpickling
anything. Rows changed while decoding live in a small dictionary in front of the arrays and are folded into them
in batches; when the store holds more than ``max_pairs`` pairs the weakest rows (least total weight) are evicted.

A drafter that learns while decoding queues its updates (:meth:`TrigramStore.queue`): they are applied, in order,
when the store is next read, so a step's bookkeeping does not run right after a forward, on caches the forward's
weights just flushed (aded's updates cost ~60 us a step there on a 2-core CPU, a few times what they cost in a batch).

Weights are probabilities at build time (``count / (pair count + smoothing)``, so a pair seen once is not trusted as
a certainty); online updates add to them (capped), and :meth:`TrigramStore.row` normalises them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from ...errors import InvalidRequestError
from ...files import read_npz

EMPTY = -1
#: Stands in for the first token of a pair to hold bi-gram rows P(c | b), the back-off of unseen pairs.
BACKOFF = 0x7FFFFFFF
#: Format tag written into saved stores.
FORMAT = "draftwise-trigram-1"
#: Queued updates applied without waiting for a read.
QUEUE_LIMIT = 256


def pack_pair(a: int, b: int) -> int:
    """The int64 key of the pair ``(a, b)``."""
    return (int(a) << 32) | int(b)


def pack_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.astype(np.int64) << 32) | b.astype(np.int64)


class TrigramStore:
    """Top-``top_k`` successors per token pair, bounded to ``max_pairs`` pairs.

    Args:
        top_k: successors kept per pair.
        max_pairs: most pairs held; the weakest are evicted beyond it (memory is about ``max_pairs * top_k * 8``
            bytes plus the keys).
        merge_every: online rows held in the dictionary before they are folded into the arrays.
    """

    def __init__(self, top_k: int = 12, max_pairs: int = 4_000_000, merge_every: int = 20_000) -> None:
        if top_k < 1 or max_pairs < 1 or merge_every < 1:
            raise ValueError("need top_k >= 1, max_pairs >= 1 and merge_every >= 1")
        self.top_k = top_k
        self.max_pairs = max_pairs
        self.merge_every = merge_every
        self.keys = np.empty(0, dtype=np.int64)
        self.tokens = np.empty((0, top_k), dtype=np.int32)
        self.weights = np.empty((0, top_k), dtype=np.float32)
        self._online: dict[int, tuple[list[int], list[float]]] = {}
        self._queued: list[tuple[int, int, int, float, float]] = []  # (a, b, c, amount, cap) of :meth:`add`

    def __len__(self) -> int:
        """Number of pairs held (arrays and online rows; a pair in both counts once after the next merge)."""
        self._apply_queued()
        return len(self.keys) + sum(1 for key in self._online if not self._in_arrays(key))

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.tokens.nbytes + self.weights.nbytes

    def _find(self, key: int) -> int:
        index = int(np.searchsorted(self.keys, key))
        return index if index < len(self.keys) and self.keys[index] == key else -1

    def _in_arrays(self, key: int) -> bool:
        return self._find(key) >= 0

    def _raw_row(self, key: int) -> tuple[list[int], list[float]] | None:
        self._apply_queued()
        row = self._online.get(key)
        if row is not None:
            return row
        index = self._find(key)
        if index < 0:
            return None
        tokens = self.tokens[index]
        filled = tokens != EMPTY
        return tokens[filled].tolist(), self.weights[index][filled].tolist()

    def row(self, a: int, b: int) -> tuple[list[int], list[float]]:
        """Successors of ``(a, b)``, strongest first, with probabilities summing to one; the successors of ``b``
        alone when the pair is unknown (empty lists if both are)."""
        raw = self._raw_row(pack_pair(a, b))
        if not raw or not raw[0]:
            raw = self._raw_row(pack_pair(BACKOFF, b))
        if not raw or not raw[0]:
            return [], []
        tokens, weights = raw
        total = sum(weights)
        order = sorted(range(len(tokens)), key=lambda i: -weights[i])
        return [tokens[i] for i in order], [weights[i] / total for i in order]

    def add(self, a: int, b: int, c: int, amount: float, cap: float = 3.0) -> None:
        """Raise the weight of ``c`` after ``(a, b)``, and after ``b`` alone, by ``amount`` (at most ``cap``); a new
        successor displaces the weakest one when a row is full. A non-positive ``amount`` changes nothing."""
        self._apply_queued()
        if amount <= 0:
            return  # a zero-weight successor would make a row's probabilities undefined
        self._add(pack_pair(a, b), c, amount, cap)
        self._add(pack_pair(BACKOFF, b), c, amount, cap)

    def _add(self, key: int, c: int, amount: float, cap: float) -> None:
        row = self._online.get(key)
        if row is None:
            raw = self._raw_row(key)
            row = (list(raw[0]), list(raw[1])) if raw else ([], [])
            self._online[key] = row
        tokens, weights = row
        c = int(c)
        if c in tokens:
            position = tokens.index(c)
            weights[position] = min(cap, weights[position] + amount)
        elif len(tokens) < self.top_k:
            tokens.append(c)
            weights.append(min(cap, amount))
        else:
            weakest = min(range(len(weights)), key=weights.__getitem__)
            if weights[weakest] < amount:
                tokens[weakest] = c
                weights[weakest] = min(cap, amount)
        if len(self._online) >= self.merge_every:
            self.merge()

    def add_sequence(self, tokens: Sequence[int], amount: float, cap: float = 3.0) -> None:
        """Raise every tri-gram of ``tokens``."""
        for index in range(2, len(tokens)):
            self.add(tokens[index - 2], tokens[index - 1], tokens[index], amount, cap)

    def queue(self, a: int, b: int, c: int, amount: float, cap: float = 3.0) -> None:
        """:meth:`add`, applied when the store is next read (or added to directly, merged or saved): every read sees
        every update queued before it, in order."""
        if amount <= 0:
            return  # (changes nothing, see add)
        self._queued.append((a, b, c, amount, cap))
        if len(self._queued) >= QUEUE_LIMIT:
            self._apply_queued()

    def queue_sequence(self, tokens: Sequence[int], amount: float, cap: float = 3.0) -> None:
        """:meth:`add_sequence`, queued (see :meth:`queue`)."""
        for index in range(2, len(tokens)):
            self.queue(tokens[index - 2], tokens[index - 1], tokens[index], amount, cap)

    def _apply_queued(self) -> None:
        if self._queued:
            queued, self._queued = self._queued, []
            for a, b, c, amount, cap in queued:
                self.add(a, b, c, amount, cap)

    def merge(self) -> None:
        """Fold the online rows into the arrays, then evict the weakest pairs beyond ``max_pairs``."""
        self._apply_queued()
        if self._online:
            keys = np.fromiter(self._online, dtype=np.int64, count=len(self._online))
            tokens = np.full((len(keys), self.top_k), EMPTY, dtype=np.int32)
            weights = np.zeros((len(keys), self.top_k), dtype=np.float32)
            for index, (row_tokens, row_weights) in enumerate(self._online.values()):
                tokens[index, : len(row_tokens)] = row_tokens
                weights[index, : len(row_weights)] = row_weights
            self._online = {}
            # Online rows replace their array rows: drop those, then merge the two sorted sets.
            stale = np.isin(self.keys, keys)
            self._set_arrays(
                np.concatenate([self.keys[~stale], keys]),
                np.concatenate([self.tokens[~stale], tokens]),
                np.concatenate([self.weights[~stale], weights]),
            )
        if len(self.keys) > self.max_pairs:
            strength = self.weights.sum(axis=1)
            keep = np.sort(np.argpartition(-strength, self.max_pairs - 1)[: self.max_pairs])
            self.keys, self.tokens, self.weights = self.keys[keep], self.tokens[keep], self.weights[keep]

    def _set_arrays(self, keys: np.ndarray, tokens: np.ndarray, weights: np.ndarray) -> None:
        order = np.argsort(keys, kind="stable")
        self.keys, self.tokens, self.weights = keys[order], tokens[order], weights[order]

    @classmethod
    def from_counts(
        cls,
        pairs: np.ndarray,
        successors: np.ndarray,
        counts: np.ndarray,
        top_k: int = 12,
        max_pairs: int = 4_000_000,
        smoothing: float = 1.0,
    ) -> TrigramStore:
        """A store from unique tri-gram counts: ``pairs`` (packed keys), ``successors`` and ``counts`` (same length)."""
        store = cls(top_k=top_k, max_pairs=max_pairs)
        if len(pairs) == 0:
            return store
        order = np.lexsort((-counts, pairs))
        pairs, successors, counts = pairs[order], successors[order], counts[order].astype(np.float64)
        starts = np.flatnonzero(np.r_[True, pairs[1:] != pairs[:-1]])
        totals = np.add.reduceat(counts, starts)
        group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(pairs)]))
        rank = np.arange(len(pairs)) - starts[group]
        kept = rank < top_k
        tokens = np.full((len(starts), top_k), EMPTY, dtype=np.int32)
        weights = np.zeros((len(starts), top_k), dtype=np.float32)
        tokens[group[kept], rank[kept]] = successors[kept]
        weights[group[kept], rank[kept]] = counts[kept] / (totals[group[kept]] + smoothing)
        store.keys, store.tokens, store.weights = pairs[starts], tokens, weights
        store.merge()  # applies the bound
        return store

    def save(
        self, path: str | os.PathLike, arrays: Mapping[str, np.ndarray] | None = None, **metadata: str | int
    ) -> None:
        """Write the store as a numpy ``.npz`` (no pickles); ``metadata`` (e.g. the tokenizer) and further named
        ``arrays`` (a drafter's other state, read back by :func:`load_arrays`) are kept beside it."""
        self.merge()
        extra = {f"meta_{key}": np.asarray(value) for key, value in metadata.items()}
        extra.update({f"array_{key}": np.asarray(value) for key, value in (arrays or {}).items()})
        with open(path, "wb") as handle:  # an explicit handle keeps numpy from appending ".npz"
            np.savez(
                handle, format=np.asarray(FORMAT), keys=self.keys, tokens=self.tokens, weights=self.weights,
                top_k=np.int64(self.top_k), max_pairs=np.int64(self.max_pairs), **extra,
            )

    @classmethod
    def load(cls, path: str | os.PathLike) -> tuple[TrigramStore, dict[str, str]]:
        """A saved store and its metadata (see :meth:`read`)."""
        store, metadata, _ = cls.read(path)
        return store, metadata

    @classmethod
    def read(cls, path: str | os.PathLike) -> tuple[TrigramStore, dict[str, str], dict[str, np.ndarray]]:
        """A saved store, its metadata and the further arrays saved beside it (:meth:`save`'s ``arrays``, by name).
        A file that is not one raises :class:`~draftwise.errors.InvalidRequestError` (a ``ValueError``) naming it
        and what is wrong."""
        data = read_npz(path, "tri-gram store")
        if "format" not in data or str(data["format"]) != FORMAT:
            raise InvalidRequestError(f"tri-gram store {path} is not a draftwise tri-gram store (one is written by "
                                      "`draftwise corpus build` or a drafter's saved state)")
        try:
            store = cls(top_k=int(data["top_k"]), max_pairs=int(data["max_pairs"]))
            store.keys, store.tokens, store.weights = data["keys"], data["tokens"], data["weights"]
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidRequestError(f"tri-gram store {path} is damaged ({error})") from None
        if store.tokens.shape != (len(store.keys), store.top_k) or store.weights.shape != store.tokens.shape:
            raise InvalidRequestError(f"tri-gram store {path} is damaged: its array shapes disagree")
        metadata = {key[5:]: str(data[key]) for key in data if key.startswith("meta_")}
        arrays = {key[len("array_"):]: data[key] for key in data if key.startswith("array_")}
        return store, metadata, arrays
