"""The model's own recent predictions as a draft source: Token Recycling's adjacency matrix, shared by every drafter
that recycles them (``recycling`` itself, and ``aded`` beside its tri-gram search).

Every verification forward computes the model's distribution at every row, rejected rows included; the top-k tokens
of each row are what the model most likely emits after that row's token. :class:`SuccessorMatrix` keeps, per token,
the latest such top-k, and fills a tree template from them (the root's children are ``M[root]``, their children
``M[child]``, ...), best-scored slots first.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

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

    Observations are written into the matrix and the pair rows in batches, when something reads them (or
    :attr:`PENDING_LIMIT` are waiting): a step's own bookkeeping right after a forward runs on caches the forward's
    weights just flushed, and cost Token Recycling ~1-2 % of a small model's step on a 2-core CPU where drafting is
    mostly paused. Reads see every observation made before them, as if each had been written at once.
    """

    #: Observations kept before they are written (see the class notes).
    PENDING_LIMIT = 64

    def __init__(self, top_k: int, vocab_size: int | None = None, pair_capacity: int = 0) -> None:
        if top_k < 1 or pair_capacity < 0:
            raise ValueError("need top_k >= 1 and pair_capacity >= 0")
        self.top_k = top_k
        self._matrix = np.full((vocab_size or 0, top_k), EMPTY, dtype=np.int32)
        self.pair_capacity = pair_capacity
        # (ordered by recency; an OrderedDict drops its oldest entry at once, where a dict's first key, after many
        # deletions from the front, takes a scan of the holes: ~35 us an update at 100 000 pairs)
        self._pairs: OrderedDict[tuple[int, int], tuple[int, ...]] = OrderedDict()
        # (row tokens, the tokens before them, their top-k rows, the vocabulary size) not yet written
        self._pending: list[tuple[Sequence[int], Sequence[int | None] | None, torch.Tensor, int]] = []
        self._template_children: tuple[Sequence[tuple[int, ...]], dict[int, list[int]]] | None = None

    @property
    def matrix(self) -> np.ndarray:
        """``(tokens, top_k)``: each token's latest successors, best first (``EMPTY`` where none was seen)."""
        self._flush()
        return self._matrix

    @property
    def pairs(self) -> OrderedDict[tuple[int, int], tuple[int, ...]]:
        """Successors per pair of tokens, least recently updated first."""
        self._flush()
        return self._pairs

    @pairs.setter
    def pairs(self, pairs: Mapping[tuple[int, int], tuple[int, ...]]) -> None:
        self._flush()
        self._pairs = OrderedDict(pairs)

    def _ensure_rows(self, rows: int) -> None:
        if rows > self._matrix.shape[0]:
            grown = np.full((rows, self.top_k), EMPTY, dtype=np.int32)
            grown[: self._matrix.shape[0]] = self._matrix
            self._matrix = grown

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
        self._flush()
        self._write(row_tokens, previous_tokens, top, vocab_size)

    def _write(
        self, row_tokens: Sequence[int], previous_tokens: Sequence[int | None] | None, top: np.ndarray, vocab_size: int
    ) -> None:
        self._ensure_rows(max(max(row_tokens) + 1, vocab_size))
        top = top[:, : self.top_k]
        self._matrix[np.asarray(row_tokens)] = top
        if self.pair_capacity and previous_tokens is not None:
            pairs = self._pairs
            for before, token, successors in zip(previous_tokens, row_tokens, top.tolist()):
                if before is not None:
                    key = (int(before), int(token))
                    pairs[key] = tuple(successors)
                    pairs.move_to_end(key)  # (the order is the recency order)
            while len(pairs) > self.pair_capacity:
                pairs.popitem(last=False)

    def _flush(self) -> None:
        """Write the pending observations, oldest first."""
        if self._pending:
            pending, self._pending = self._pending, []
            for row_tokens, previous_tokens, top, vocab_size in pending:
                self._write(row_tokens, previous_tokens, top.cpu().numpy(), vocab_size)

    def observe(
        self, row_tokens: Sequence[int], previous_tokens: Sequence[int | None], logits: torch.Tensor
    ) -> torch.Tensor:
        """Record the model's top-k prediction at every row of a verification forward (rejected rows too: their
        predictions are still the model's) as the successors of that row's token; returns the top-k token ids per
        row, best first (a tensor on the logits' device).

        ``row_tokens`` and ``previous_tokens`` are the token at each row and the one before it (see
        :meth:`~draftwise.decoding.tree.DraftTree.row_tokens` and :meth:`~draftwise.decoding.tree.DraftTree.row_previous`).
        """
        rows = logits[: len(row_tokens)]
        top = top_tokens(rows, self.top_k)
        self._pending.append((row_tokens, previous_tokens, top, rows.shape[-1]))
        if len(self._pending) >= self.PENDING_LIMIT:
            self._flush()
        return top

    def row(self, before: int | None, token: int) -> tuple[Sequence[int], bool]:
        """The successors of ``token`` after ``before`` (``None``: unknown), best first, and whether they are the
        pair's own (else the token's row, or nothing where the token was never seen)."""
        self._flush()
        if self._pairs and before is not None:
            row = self._pairs.get((before, token))
            if row is not None:
                return row, True
        return (self._matrix[token].tolist() if token < self._matrix.shape[0] else ()), False

    def fill(
        self, root: int, template: Sequence[tuple[int, ...]], before: int | None = None
    ) -> list[tuple[tuple[int, ...], int, int]]:
        """Fill ``template`` below ``root`` (preceded by ``before``, if known): ``(ranks, token, parent)`` per node,
        parents first (``parent`` indexes this list, -1 = the root), in the template's order. A slot whose parent is
        missing, whose entry is empty or whose token repeats a sibling is skipped."""
        nodes = self.fill_best(root, template, lambda rank, paired, depth: 1.0, len(template), before=before)
        return [(ranks, token, parent) for ranks, token, parent, _, _ in nodes]

    def fill_best(
        self,
        root: int,
        template: Sequence[tuple[int, ...]],
        rate: Callable[[int, bool, int], float],
        count: int,
        floor: float = 0.0,
        before: int | None = None,
    ) -> list[tuple[tuple[int, ...], int, int, float, bool]]:
        """The ``count`` best-scored nodes of :meth:`fill`'s tree, best first (so parents first):
        ``(ranks, token, parent, score, paired)`` each, ``parent`` indexing this list (-1 = the root), ``paired``
        whether the node was read from its parent's pair row (see :meth:`row`).

        A node's score is its parent's times ``rate(rank, paired, depth)``, so slots are looked up best first and
        only as far as needed: ``count`` nodes instead of the whole template (hundreds of slots, where a step
        verifies a few nodes). Nodes scored below ``floor`` are left out, and with them their descendants, which
        score no higher, except the best node, always kept. Where two slots of one parent hold the same token, the
        better-scored one keeps it.
        """
        children = self._children_slots(template)
        rows: list[tuple[Sequence[int], bool]] = []  # by node: the row its children are read from
        root_row, root_paired = self.row(before, root)

        def push(heap: list, node: int, row_paired: bool, score: float, depth: int, slots: Sequence[int]) -> None:
            for slot in slots:
                rank = template[slot][-1]
                heapq.heappush(heap, (-score * rate(rank, row_paired, depth), depth, slot, node))

        heap: list[tuple[float, int, int, int]] = []
        push(heap, -1, root_paired, 1.0, 1, children.get(-1, ()))
        nodes: list[tuple[tuple[int, ...], int, int, float, bool]] = []
        siblings: set[tuple[int, int]] = set()
        while heap and len(nodes) < count:
            negative_score, depth, slot, parent = heapq.heappop(heap)
            if -negative_score < floor and nodes:
                break
            row, paired = rows[parent] if parent >= 0 else (root_row, root_paired)
            ranks = template[slot]
            if ranks[-1] >= len(row):
                continue
            token = int(row[ranks[-1]])
            if token == EMPTY or (parent, token) in siblings:
                continue
            siblings.add((parent, token))
            node = len(nodes)
            nodes.append((ranks, token, parent, -negative_score, paired))
            previous = root if parent < 0 else nodes[parent][1]
            rows.append(self.row(previous, token))
            push(heap, node, rows[node][1], -negative_score, depth + 1, children.get(slot, ()))
        return nodes

    def _children_slots(self, template: Sequence[tuple[int, ...]]) -> dict[int, list[int]]:
        """Each template slot's child slots (-1: the root's), worked out once per template: every step fills the same
        one. A slot whose parent path is not listed before it is never filled."""
        cached = self._template_children
        if cached is None or cached[0] is not template:
            first_slot: dict[tuple[int, ...], int] = {}
            children: dict[int, list[int]] = {}
            for slot, ranks in enumerate(template):
                parent = -1 if len(ranks) == 1 else first_slot.get(ranks[:-1], -2)
                if parent != -2:
                    children.setdefault(parent, []).append(slot)
                first_slot.setdefault(ranks, slot)
            cached = self._template_children = (template, children)
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
        self._flush()
        self._matrix = matrix.astype(np.int32)
