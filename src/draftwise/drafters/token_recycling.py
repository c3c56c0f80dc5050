"""Token Recycling: reuse the model's own top-k predictions, from every verified position, as future drafts.

An adjacency matrix ``M[token] = top-k next tokens`` is filled from the logits of every row of every verification
forward (rejected rows included: their predictions are still the model's). Drafting fills a tree template breadth
first: the root's children are ``M[last token]``, their children ``M[child]``, and so on. The matrix starts empty
and is kept across requests by the drafter instance (hot start); :meth:`save` and :meth:`load` carry it across
processes. Beyond the published method, the predictions are also kept per pair of tokens (the row's token and the
one before it) and preferred where known: what follows a token depends on what preceded it. Each template node is
scored with the learned acceptance rate of its rank path, so the engine verifies only the part of the template that
pays for itself on this machine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..decoding.drafter import Drafter, StepOutcome
from ..decoding.tree import ROOT, DraftTree
from .stores.acceptance import AcceptanceTracker
from .stores.successors import EMPTY, SuccessorMatrix, rank_template

__all__ = ["EMPTY", "TokenRecyclingDrafter", "rank_template"]


class TokenRecyclingDrafter(Drafter):
    """Draft from an adjacency matrix of the model's recycled top-k predictions.

    Args:
        top_k: candidates kept per token (matrix width).
        depth: template depth.
        rank_budget: a template path's ranks sum to at most this (larger = wider template).
        vocab_size: matrix rows; grows on demand when ``None`` or too small.
        pair_capacity: also keep the model's predictions per pair of tokens (at most this many pairs), preferred
            over the single-token row where known (on Spec-Bench prompts: MAT 1.26 -> 1.35); 0 keys by single tokens
            only, as published.
    """

    name = "recycling"

    def __init__(
        self,
        top_k: int = 8,
        depth: int = 6,
        rank_budget: int = 4,
        vocab_size: int | None = None,
        pair_capacity: int = 100_000,
    ) -> None:
        if top_k < 1 or depth < 1 or rank_budget < 0:
            raise ValueError("need top_k >= 1, depth >= 1 and rank_budget >= 0")
        self.top_k = top_k
        self.template = rank_template(depth, rank_budget, top_k)
        self.successors = SuccessorMatrix(top_k, vocab_size, pair_capacity)
        self.acceptance = AcceptanceTracker()
        self._rank_of_path: dict[tuple[int, ...], int] = {}

    @property
    def matrix(self) -> np.ndarray:
        """The adjacency matrix: row ``t`` holds the model's latest top-k tokens after ``t``."""
        return self.successors.matrix

    def _own_sequence_state(self) -> None:
        self._rank_of_path = {}

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        token_paths: list[tuple[int, ...]] = []  # each node's tokens from the root down
        self._rank_of_path = {}
        before = context[-2] if len(context) >= 2 else None
        for ranks, token, parent in self.successors.fill(context[-1], self.template, before):
            rate = self.acceptance.rate(ranks[-1], len(ranks))
            path = (*(token_paths[parent] if parent != ROOT else ()), token)
            self._rank_of_path[path] = ranks[-1]
            tokens.append(token)
            parents.append(parent)
            token_paths.append(path)
            scores.append(rate if parent == ROOT else scores[parent] * rate)
        return DraftTree(tuple(tokens), tuple(parents), tuple(scores)).best(budget)

    def observe(self, outcome: StepOutcome) -> None:
        tree = outcome.tree
        self.successors.observe(
            tree.row_tokens(outcome.root), tree.row_previous(outcome.root, outcome.before_root), outcome.logits
        )
        self.acceptance.learn_step(tree, outcome.verification, self._rank_of_path)

    def save(self, path: str | os.PathLike) -> None:
        """Write the adjacency matrix and the pair rows (numpy ``.npz``, no pickles); acceptance estimates are
        relearned."""
        np.savez_compressed(path, top_k=np.int64(self.top_k), **self.successors.state())

    def load(self, path: str | os.PathLike) -> None:
        with np.load(path, allow_pickle=False) as data:
            if int(data["top_k"]) != self.top_k:
                raise ValueError(f"state has top_k={int(data['top_k'])}, this drafter {self.top_k}")
            self.successors.load_state({name: data[name] for name in data.files})
