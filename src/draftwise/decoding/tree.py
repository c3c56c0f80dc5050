"""Draft trees: the shape every drafter proposes and the engine verifies in one forward pass.

A tree hangs below the *root*, the last token already emitted (it is not in the KV cache yet, so every step feeds it
as row 0). Draft nodes are numbered 0..n-1 in topological order (a parent always comes before its children);
``parents[i]`` is the node index of node ``i``'s parent, or ``-1`` for a child of the root. In the verification
forward, node ``i`` is row ``i + 1``.

A chain is a tree in which every node has at most one child. The empty tree is plain autoregressive decoding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..backend.rows import CACHE, RowBlock, ancestor_matrix

ROOT = -1


def prefix_scores(scored_paths: Iterable[tuple[Sequence[float], Sequence[int]]]) -> dict[tuple[int, ...], float]:
    """The score of every token prefix of ``scored_paths``, in the order first reached (see
    :meth:`DraftTree.from_scored_paths`)."""
    score: dict[tuple[int, ...], float] = {}
    for probabilities, path in scored_paths:
        prefix: tuple[int, ...] = ()
        reach = 1.0
        for probability, token in zip(probabilities, path):
            prefix = (*prefix, int(token))
            reach *= float(probability)
            score[prefix] = max(score.get(prefix, 0.0), reach)
    return score


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens arranged as a tree below the root.

    Attributes:
        tokens: token id of each node.
        parents: parent node index of each node (``-1`` = the root); parents precede children.
        scores: optional estimate, per node, of the probability that the path down to it is accepted; it lets the
            engine size each step's draft against the cost of verifying it. ``None`` means "verify everything".
        draft_probs: for drafts sampled from a draft model, the draft distribution ``q`` at every row (row 0 = the
            root, row ``i + 1`` = node ``i``; shape ``(len + 1, vocab)``): the children of a row were drawn from its
            ``q``, without replacement. Sampling then verifies by rejection sampling against ``q``
            (:func:`~draftwise.decoding.verify.verify_probabilistic`); ``None`` means point-mass (deterministic)
            drafts.
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    scores: tuple[float, ...] | None = None
    draft_probs: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _children: dict[tuple[int, int], int] = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]
    _depths: tuple[int, ...] = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]
    _with_children: frozenset[int] = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or (self.scores is not None and len(self.scores) != len(self.tokens)):
            raise ValueError("tokens, parents and scores must have the same length")
        children: dict[tuple[int, int], int] = {}
        depths: list[int] = []
        for node, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if not ROOT <= parent < node:
                raise ValueError(f"node {node} has parent {parent}: parents must precede their children")
            if (parent, token) in children:
                raise ValueError(f"node {node} repeats token {token} under parent {parent}")
            children[(parent, token)] = node
            depths.append(1 if parent == ROOT else depths[parent] + 1)
            if self.scores is not None and parent != ROOT and self.scores[node] > self.scores[parent]:
                raise ValueError(
                    f"node {node} scores {self.scores[node]} above its parent's {self.scores[parent]}: a path's "
                    "acceptance probability cannot grow with depth"
                )
        if self.draft_probs is not None and (self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != len(self) + 1):
            raise ValueError("draft_probs needs one distribution per row: shape (len(tree) + 1, vocab)")
        object.__setattr__(self, "_children", children)
        object.__setattr__(self, "_depths", tuple(depths))
        object.__setattr__(self, "_with_children", frozenset(self.parents))

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """A single path of draft tokens."""
        tokens = tuple(int(token) for token in tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]], budget: int | None = None) -> DraftTree:
        """Merge paths into a trie, in the given order, keeping at most ``budget`` nodes.

        Earlier paths are preferred: nodes are added path by path, and a path is cut where the budget runs out.
        """
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}
        for path in paths:
            parent = ROOT
            for token in path:
                token = int(token)
                node = children.get((parent, token))
                if node is None:
                    if budget is not None and len(tokens) >= budget:
                        break
                    node = len(tokens)
                    children[(parent, token)] = node
                    tokens.append(token)
                    parents.append(parent)
                parent = node
        return cls(tuple(tokens), tuple(parents))

    @classmethod
    def from_scored_paths(
        cls, scored_paths: Iterable[tuple[Sequence[float], Sequence[int]]], budget: int | None = None
    ) -> DraftTree:
        """Build the most promising tree of at most ``budget`` nodes from paths with per-token probabilities.

        Each path comes with the estimated probability that each of its tokens is accepted given the ones before
        it. A node's score is the best probability, over the paths through it, that the whole prefix up to it is
        accepted; scores never grow along a path, so the ``budget`` best nodes always form a tree. Ties go to the
        shallower node, then to the earlier path. The tree keeps the scores (see :meth:`best`).
        """
        return cls.from_prefix_scores(prefix_scores(scored_paths), budget)

    @classmethod
    def from_prefix_scores(cls, scores: dict[tuple[int, ...], float], budget: int | None = None) -> DraftTree:
        """The ``budget`` best-scoring token paths of ``scores`` as a tree (ties go to the shallower path, then to the
        earlier one in ``scores``' order). Every prefix of a path must be in ``scores`` with a score at least as high,
        so that the best paths form a tree."""
        order = {prefix: position for position, prefix in enumerate(scores)}
        ranked = sorted(scores, key=lambda prefix: (-scores[prefix], len(prefix), order[prefix]))
        if budget is not None:
            ranked = ranked[: max(budget, 0)]
        # Parents precede children once sorted by depth.
        ranked.sort(key=lambda prefix: (len(prefix), order[prefix]))
        index = {prefix: node for node, prefix in enumerate(ranked)}
        return cls(
            tuple(prefix[-1] for prefix in ranked),
            tuple(index[prefix[:-1]] if len(prefix) > 1 else ROOT for prefix in ranked),
            tuple(scores[prefix] for prefix in ranked),
        )

    def best(self, count: int) -> DraftTree:
        """The sub-tree of the ``count`` highest-scoring nodes (the first ``count`` nodes when unscored)."""
        if count >= len(self.tokens):
            return self
        if self.scores is None:
            return self.cut(budget=count)
        ranked = sorted(range(len(self.tokens)), key=lambda node: (-self.scores[node], self._depths[node], node))
        return self._subtree(sorted(ranked[: max(count, 0)]))

    def best_path(self) -> DraftTree:
        """The root-to-leaf chain of the most expected accepted tokens: the greatest sum of scores along it (each
        node's score is the chance it is accepted), ties to the deeper path, then the earlier node; of an unscored
        tree, the deepest path."""
        scores = self.scores if self.scores is not None else (1.0,) * len(self.tokens)
        # Children come after their parents: one pass from the last node up gives each node the best path below it,
        # as (sum of scores, depth, -first node): the greatest wins, so ties go to the deeper path, then the earlier.
        below: list[tuple[float, int, int]] = [(0.0, 0, 1)] * (len(self.tokens) + 1)  # by node; the root's last
        for node in range(len(self.tokens) - 1, -1, -1):
            total, depth, _ = below[node]
            below[self.parents[node]] = max(below[self.parents[node]], (scores[node] + total, depth + 1, -node))
        path: list[int] = []
        node = -below[ROOT][2]
        while node >= 0:
            path.append(node)
            node = -below[node][2]
        return self if len(path) == len(self.tokens) else self._subtree(path)

    def _subtree(self, keep: Sequence[int]) -> DraftTree:
        """The nodes ``keep`` (ascending, closed under parents), renumbered."""
        index = {node: new for new, node in enumerate(keep)}
        return DraftTree(
            tuple(self.tokens[node] for node in keep),
            tuple(ROOT if self.parents[node] == ROOT else index[self.parents[node]] for node in keep),
            None if self.scores is None else tuple(self.scores[node] for node in keep),
            None if self.draft_probs is None else self.draft_probs[[0, *(node + 1 for node in keep)]],
        )

    @property
    def is_chain(self) -> bool:
        """Whether no node has two children (the empty tree is a chain)."""
        return len(self._with_children) == len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node (a child of the root has depth 1)."""
        return self._depths

    @property
    def max_depth(self) -> int:
        return max(self._depths, default=0)

    def child(self, parent: int, token: int) -> int | None:
        """The node below ``parent`` that carries ``token``, if any."""
        return self._children.get((parent, token))

    def has_children(self, parent: int) -> bool:
        """Whether ``parent`` (a node, or ``ROOT``) has a child."""
        return parent in self._with_children

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def cut(self, budget: int | None = None, max_depth: int | None = None) -> DraftTree:
        """The sub-tree of at most ``budget`` nodes (first in order) and depth at most ``max_depth``."""
        keep = [
            node
            for node, depth in enumerate(self._depths)
            if max_depth is None or depth <= max_depth
        ]
        if budget is not None:
            keep = keep[: max(budget, 0)]
        if len(keep) == len(self.tokens):
            return self
        return self._subtree(keep)

    @property
    def row_parents(self) -> tuple[int, ...]:
        """Parents of the verification forward's rows (row 0 = the root follows the cache, row ``i + 1`` = node
        ``i``)."""
        return (CACHE, *(parent + 1 for parent in self.parents))

    def rows(self, root: int) -> RowBlock:
        """The rows of the forward that verifies this tree below ``root``."""
        return RowBlock((int(root), *self.tokens), self.row_parents)

    def row_tokens(self, root: int) -> list[int]:
        """The token at every row: ``root``, then each node's."""
        return [int(root), *self.tokens]

    def row_previous(self, root: int, before: int | None) -> list[int | None]:
        """The token before every row's token along its path: ``before`` (the token before the root, ``None`` if
        unknown) for the root, the parent's token for a node."""
        return [before, *(root if parent == ROOT else self.tokens[parent] for parent in self.parents)]

    def ancestor_matrix(self) -> np.ndarray:
        """Boolean matrix over rows (root + nodes): ``m[i, j]`` when row ``j`` is row ``i`` or one of its ancestors."""
        return ancestor_matrix(self.row_parents)
