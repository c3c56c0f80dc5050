"""Suffix decoding: frequency-scored draft trees from every earlier occurrence of the context's longest matching
suffix, in the request itself and in earlier requests' outputs (after Suffix Decoding, Arctic Inference).

Two indexes answer "where did the context's last tokens occur before, and what followed?":

- the request's own (prompt and output), rebuilt per sequence;
- a global one over the outputs of earlier sequences (the most recent ``max_global_outputs``; the oldest are dropped
  together when the bound is passed), shared by every fork of the drafter, so that a server's requests learn from
  each other (agent loops and edits repeat earlier answers).

For each index the longest suffix of the context (up to ``max_ngram`` tokens, then extended backwards up to
``max_match`` to measure it) with earlier occurrences is looked up; the continuations of its most recent
``max_occurrences`` occurrences are merged into a tree whose nodes carry counts, and each node's conditional
probability is its share of its parent's occurrences. Nodes under ``min_token_prob`` are dropped, and the tree is
``spec_factor`` times as deep as the match is long (at least ``min_depth``): a long match says the text is being
repeated, a short one says little. A node's score is the product of its path's shares, weighted by the acceptance
this drafter has measured for its kind (index, match length) at its depth, so the engine verifies what pays. Of the
two trees the one expected to give more tokens is proposed.

Updates are incremental: a step indexes only the tokens it added (a few dictionary appends per n-gram length).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..decoding.drafter import Drafter, StepOutcome
from ..decoding.tree import DraftTree
from .stores.acceptance import AcceptanceTracker
from .stores.ngram import NGramIndex

#: Separates earlier outputs in the global index: no token id is negative, so nothing matches across it.
_SEPARATOR = -1


class SuffixDrafter(Drafter):
    """Draft from the continuations of the context's longest earlier suffix match, scored by their frequency.

    Args:
        max_ngram: longest suffix looked up directly (longer matches are measured by extending it backwards).
        max_match: longest match measured (it sets the draft's depth).
        max_occurrences: most recent occurrences whose continuations are merged.
        spec_factor: draft depth per matched token.
        min_depth: draft depth of the shortest matches.
        max_depth: deepest draft.
        min_token_prob: nodes whose share of their parent's occurrences is lower are dropped.
        max_global_outputs: earlier outputs kept in the global index (0: no global index).
    """

    name = "suffix"

    def __init__(
        self,
        max_ngram: int = 8,
        max_match: int = 64,
        max_occurrences: int = 32,
        spec_factor: float = 1.0,
        min_depth: int = 2,
        max_depth: int = 32,
        min_token_prob: float = 0.1,
        max_global_outputs: int = 256,
    ) -> None:
        if not 1 <= max_ngram <= max_match:
            raise ValueError("need 1 <= max_ngram <= max_match")
        if max_occurrences < 1 or not 1 <= min_depth <= max_depth or spec_factor <= 0:
            raise ValueError("need max_occurrences >= 1, 1 <= min_depth <= max_depth and spec_factor > 0")
        if not 0.0 <= min_token_prob <= 1.0 or max_global_outputs < 0:
            raise ValueError("need 0 <= min_token_prob <= 1 and max_global_outputs >= 0")
        self.max_ngram = max_ngram
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self.spec_factor = spec_factor
        self.min_depth = min_depth
        self.max_depth = max_depth
        self.min_token_prob = min_token_prob
        self.max_global_outputs = max_global_outputs
        self.acceptance = AcceptanceTracker()
        # Shared by forks: earlier outputs and their index (rebuilt when the oldest half is dropped).
        self._global = _GlobalOutputs(max_ngram, max_global_outputs)
        self._own_sequence_state()

    def _own_sequence_state(self) -> None:
        self.index = NGramIndex(1, self.max_ngram)
        self._kind: tuple[str, int] | None = None

    def reset(self, prompt: Sequence[int]) -> None:
        self.index = NGramIndex(1, self.max_ngram)
        self._kind = None

    def finish(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        if self.max_global_outputs and output:
            self._global.add(output)

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        self.index.extend(context)
        best: tuple[float, dict[tuple[int, ...], float], tuple[str, int]] | None = None
        sources = [("request", context, self.index)]
        if self._global.index is not None:
            sources.append(("global", self._global.tokens, self._global.index))
        for source, tokens, index in sources:
            found = self._scores(source, tokens, index, context)
            if found is not None and (best is None or found[0] > best[0]):
                best = found
        if best is None:
            self._kind = None
            return DraftTree()
        _, scores, self._kind = best
        return DraftTree.from_prefix_scores(scores, budget)

    def observe(self, outcome: StepOutcome) -> None:
        if self._kind is not None and len(outcome.tree):
            self.acceptance.update(self._kind, outcome.verification.attempted, outcome.verification.accepted)

    # ------------------------------------------------------------------------------------------------ drafting

    def _scores(self, source: str, tokens: Sequence[int], index: NGramIndex, query: Sequence[int]
                ) -> tuple[float, dict[tuple[int, ...], float], tuple[str, int]] | None:
        """The scored tree of the continuations in ``tokens`` (indexed by ``index``) of ``query``'s longest suffix
        found there: ``(expected tokens, path scores, kind)``, or ``None`` without a match."""
        n, ends = index.longest(query)
        if not ends:
            return None
        ends = ends[: self.max_occurrences]
        match = max(self._match_length(tokens, end, query, n) for end in ends[:4])
        depth = min(self.max_depth, max(self.min_depth, math.ceil(self.spec_factor * match)))
        counts: dict[tuple[int, ...], int] = {}
        for end in ends:
            path: tuple[int, ...] = ()
            for token in tokens[end : end + depth]:
                if token == _SEPARATOR:
                    break
                path = (*path, int(token))
                counts[path] = counts.get(path, 0) + 1
        if not counts:
            return None
        kind = (source, min(match, 8))
        rates = self.acceptance.estimates(kind, depth)
        scores: dict[tuple[int, ...], float] = {}
        shares: dict[tuple[int, ...], float] = {(): 1.0}
        for path, count in counts.items():  # (a path's prefixes come first: insertion order)
            parent = path[:-1]
            if parent not in shares:
                continue
            share = count / (counts[parent] if parent else len(ends))
            if share < self.min_token_prob:
                continue
            shares[path] = shares[parent] * share
            scores[path] = shares[path] * math.prod(rates[: len(path)])
        if not scores:
            return None
        return sum(scores.values()), scores, kind

    def _match_length(self, tokens: Sequence[int], end: int, query: Sequence[int], n: int) -> int:
        """How many tokens before ``end`` in ``tokens`` equal the end of ``query`` (at least ``n``, at most
        :attr:`max_match`)."""
        length = n
        while (length < self.max_match and length < end and length < len(query)
               and tokens[end - length - 1] == query[len(query) - length - 1]
               and tokens[end - length - 1] != _SEPARATOR):
            length += 1
        return length


class _GlobalOutputs:
    """Earlier outputs, separated, and their n-gram index; at most ``limit`` of them (the oldest half dropped and the
    index rebuilt when it is passed)."""

    def __init__(self, max_ngram: int, limit: int) -> None:
        self.max_ngram = max_ngram
        self.limit = limit
        self.outputs: list[tuple[int, ...]] = []
        self.tokens: list[int] = []
        self.index: NGramIndex | None = None

    def add(self, output: Sequence[int]) -> None:
        self.outputs.append(tuple(int(token) for token in output))
        if len(self.outputs) > self.limit:
            self.outputs = self.outputs[len(self.outputs) - max(1, self.limit // 2):]
            self.tokens, self.index = [], None
            for kept in self.outputs:
                self.tokens += [*kept, _SEPARATOR]
        else:
            self.tokens += [*self.outputs[-1], _SEPARATOR]
        if self.index is None:
            self.index = NGramIndex(1, self.max_ngram)
        self.index.extend(self.tokens)
