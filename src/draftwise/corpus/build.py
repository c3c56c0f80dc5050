"""Offline corpus builders: REST's retrieval datastore and ADED's tri-gram store, from corpus sources.

Both read documents from :mod:`draftwise.corpus.sources` (and optionally the model's own answers,
:mod:`draftwise.corpus.selfgen`), tokenize them with the target model's tokenizer and save what the drafters load
at run time (:class:`~draftwise.drafters.stores.datastore.Datastore`,
:class:`~draftwise.drafters.stores.trigram.TrigramStore`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..drafters.stores.datastore import DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT, Datastore, tokenizer_identity
from ..drafters.stores.trigram import BACKOFF, TrigramStore, pack_pairs
from ..errors import InvalidRequestError
from .selfgen import read_prompt_file, self_generated_documents
from .sources import documents, source_documents, tokenize_documents


def gather_tokens(
    tokenizer: Any,
    texts: Iterable[str],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    on_progress: Callable[[int], None] | None = None,
) -> list[np.ndarray]:
    """Token arrays of ``texts`` (no special tokens), ``max_tokens`` in all at most.

    Args:
        tokenizer: the target model's tokenizer.
        texts: documents, for example :func:`draftwise.sources.documents` of some source specs.
        max_tokens: bound on the corpus size (a datastore takes 8 bytes per token on disk).
        on_progress: called with the number of tokens gathered so far after every tokenized piece.
    """
    if not isinstance(max_tokens, int) or not 0 < max_tokens <= MAX_TOKENS_LIMIT:
        raise InvalidRequestError(f"max_tokens must be between 1 and {MAX_TOKENS_LIMIT}, got {max_tokens!r}")
    pieces: list[np.ndarray] = []
    gathered = 0
    for piece in tokenize_documents(tokenizer, texts, max_tokens):
        pieces.append(piece)
        gathered += len(piece)
        if on_progress is not None:
            on_progress(gathered)
    if not gathered:
        raise InvalidRequestError("the sources hold no text to index")
    return pieces


def build_datastore(
    tokenizer: Any,
    texts: Iterable[str],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    on_progress: Callable[[int], None] | None = None,
    on_sorting: Callable[[], None] | None = None,
) -> Datastore:
    """Tokenize ``texts`` into at most ``max_tokens`` corpus tokens and index them (see :func:`gather_tokens`;
    ``on_sorting`` is called before the suffix sort, the slow part)."""
    pieces = gather_tokens(tokenizer, texts, max_tokens, on_progress)
    if on_sorting is not None:
        on_sorting()
    return Datastore.from_documents(pieces, **tokenizer_identity(tokenizer))


class TrigramCounter:
    """Counts the tri-grams of many token arrays in bounded memory (sorted unique codes, merged in batches)."""

    def __init__(self, batch_tokens: int = 8_000_000) -> None:
        self.batch_tokens = batch_tokens
        self._pending: list[np.ndarray] = []
        self._pending_size = 0
        self._pairs = np.empty(0, dtype=np.int64)  # packed (a, b), sorted, with their successors beside them
        self._successors = np.empty(0, dtype=np.int32)
        self._counts = np.empty(0, dtype=np.int64)
        self.tokens_seen = 0

    @classmethod
    def of(cls, documents: Iterable[np.ndarray], on_progress: Callable[[int], None] | None = None) -> TrigramCounter:
        """A counter of every token array in ``documents`` (``on_progress`` gets the tokens counted so far)."""
        counter = cls()
        for ids in documents:
            counter.add(ids)
            if on_progress is not None:
                on_progress(counter.tokens_seen)
        return counter

    def add(self, ids: np.ndarray) -> None:
        """Count the tri-grams (and the bi-grams, for back-off) of one document; none spans two documents."""
        ids = np.asarray(ids, dtype=np.int64)
        self.tokens_seen += len(ids)
        if len(ids) < 2:
            return
        self._pending.append(np.stack([np.full(len(ids) - 1, BACKOFF), ids[:-1], ids[1:]], axis=1))
        self._pending.append(np.stack([ids[:-2], ids[1:-1], ids[2:]], axis=1))
        self._pending_size += 2 * len(ids) - 3
        if self._pending_size >= self.batch_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        triples = np.concatenate(self._pending)
        self._pending, self._pending_size = [], 0
        pairs = pack_pairs(triples[:, 0], triples[:, 1])
        successors = triples[:, 2]
        pairs = np.concatenate([self._pairs, pairs])
        successors = np.concatenate([self._successors.astype(np.int64), successors])
        counts = np.concatenate([self._counts, np.ones(len(triples), dtype=np.int64)])
        order = np.lexsort((successors, pairs))
        pairs, successors, counts = pairs[order], successors[order], counts[order]
        starts = np.flatnonzero(np.r_[True, (pairs[1:] != pairs[:-1]) | (successors[1:] != successors[:-1])])
        self._pairs = pairs[starts]
        self._successors = successors[starts].astype(np.int32)
        self._counts = np.add.reduceat(counts, starts)

    def counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Unique ``(pairs, successors, counts)`` of everything added."""
        self._flush()
        return self._pairs, self._successors, self._counts

    def store(self, top_k: int = 12, max_pairs: int = 4_000_000) -> TrigramStore:
        return TrigramStore.from_counts(*self.counts(), top_k=top_k, max_pairs=max_pairs)


def check_sources(sources: Sequence[str], self_generate: str | None) -> list[str | list[dict]]:
    """Refuse unknown or benchmark sources before any slow work; returns the self-generation prompts (if any)."""
    if not sources and self_generate is None:
        raise InvalidRequestError("give at least one source (a path, stdlib, package-docs or sharegpt) or --self-generate")
    for spec in sources:
        source_documents(spec)  # refuses unknown and benchmark sources without reading them
    return read_prompt_file(self_generate) if self_generate is not None else []


def corpus_texts(
    model: Any, tokenizer: Any, sources: Sequence[str], prompts: Sequence[str | list[dict]], max_new_tokens: int
) -> Iterator[str]:
    """The texts of a corpus: the model's own answers to ``prompts`` first, then the documents of ``sources``."""
    if tokenizer is None:
        raise InvalidRequestError("the model has no tokenizer to build a corpus with")
    return itertools.chain(
        self_generated_documents(model, tokenizer, prompts, max_new_tokens) if prompts else (),
        documents(sources) if sources else (),
    )


#: Defaults of ``draftwise corpus build`` (and :func:`write_trigram_store`): tokens counted at most, successors kept
#: per token pair, token pairs kept.
TRIGRAM_MAX_TOKENS = 50_000_000
TRIGRAM_TOP_K = 12
TRIGRAM_MAX_PAIRS = 4_000_000
#: Tokens of each of the model's own answers that ``--self-generate`` adds to a corpus, unless told otherwise.
SELF_GENERATED_TOKENS = 256


def write_datastore(
    tokenizer: Any,
    texts: Iterable[str],
    out: str | os.PathLike,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    on_progress: Callable[[int], None] | None = None,
    on_sorting: Callable[[], None] | None = None,
) -> Datastore:
    """Tokenize ``texts``, index them and save the datastore to ``out`` (``on_sorting`` is called before the
    suffix sort, the slow part)."""
    datastore = build_datastore(tokenizer, texts, max_tokens, on_progress, on_sorting)
    datastore.save(out)
    return datastore


def write_trigram_store(
    tokenizer: Any,
    texts: Iterable[str],
    out: str | os.PathLike,
    max_tokens: int = TRIGRAM_MAX_TOKENS,
    top_k: int = TRIGRAM_TOP_K,
    max_pairs: int = TRIGRAM_MAX_PAIRS,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[TrigramStore, int]:
    """Count the tri-grams of ``texts`` (at most ``max_tokens`` tokens) into a store of the ``top_k`` strongest
    successors of at most ``max_pairs`` pairs, and save it to ``out``; returns the store and the tokens counted."""
    if top_k <= 0 or max_pairs <= 0:
        raise InvalidRequestError("top_k and max_pairs must be positive")
    counter = TrigramCounter.of(tokenize_documents(tokenizer, texts, max_tokens), on_progress)
    store = counter.store(top_k=top_k, max_pairs=max_pairs)
    store.save(out, tokenizer=getattr(tokenizer, "name_or_path", "") or "", tokens=counter.tokens_seen)
    return store, counter.tokens_seen
