"""The model's own recent predictions as a draft source: Token Recycling's adjacency matrix, shared by every drafter
that recycles them (``recycling`` itself, and ``aded`` beside its tri-gram search).

Every verification forward computes the model's distribution at every row, rejected rows included; the top-k tokens
of each row are what the model most likely emits after that row's token. :class:`SuccessorMatrix` keeps, per token,
the latest such top-k, and fills a tree template from them breadth first (the root's children are ``M[root]``, their
children ``M[child]``, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...decoding.verify import top_tokens

#: Matrix entry of a token whose successors were never seen.
EMPTY = -1


def rank_template(depth: int, rank_budget: int, width: int) -> list[tuple[int, ...]]:
    """Tree template as rank paths: every path of up to ``depth`` ranks (each < ``width``) whose ranks sum to at most
    ``rank_budget``. Wider where candidates rank higher, as the published templates are. Parents come first."""
    paths: list[tuple[int, ...]] = []
    frontier: list[tuple[int, ...]] = [()]
    for _ in range(depth):
        frontier = [
            (*path, rank)
            for path in frontier
            for rank in range(width)
            if sum(path) + rank <= rank_budget
        ]
        paths.extend(frontier)
    return paths


class SuccessorMatrix:
    """Per token, the model's latest top-k next tokens (``EMPTY`` where none was seen yet); optionally also per pair
    of tokens, which tells apart what follows a token in different places (``"of" -> "the"`` vs ``"one of" ->
    "them"``) and is preferred where known.

    Args:
        top_k: successors kept per token.
        vocab_size: rows to allocate up front; the matrix grows on demand otherwise.
        pair_capacity: most token pairs remembered (the least recently updated go first); 0 keys by single tokens
            only, as published.
    """

    def __init__(self, top_k: int, vocab_size: int | None = None, pair_capacity: int = 0) -> None:
        if top_k < 1 or pair_capacity < 0:
            raise ValueError("need top_k >= 1 and pair_capacity >= 0")
        self.top_k = top_k
        self.matrix = np.full((vocab_size or 0, top_k), EMPTY, dtype=np.int32)
        self.pair_capacity = pair_capacity
        self.pairs: dict[tuple[int, int], tuple[int, ...]] = {}
        self._template_parents: tuple[Sequence[tuple[int, ...]], list[int]] | None = None

    def _ensure_rows(self, rows: int) -> None:
        if rows > self.matrix.shape[0]:
            grown = np.full((rows, self.top_k), EMPTY, dtype=np.int32)
            grown[: self.matrix.shape[0]] = self.matrix
            self.matrix = grown

    def record(
        self,
        row_tokens: Sequence[int],
        top: np.ndarray,
        vocab_size: int = 0,
        previous_tokens: Sequence[int | None] | None = None,
    ) -> None:
        """Set the successors of each of ``row_tokens`` to the matching row of ``top`` (later rows win ties).
        ``vocab_size`` lets the matrix grow to the whole vocabulary at once; ``previous_tokens`` (the token before
        each row's, ``None`` if unknown) also records them per pair when pairs are kept."""
        self._ensure_rows(max(max(row_tokens) + 1, vocab_size))
        top = top[:, : self.top_k]
        self.matrix[np.asarray(row_tokens)] = top
        if self.pair_capacity and previous_tokens is not None:
            for before, token, successors in zip(previous_tokens, row_tokens, top.tolist()):
                if before is not None:
                    key = (int(before), int(token))
                    self.pairs.pop(key, None)  # re-inserted last: the dict's order is the recency order
                    self.pairs[key] = tuple(successors)
            while len(self.pairs) > self.pair_capacity:
                del self.pairs[next(iter(self.pairs))]

    def observe(self, row_tokens: Sequence[int], previous_tokens: Sequence[int | None], logits: torch.Tensor) -> np.ndarray:
        """Record the model's top-k prediction at every row of a verification forward (rejected rows too: their
        predictions are still the model's) as the successors of that row's token; returns the top-k tokens per row.

        ``row_tokens`` and ``previous_tokens`` are the token at each row and the one before it (see
        :meth:`~draftwise.decoding.tree.DraftTree.row_tokens` and :meth:`~draftwise.decoding.tree.DraftTree.row_previous`).
        """
        rows = logits[: len(row_tokens)]
        top = top_tokens(rows, self.top_k).cpu().numpy()
        self.record(row_tokens, top, rows.shape[-1], previous_tokens)
        return top

    def _row(self, before: int | None, token: int) -> Sequence[int]:
        if self.pairs and before is not None:
            row = self.pairs.get((before, token))
            if row is not None:
                return row
        return self.matrix[token].tolist() if token < self.matrix.shape[0] else ()

    def fill(
        self, root: int, template: Sequence[tuple[int, ...]], before: int | None = None
    ) -> list[tuple[tuple[int, ...], int, int]]:
        """Fill ``template`` below ``root`` (preceded by ``before``, if known): ``(ranks, token, parent)`` per node,
        parents first (``parent`` indexes this list, -1 = the root). A slot whose parent is missing, whose entry is
        empty or whose token repeats a sibling is skipped."""
        nodes: list[tuple[tuple[int, ...], int, int]] = []
        node_of_slot: list[int] = []  # by template slot: its node, -2 when skipped
        siblings: set[tuple[int, int]] = set()
        rows: dict[int, Sequence[int]] = {-1: self._row(before, root)}
        for ranks, parent_slot in zip(template, self._parent_slots(template)):
            parent = parent_slot if parent_slot < 0 else node_of_slot[parent_slot]
            node_of_slot.append(-2)
            if parent == -2:
                continue
            row = rows.get(parent)
            if row is None:
                grandparent = nodes[parent][2]
                row = rows[parent] = self._row(root if grandparent == -1 else nodes[grandparent][1], nodes[parent][1])
            if ranks[-1] >= len(row):
                continue
            token = int(row[ranks[-1]])
            if token == EMPTY or (parent, token) in siblings:
                continue
            siblings.add((parent, token))
            node_of_slot[-1] = len(nodes)
            nodes.append((ranks, token, parent))
        return nodes

    def _parent_slots(self, template: Sequence[tuple[int, ...]]) -> list[int]:
        """Each template slot's parent slot (-1 below the root, -2 when its parent path is not listed before it: never
        filled), worked out once per template: every step fills the same one."""
        cached = self._template_parents
        if cached is None or cached[0] is not template:
            first_slot: dict[tuple[int, ...], int] = {}
            parents = []
            for slot, ranks in enumerate(template):
                parents.append(-1 if len(ranks) == 1 else first_slot.get(ranks[:-1], -2))
                first_slot.setdefault(ranks, slot)
            cached = self._template_parents = (template, parents)
        return cached[1]

    def state(self) -> dict[str, np.ndarray]:
        """The learned state as arrays (for ``.npz`` files): the matrix, and the pairs with their successors."""
        keys = np.asarray(list(self.pairs), dtype=np.int64).reshape(-1, 2)
        values = np.asarray(list(self.pairs.values()), dtype=np.int32).reshape(-1, self.top_k)
        return {"matrix": self.matrix, "pair_keys": keys, "pair_successors": values}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore :meth:`state` (pairs are optional: files of the single-token matrix alone load too)."""
        self.load_matrix(arrays["matrix"])
        self.pairs = {}
        keys, values = arrays.get("pair_keys"), arrays.get("pair_successors")
        if keys is not None and values is not None:
            if keys.ndim != 2 or keys.shape[1] != 2 or values.shape != (len(keys), self.top_k):
                raise ValueError("saved successor pairs have inconsistent shapes")
            recent = slice(max(len(keys) - self.pair_capacity, 0), None) if self.pair_capacity else slice(0, 0)
            self.pairs = {
                (int(a), int(b)): tuple(row) for (a, b), row in zip(keys[recent].tolist(), values[recent].tolist())
            }

    def load_matrix(self, matrix: np.ndarray) -> None:
        """Replace the matrix (e.g. from a saved state); its width must be ``top_k``."""
        if matrix.ndim != 2 or matrix.shape[1] != self.top_k:
            raise ValueError(f"successor matrix has shape {matrix.shape}, expected (tokens, {self.top_k})")
        self.matrix = matrix.astype(np.int32)
