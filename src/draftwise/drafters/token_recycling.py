"""Token Recycling: reuse the model's own top-k predictions, from every verified position, as future drafts.

An adjacency matrix ``M[token] = top-k next tokens`` is filled from the logits of every row of every verification
forward (rejected rows included: their predictions are still the model's). Drafting fills a tree template breadth
first: the root's children are ``M[last token]``, their children ``M[child]``, and so on. The matrix starts empty
and is kept across requests by the drafter instance (hot start); :meth:`save` and :meth:`load` carry it across
processes. Each template node is scored with the learned acceptance rate of its rank path, so the engine verifies
only the part of the template that pays for itself on this machine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from ..acceptance import AcceptanceTracker
from ..tree import ROOT, DraftTree
from .base import Drafter, StepOutcome

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


class TokenRecyclingDrafter(Drafter):
    """Draft from an adjacency matrix of the model's recycled top-k predictions.

    Args:
        top_k: candidates kept per token (matrix width).
        depth: template depth.
        rank_budget: a template path's ranks sum to at most this (larger = wider template).
        vocab_size: matrix rows; grows on demand when ``None`` or too small.
    """

    name = "recycling"

    def __init__(self, top_k: int = 8, depth: int = 6, rank_budget: int = 4, vocab_size: int | None = None) -> None:
        if top_k < 1 or depth < 1 or rank_budget < 0:
            raise ValueError("need top_k >= 1, depth >= 1 and rank_budget >= 0")
        self.top_k = top_k
        self.template = rank_template(depth, rank_budget, top_k)
        self.matrix = np.full((vocab_size or 0, top_k), EMPTY, dtype=np.int32)
        self.acceptance = AcceptanceTracker()
        self._rank_of_path: dict[tuple[int, ...], int] = {}

    def _ensure_rows(self, rows: int) -> None:
        if rows > self.matrix.shape[0]:
            grown = np.full((rows, self.top_k), EMPTY, dtype=np.int32)
            grown[: self.matrix.shape[0]] = self.matrix
            self.matrix = grown

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        root = context[-1]
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        token_paths: list[tuple[int, ...]] = []  # each node's tokens from the root down
        node_of: dict[tuple[int, ...], int] = {}
        self._rank_of_path = {}
        if root >= self.matrix.shape[0]:
            return DraftTree()
        for ranks in self.template:
            if len(ranks) > 1 and ranks[:-1] not in node_of:
                continue  # the parent's slot was empty or a duplicate
            parent = node_of[ranks[:-1]] if len(ranks) > 1 else ROOT
            parent_token = root if parent == ROOT else tokens[parent]
            if parent_token >= self.matrix.shape[0]:
                continue
            token = int(self.matrix[parent_token, ranks[-1]])
            path = (*(token_paths[parent] if parent != ROOT else ()), token)
            if token == EMPTY or path in self._rank_of_path:
                continue
            rate = self.acceptance.rate(ranks[-1], len(ranks))
            node_of[ranks] = len(tokens)
            self._rank_of_path[path] = ranks[-1]
            tokens.append(token)
            parents.append(parent)
            token_paths.append(path)
            scores.append(rate if parent == ROOT else scores[parent] * rate)
        return DraftTree(tuple(tokens), tuple(parents), tuple(scores)).best(budget)

    def observe(self, outcome: StepOutcome) -> None:
        tree = outcome.tree
        root = outcome.root if outcome.root is not None else outcome.context[-1 - len(outcome.verification.tokens)]
        row_tokens = [root, *tree.tokens]
        top = torch.topk(outcome.logits[: len(row_tokens)].float(), self.top_k, dim=-1).indices.cpu().numpy()
        self._ensure_rows(max(max(row_tokens), outcome.logits.shape[-1]) + 1)
        self.matrix[np.asarray(row_tokens)] = top
        self._learn_ranks(outcome)

    def _learn_ranks(self, outcome: StepOutcome) -> None:
        """Conditional acceptance by (rank, depth): at each level on offer, which rank (if any) was taken."""
        tree = outcome.tree
        accepted = outcome.verification.accepted_nodes
        parent = ROOT
        for depth in range(1, outcome.verification.attempted + 1):
            chosen = accepted[depth - 1] if depth - 1 < len(accepted) else None
            for child, child_parent in enumerate(tree.parents):
                if child_parent != parent:
                    continue
                path = tuple(tree.tokens[node] for node in tree.path_to(child))
                rank = self._rank_of_path.get(path)
                if rank is not None:
                    self.acceptance.update_one(rank, depth, child == chosen)
            if chosen is None:
                break
            parent = chosen

    def save(self, path: str | os.PathLike) -> None:
        """Write the adjacency matrix (numpy ``.npz``, no pickles); acceptance estimates are relearned."""
        np.savez_compressed(path, matrix=self.matrix, top_k=np.int64(self.top_k))

    def load(self, path: str | os.PathLike) -> None:
        with np.load(path, allow_pickle=False) as data:
            if int(data["top_k"]) != self.top_k:
                raise ValueError(f"state has top_k={int(data['top_k'])}, this drafter {self.top_k}")
            self.matrix = data["matrix"].astype(np.int32)
