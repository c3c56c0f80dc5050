"""Lookahead decoding (Fu et al., 2024): Jacobi iteration over a window of future positions, n-grams harvested from
its trajectory, and the pool's n-grams verified in the same forward pass.

The window has ``levels`` rows of guesses for future positions. With the root (the last emitted token) at position
``r``, level 0 holds ``width - 1`` guesses for positions ``r + 1 ..`` and level ``l >= 1`` holds ``width`` guesses
for positions ``r + l ..``: column ``j`` of level ``l`` guesses position ``r + j + l``. In the published attention
mask a level-``l`` token of column ``j`` sees the prefix, the level-0 tokens of columns ``< j`` and the tokens of
column ``j`` on levels ``1 .. l``: one chain of consecutive positions. So the whole lookahead branch is a
:class:`~draftwise.tree.DraftTree` (the level-0 chain below the root, and below its ``j``-th token the column-``j``
chain), verified together with the pool's n-grams in one forward with one tree attention mask; rows whose chains
coincide are merged, which changes nothing since their inputs are identical.

After the forward, the model's greedy token at the newest level of each column is that column's next Jacobi
iterate. The column (its level-0 key to the left, its tokens on levels ``1 ..``, the new token) is an n-gram of
``levels + 1`` tokens in which each token is the model's prediction after the one before it; it goes into the pool
under its first token. The window then moves forward by the number of tokens the step emitted, so each guess stays
aligned with the position it guesses: level ``l`` takes level ``l + 1``'s guesses, the newest level takes the new
iterates, and positions nobody has guessed yet get tokens drawn from the context (as the reference implementation
initialises its window). Columns that still hold such filler are not harvested.

Every step the pool's n-grams that start with the root (the ``guess_set`` most recently harvested) form the
verification branch. Any draft node the model confirms is accepted, lookahead nodes included, so the output is
exactly that of plain decoding. The pool is kept by the drafter instance across requests; :meth:`reset` restarts
the window only.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ..decoding.drafter import Drafter, StepOutcome
from ..decoding.tree import DraftTree
from ..decoding.verify import greedy_choice
from ..errors import UnsupportedOptionError
from .stores.acceptance import AcceptanceTracker

Filler = Callable[[], int]


@dataclass(frozen=True)
class Window:
    """The lookahead window: guesses per level and whether each one was produced by the model.

    Attributes:
        levels: ``levels[0]`` has ``width - 1`` tokens, every later level ``width``; ``levels[l][j]`` guesses
            position ``root + j + max(l, 1)`` (see the module docstring).
        fresh: per token, ``True`` when it is a model prediction made after the token before it in its column, and
            ``False`` when it is filler drawn from the context.
    """

    levels: tuple[tuple[int, ...], ...]
    fresh: tuple[tuple[bool, ...], ...]

    @property
    def width(self) -> int:
        """Number of columns (W)."""
        return len(self.levels[1])

    def column_path(self, column: int) -> tuple[int, ...]:
        """Tokens from the root down to the newest level of ``column``: level 0 up to the column, then the column."""
        return (*self.levels[0][:column], *(level[column] for level in self.levels[1:]))

    def column_paths(self) -> list[tuple[int, ...]]:
        """Every column's path, left to right (each path's prefixes are the lookahead branch's other nodes)."""
        return [self.column_path(column) for column in range(self.width)]


def initial_window(width: int, levels: int, fill: Filler) -> Window:
    """A window of filler tokens: ``levels`` levels, ``width`` columns (level 0 one shorter)."""
    sizes = [width - 1] + [width] * (levels - 1)
    return Window(
        tuple(tuple(fill() for _ in range(size)) for size in sizes),
        tuple((False,) * size for size in sizes),
    )


def _pad(
    tokens: Sequence[int], fresh: Sequence[bool], size: int, fill: Filler
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """``tokens`` cut or padded with filler to ``size``."""
    missing = max(size - len(tokens), 0)
    return (
        (*tokens[:size], *(fill() for _ in range(missing))),
        (*fresh[:size], *(False,) * missing),
    )


def shift_window(window: Window, newest: Sequence[int], emitted: int, fill: Filler) -> Window:
    """The window for the next step, after ``emitted`` tokens were appended to the context.

    ``newest[j]`` is the model's greedy token after column ``j``'s newest-level token (a prefix of the columns when
    the verified tree lost the others). The root moves ``emitted`` positions on; every guess keeps its position: level
    ``l`` takes level ``l + 1``'s guesses, the newest level takes ``newest``, and the tail is filled with filler.
    """
    if emitted < 1:
        raise ValueError(f"a step emits at least one token, got {emitted}")
    width = window.width
    levels = list(window.levels[1:]) + [tuple(newest)]
    fresh = list(window.fresh[1:]) + [(True,) * len(newest)]
    # Level 0 starts at root + 1 like level 1 (later levels start one further each), so a guess moves `emitted`
    # columns left from level 1 to level 0 and `emitted - 1` columns left from level l + 1 to level l.
    shifted = [_pad(levels[0][emitted:], fresh[0][emitted:], width - 1, fill)]
    shifted += [
        _pad(tokens[emitted - 1 :], flags[emitted - 1 :], width, fill) for tokens, flags in zip(levels[1:], fresh[1:])
    ]
    return Window(tuple(tokens for tokens, _ in shifted), tuple(flags for _, flags in shifted))


def harvest(window: Window, root: int, newest: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """The n-grams (``levels + 1`` tokens) of the columns whose tokens on levels ``1 ..`` are all model predictions.

    Column ``j``'s n-gram is its key (the root for column 0, else level 0's token of column ``j - 1``), its tokens
    on levels ``1 ..`` and ``newest[j]``.
    """
    keys = (root, *window.levels[0])
    for column, token in enumerate(newest):
        if all(flags[column] for flags in window.fresh[1:]):
            yield (keys[column], *(level[column] for level in window.levels[1:]), int(token))


class NGramPool:
    """N-grams keyed by their first token; each key keeps its ``capacity`` most recently added tails.

    Args:
        capacity: tails kept per key (least recently added dropped first).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._tails: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram: Sequence[int]) -> None:
        """Add ``ngram`` (key first), or mark it as the most recent when it is already there."""
        if self.capacity <= 0 or len(ngram) < 2:
            return
        tails = self._tails.setdefault(int(ngram[0]), OrderedDict())
        tail = tuple(int(token) for token in ngram[1:])
        tails.pop(tail, None)
        tails[tail] = None
        if len(tails) > self.capacity:
            tails.popitem(last=False)

    def guesses(self, key: int) -> list[tuple[int, ...]]:
        """The tails stored under ``key``, most recent first."""
        return list(reversed(self._tails.get(int(key), ())))

    def __len__(self) -> int:
        return sum(len(tails) for tails in self._tails.values())


def rows_by_path(tree: DraftTree) -> dict[tuple[int, ...], int]:
    """Forward row of every node of ``tree``, keyed by its tokens from the root down."""
    paths: list[tuple[int, ...]] = []
    rows: dict[tuple[int, ...], int] = {}
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        path = (*(paths[parent] if parent >= 0 else ()), token)
        paths.append(path)
        rows[path] = node + 1
    return rows


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UnsupportedOptionError(f"lookahead option {name} must be an integer >= {minimum}, got {value!r}")
    return value


class LookaheadDrafter(Drafter):
    """Lookahead decoding: Jacobi iteration over a window plus verification of harvested n-grams, one forward.

    The tree of a step has ``(window - 1) + window * (levels - 1)`` lookahead nodes (fewer when chains coincide)
    and up to ``guess_set * levels`` verification nodes, the verification branch first and the window's columns
    left to right, so a budget cut drops the furthest columns first. The defaults (7 nodes) are sized for a CPU,
    where every extra row of the forward costs time; the published defaults (n-gram size N = 5, W = 7, G = 7:
    ``window=7, levels=4, guess_set=7``) assume rows are nearly free, as on a GPU, and need a budget of about 55.

    Args:
        window: columns of the window (W), i.e. how many future positions are iterated.
        levels: levels of the window (N - 1); harvested n-grams have ``levels + 1`` tokens (N).
        guess_set: pool n-grams kept per first token and verified each step (G).
        context_ngrams: also put the context's own n-grams (prompt and output) into the pool.
        seed: seed of the filler tokens drawn from the context.
    """

    name = "lookahead"

    def __init__(
        self,
        window: int = 2,
        levels: int = 2,
        guess_set: int = 2,
        context_ngrams: bool = True,
        seed: int = 0,
    ) -> None:
        self.window = _check_count("window", window, 1)
        self.levels = _check_count("levels", levels, 2)
        self.guess_set = _check_count("guess_set", guess_set, 0)
        if not isinstance(context_ngrams, bool):
            raise UnsupportedOptionError(
                f"lookahead option context_ngrams must be true or false, got {context_ngrams!r}"
            )
        self.context_ngrams = context_ngrams
        self.pool = NGramPool(guess_set)
        self._random = random.Random(_check_count("seed", seed, 0))
        self._context: Sequence[int] = ()
        self._window: Window | None = None
        self.acceptance = AcceptanceTracker()
        self._kind_of_path: dict[tuple[int, ...], object] = {}
        self._indexed = 0  # context tokens whose n-grams are in the pool

    def _fill(self) -> int:
        """A filler token: a random token of the context, as the reference implementation fills its window."""
        return int(self._random.choice(self._context))

    def reset(self, prompt: Sequence[int]) -> None:
        self._context = tuple(prompt)
        self._window = initial_window(self.window, self.levels, self._fill) if self._context else None
        self._indexed = 0

    def _own_sequence_state(self) -> None:
        self._random = random.Random(self._random.random())
        self._context = ()
        self._window = None
        self._indexed = 0
        self._kind_of_path = {}

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        if not context or budget <= 0:
            return DraftTree()
        self._context = context
        if self._window is None:
            self._window = initial_window(self.window, self.levels, self._fill)
        if self.context_ngrams:
            self._index_context(context)
        # Scored like any draft: the pool's n-grams and the window's guesses each by their own learned acceptance,
        # so the window's rows are verified only where they pay for themselves.
        self._kind_of_path = {}
        scored = [
            (self.acceptance.path_rates(path, [kind] * len(path), self._kind_of_path), path)
            for kind, paths in (("pool", self.pool.guesses(context[-1])), ("window", self._window.column_paths()))
            for path in paths
        ]
        return DraftTree.from_scored_paths(scored, budget)

    def _index_context(self, context: Sequence[int]) -> None:
        """Add the n-grams that end in tokens appended since the last call."""
        size = self.levels + 1
        for end in range(max(self._indexed + 1, size), len(context) + 1):
            self.pool.add(context[end - size : end])
        self._indexed = len(context)

    def observe(self, outcome: StepOutcome) -> None:
        self.acceptance.learn_step(outcome.tree, outcome.verification, self._kind_of_path)
        window = self._window
        if window is None:
            return
        emitted = len(outcome.verification.tokens)
        root = outcome.root
        rows = rows_by_path(outcome.tree)
        newest_rows: list[int] = []
        for path in window.column_paths():
            row = rows.get(path)
            if row is None:
                break  # the tree was cut: columns from here on were not evaluated
            newest_rows.append(row)
        # One reduction over every row beats gathering the few needed ones (a copy of vocabulary-wide rows).
        choices = greedy_choice(outcome.logits).tolist() if newest_rows else []
        newest = [choices[row] for row in newest_rows]
        for ngram in harvest(window, root, newest):
            self.pool.add(ngram)
        self._context = outcome.new_context
        self._window = shift_window(window, newest, emitted, self._fill)
