"""Verification: decide which draft tokens the target model itself would have produced.

These are pure functions of the draft tree and the target's choices at every row of the verification forward, so
tests can drive them directly. Greedy decoding uses :func:`greedy_choice` both in plain decoding and here: ties break
the same way (lowest token id among equal maxima) because it is literally the same function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..backend import native
from .sampling import Draws, as_draws, sample_token
from .tree import ROOT, DraftTree


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of ``logits`` (ties go to the lowest token id, as in ``torch.argmax``).

    On CPU the compiled ranking kernel where it is loaded (a few microseconds a row instead of about thirty).
    Otherwise half-precision logits are widened first (exactly, so the order and the ties are theirs): PyTorch's CPU
    argmax of bfloat16 takes about twice as long as a float32 one with the conversion included."""
    ranked = native.top_tokens(logits, 1)
    if ranked is not None:
        return ranked[:, 0]
    return torch.argmax(_widened(logits), dim=-1)


def top_tokens(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` most likely tokens of each row of ``logits`` ``(rows, vocabulary)``, best first (ties in an order
    that is the kernel's or torch's: what drafters keep as guesses, never what decides a token)."""
    ranked = native.top_tokens(logits, k)
    if ranked is not None:
        return ranked
    return torch.topk(_widened(logits), k, dim=-1).indices


def _widened(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32 (exactly), where torch's CPU reductions over them are faster."""
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


@dataclass(frozen=True)
class Verification:
    """Outcome of verifying one draft tree.

    Attributes:
        accepted_nodes: node indices of the accepted path, from the root's child downwards.
        tokens: emitted tokens: the accepted draft tokens followed by the target's own next token.
        attempted: number of tree levels at which the walk met a node with children (a draft was on offer there).
    """

    accepted_nodes: tuple[int, ...]
    tokens: tuple[int, ...]
    attempted: int

    @property
    def accepted(self) -> int:
        """Number of accepted draft tokens (the bonus token not included)."""
        return len(self.accepted_nodes)

    @property
    def kept_rows(self) -> list[int]:
        """Rows of the verification forward whose keys and values stay in the cache: the root and the accepted path."""
        return [0, *(node + 1 for node in self.accepted_nodes)]


def verify_greedy(tree: DraftTree, choices: Sequence[int]) -> Verification:
    """Walk the tree from the root, descending while a child carries the target's choice.

    Args:
        tree: the draft tree that was verified.
        choices: the target's token at every row of the forward (row 0 = root, row ``i + 1`` = node ``i``).
    """
    return _walk(tree, lambda row: int(choices[row]))


def verify_sampled(
    tree: DraftTree, probabilities: torch.Tensor, draws: Draws | torch.Generator | None, position: int = 0
) -> Verification:
    """Sampling verification of a deterministic draft tree (point-mass proposals), exact for trees.

    At each node draw ``y ~ p(. | node)``; if a child carries ``y``, descend into it, else emit ``y`` and stop. Every
    emitted token is a draw from the target distribution given the tokens before it, exactly as in plain sampling;
    the draft only decides how many of those draws one forward pass yields. (Sampling once per *path*, as REST and
    ADED do, favours tokens shared by several paths and is biased.)

    Args:
        tree: the verified draft tree.
        probabilities: the target distribution at every row (row 0 = root, row ``i + 1`` = node ``i``).
        draws: random source (:class:`~draftwise.decoding.sampling.Draws`, a ``torch.Generator`` or ``None`` for
            torch's global one).
        position: the position of the token row 0 decides (a node's row decides the one ``depth`` further).
    """
    draws = as_draws(draws)
    depths = (0, *tree.depths)
    return _walk(tree, lambda row: sample_token(probabilities[row], draws.uniform(position + depths[row])))


def _walk(tree: DraftTree, choose) -> Verification:
    """Descend from the root while a child carries ``choose(row)``."""
    node = ROOT
    accepted: list[int] = []
    tokens: list[int] = []
    attempted = 0
    while True:
        choice = choose(node + 1)
        tokens.append(choice)
        if tree.has_children(node):
            attempted += 1
        child = tree.child(node, choice)
        if child is None:
            return Verification(tuple(accepted), tuple(tokens), attempted)
        accepted.append(child)
        node = child


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``, the distribution to sample after rejecting a draw from ``q`` (``p`` if p <= q)."""
    leftover = torch.clamp(p - q, min=0)
    total = leftover.sum()
    return leftover / total if total > 0 else p


def recursive_rejection(
    p: torch.Tensor,
    q: torch.Tensor,
    candidates: Sequence[int],
    draws: Draws | torch.Generator | None,
    without_replacement: bool = False,
    position: int = 0,
) -> tuple[int | None, int]:
    """Multi-candidate rejection sampling at one node (SpecInfer / recursive rejection sampling).

    ``candidates`` were drawn from ``q`` (independently, or without replacement). Each is accepted with probability
    ``min(1, p(x) / q(x))``; on rejection ``p <- norm(max(0, p - q))`` and, for draws without replacement, ``q`` loses
    ``x`` and is renormalised. The emitted token is distributed exactly as ``p``.

    Returns:
        ``(index of the accepted candidate or None, emitted token)``.
    """
    draws = as_draws(draws)
    p = p.double()
    q = q.double()
    for index, token in enumerate(candidates):
        ratio = p[token] / q[token] if q[token] > 0 else torch.tensor(float("inf"), dtype=p.dtype)
        if draws.uniform(position, 1 + index) < float(torch.clamp(ratio, max=1.0)):
            return index, int(token)
        p = residual(p, q)
        if without_replacement:
            q = q.clone()
            q[token] = 0
            total = q.sum()
            if total <= 0:
                break
            q = q / total
    return None, sample_token(p, draws.uniform(position))


def verify_probabilistic(
    tree: DraftTree,
    p_rows: torch.Tensor,
    q_rows: torch.Tensor,
    draws: Draws | torch.Generator | None,
    without_replacement: bool = False,
    position: int = 0,
) -> Verification:
    """Rejection-sampling verification of a draft drawn from a draft distribution ``q`` (a chain or a tree).

    The children of the node at row ``r`` were drawn from ``q_rows[r]``; ``p_rows[r]`` is the target distribution
    there. At each node the children go through :func:`recursive_rejection`; an accepted child is descended into, and
    the walk ends with the correction token from the residual distribution (or a bonus token from ``p`` below the
    last accepted node). For a chain this is the rule of Leviathan et al. and Chen et al. A tree holds no duplicate
    children, so sibling drafts are draws without replacement: pass ``without_replacement=True`` for trees with
    several children per node (with one child per node both settings agree).
    """
    draws = as_draws(draws)
    node = ROOT
    accepted: list[int] = []
    tokens: list[int] = []
    attempted = 0
    children: dict[int, list[int]] = {}
    for child, parent in enumerate(tree.parents):
        children.setdefault(parent, []).append(child)
    while True:
        row = node + 1
        below = children.get(node, [])
        if not below:
            tokens.append(sample_token(p_rows[row], draws.uniform(position + len(accepted))))
            return Verification(tuple(accepted), tuple(tokens), attempted)
        attempted += 1
        index, token = recursive_rejection(
            p_rows[row], q_rows[row], [tree.tokens[child] for child in below], draws, without_replacement,
            position + len(accepted),
        )
        tokens.append(token)
        if index is None:
            return Verification(tuple(accepted), tuple(tokens), attempted)
        node = below[index]
        accepted.append(node)
