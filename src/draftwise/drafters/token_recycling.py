"""Token Recycling: reuse the model's own top-k predictions, from every verified position, as future drafts.

An adjacency matrix ``M[token] = top-k next tokens`` is filled from the logits of every row of every verification
forward (rejected rows included: their predictions are still the model's). Drafting fills a tree template breadth
first: the root's children are ``M[last token]``, their children ``M[child]``, and so on. The matrix starts empty
and is kept across requests by the drafter instance (hot start); :meth:`save` and :meth:`load` carry it across
processes. Beyond the published method, the predictions are also kept per pair of tokens (the row's token and the
one before it) and preferred where known: what follows a token depends on what preceded it. Each template node is
scored with the learned acceptance rate of its rank path, so the engine verifies only the part of the template that
pays for itself on this machine; the template is filled best first, as far as the engine could keep nodes (the step's
budget, scores above what one more row costs), since a step verifies a few nodes of its hundreds of slots.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..decoding.drafter import Drafter, SequenceSetup, StepOutcome
from ..decoding.latency import LatencyModel
from ..decoding.policy import least_paying_score
from ..decoding.tree import ROOT, DraftTree
from ..files import read_npz
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
    #: Proposals between two readings of the engine's forward-time model for the score floor (see
    #: :meth:`_score_floor`).
    FLOOR_REFRESH = 64

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
        self._rank_of_path: dict[tuple[int, ...], tuple[int, bool]] = {}
        self._latency: LatencyModel | None = None
        self._floor = 0.0
        self._floor_age = self.FLOOR_REFRESH

    @property
    def matrix(self) -> np.ndarray:
        """The adjacency matrix: row ``t`` holds the model's latest top-k tokens after ``t``."""
        return self.successors.matrix

    def _own_sequence_state(self) -> None:
        self._rank_of_path = {}

    def attach(self, setup: SequenceSetup) -> None:
        self._latency = setup.latency
        self._floor_age = self.FLOOR_REFRESH

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        token_paths: list[tuple[int, ...]] = []  # each node's tokens from the root down
        self._rank_of_path = {}
        before = context[-2] if len(context) >= 2 else None
        nodes = self.successors.fill_best(
            context[-1], self.template, self._rate, budget, self._score_floor(budget), before
        )
        for ranks, token, parent, score, paired in nodes:
            path = (*(token_paths[parent] if parent != ROOT else ()), token)
            self._rank_of_path[path] = (ranks[-1], paired)
            tokens.append(token)
            parents.append(parent)
            token_paths.append(path)
            scores.append(score)
        return DraftTree(tuple(tokens), tuple(parents), tuple(scores))

    def _rate(self, rank: int, paired: bool, depth: int) -> float:
        """Acceptance estimate of a candidate of ``rank`` at ``depth``, read from a pair's row (``paired``) or a
        single token's: the pair's own predictions are the surer."""
        return self.acceptance.rate((rank, paired), depth)

    def _score_floor(self, budget: int) -> float:
        """Half the least score that pays for its row at one sequence (see
        :func:`~draftwise.decoding.policy.least_paying_score`), refreshed every :attr:`FLOOR_REFRESH` proposals: half,
        for the forward-time estimates' drift in between and for batches, whose rows are priced apart."""
        if self._latency is None:
            return 0.0
        self._floor_age += 1
        if self._floor_age >= self.FLOOR_REFRESH:
            self._floor_age = 0
            self._floor = 0.5 * least_paying_score(self._latency, budget)
        return self._floor

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
        """Restore what :meth:`save` wrote (a file that is not such a state raises a ``ValueError`` saying why)."""
        data = read_npz(path, "state file")
        if "top_k" not in data or "matrix" not in data:
            raise ValueError("not a saved Token Recycling state")
        if int(data["top_k"]) != self.top_k:
            raise ValueError(f"state has top_k={int(data['top_k'])}, this drafter {self.top_k}")
        self.successors.load_state(data)
