"""REST (retrieval-based speculative decoding, He et al. 2024): draft what followed the context's longest suffix in a
datastore, counting the continuations of many occurrences into a trie of the most frequent.

Each step looks up the longest suffix of the context (``max_suffix`` down to ``min_suffix`` tokens) that occurs in the
datastore (:class:`~draftwise.datastore.Datastore`, a suffix array over a corpus), reads the next ``depth`` tokens after
up to ``max_matches`` of its occurrences, counts them into a trie and keeps the ``max_nodes`` most frequent paths.
The sequence being generated (prompt and output so far) is searched the same way (scanned directly, it is short):
the context is often the best place to retrieve from (summaries, edits, code), and it keeps the drafter useful with
no datastore at all.

Every node is scored with its estimated acceptance probability: the product, along its path, of each token's share
among its siblings (how often the corpus continued that way) and the rate at which the trie holds the model's token at
that depth, learned from the emitted tokens per source and match length; so the engine verifies only the part of the
trie that pays for itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..decoding.drafter import Drafter, StepOutcome
from ..decoding.tree import ROOT, DraftTree
from .stores.acceptance import AcceptanceTracker
from .stores.datastore import Datastore, context_continuations, continuation_trie

Prefix = tuple[int, ...]
#: What acceptance is learned per: the source ("datastore" or "context") and the matched suffix length's bucket.
Kind = tuple[str, int]
#: Matched suffix lengths are bucketed from these lower bounds: a longer match predicts better.
MATCH_LENGTH_BUCKETS = (1, 2, 3, 5, 9)


def match_length_bucket(length: int) -> int:
    """Index of the last bucket of :data:`MATCH_LENGTH_BUCKETS` whose lower bound ``length`` reaches."""
    return sum(length >= bound for bound in MATCH_LENGTH_BUCKETS) - 1


class RestDrafter(Drafter):
    """Draft from the continuations of the context's longest suffix in a datastore and in the context itself.

    Args:
        datastore: a :class:`~draftwise.datastore.Datastore`, the path of one saved by ``draftwise datastore build``,
            or ``None`` to retrieve from the context only. Loading takes a moment: build the drafter once
            (:func:`~draftwise.drafters.make_drafter`) and pass it to successive ``generate`` calls.
        context: also retrieve from the sequence being generated (prompt and output).
        max_suffix: longest context suffix looked up.
        min_suffix: shortest context suffix looked up (a single token still finds the corpus's most frequent
            continuations of it; their scores keep the engine from verifying more of them than pays).
        max_matches: occurrences whose continuations are counted (evenly spread over all of them).
        max_nodes: trie nodes kept per source (the most frequent).
        depth: continuation tokens read per occurrence (the trie's depth).
    """

    name = "rest"

    def __init__(
        self,
        datastore: Datastore | str | os.PathLike | None = None,
        context: bool = True,
        max_suffix: int = 16,
        min_suffix: int = 1,
        max_matches: int = 256,
        max_nodes: int = 64,
        depth: int = 10,
    ) -> None:
        if not 1 <= min_suffix <= max_suffix:
            raise ValueError(f"need 1 <= min_suffix <= max_suffix, got {min_suffix} and {max_suffix}")
        if max_matches < 1 or max_nodes < 1 or depth < 1:
            raise ValueError("max_matches, max_nodes and depth must be positive")
        if datastore is None and not context:
            raise ValueError("with context=false a datastore is needed: there is nothing else to retrieve from")
        if datastore is not None and not isinstance(datastore, Datastore):
            datastore = Datastore.load(datastore)
        self.datastore: Datastore | None = datastore
        self.context = bool(context)
        self.max_suffix = max_suffix
        self.min_suffix = min_suffix
        self.max_matches = max_matches
        self.max_nodes = max_nodes
        self.depth = depth
        #: Per kind and depth: how often the model's next token is in the trie, given that the tokens before it were.
        self.acceptance = AcceptanceTracker()
        # The last proposal's tries, one per source, with their kind: each node's child tokens, by its token path.
        self._tries: list[tuple[Kind, dict[Prefix, list[int]]]] = []

    def reset(self, prompt: Sequence[int]) -> None:
        if self.datastore is not None:
            self.datastore.check_token_ids(prompt)

    def _own_sequence_state(self) -> None:
        self._tries = []

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        candidates: dict[Prefix, float] = {}
        self._tries = []
        if self.datastore is not None:
            length, low, high = self.datastore.longest_match(context, self.min_suffix, self.max_suffix)
            if length:
                rows = self.datastore.continuations(low, high, length, self.depth, self.max_matches)
                self._add_trie(candidates, "datastore", match_length_bucket(length), rows)
        if self.context:
            length, rows = context_continuations(context, self.min_suffix, self.max_suffix, self.depth, self.max_matches)
            if length:
                self._add_trie(candidates, "context", match_length_bucket(length), rows)
        return DraftTree.from_prefix_scores(candidates, budget)

    def _add_trie(self, candidates: dict[Prefix, float], source: str, length_bucket: int, rows: np.ndarray) -> None:
        """Score the most frequent nodes of the continuation trie of ``rows`` and merge them into ``candidates``
        (a node found in both sources keeps its better score)."""
        tokens, parents, counts, depths = continuation_trie(rows)
        if not len(tokens):
            return
        # The most frequent nodes, most frequent first; a child never outnumbers its parent and ties go to the
        # shallower node, so they form a tree and every parent comes before its children.
        keep = np.lexsort((np.arange(len(tokens)), depths, -counts))[: self.max_nodes]
        total = int(counts[depths == 1].sum())
        prefixes: dict[int, Prefix] = {}
        scores: dict[int, float] = {}
        trie: dict[Prefix, list[int]] = {}
        hit_rates = self.acceptance.estimates((source, length_bucket), self.depth)
        for node in keep.tolist():
            parent = int(parents[node])
            parent_prefix = prefixes[parent] if parent != ROOT else ()
            share = int(counts[node]) / (total if parent == ROOT else int(counts[parent]))
            prefix = (*parent_prefix, int(tokens[node]))
            score = (scores[parent] if parent != ROOT else 1.0) * hit_rates[int(depths[node]) - 1] * share
            prefixes[node], scores[node] = prefix, score
            trie.setdefault(parent_prefix, []).append(prefix[-1])
            candidates[prefix] = max(candidates.get(prefix, 0.0), score)
        self._tries.append(((source, length_bucket), trie))

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from the tokens the model emitted, against the whole of each trie (not just the verified part, so
        learning goes on even when the engine verifies nothing): at each depth the emitted path reaches in a trie,
        whether the trie holds the model's token there."""
        emitted = outcome.verification.tokens
        for kind, trie in self._tries:
            prefix: Prefix = ()
            for depth, token in enumerate(emitted, 1):
                children = trie.get(prefix)
                if not children:
                    break
                self.acceptance.update_one(kind, depth, token in children)
                if token not in children:
                    break
                prefix = (*prefix, token)
        self._tries = []
