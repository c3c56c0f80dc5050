"""ADED (adaptive draft-verification): a tri-gram model of the target's output, adapted while decoding and searched
by Monte-Carlo tree search for the draft tree most likely to be accepted.

- The :class:`~draftwise.trigram.TrigramStore` holds P(c | a, b); it may start from a counted corpus
  (``draftwise corpus build``) or empty.
- Adaptation: after every verification the model's own top prediction at every verified row (rejected rows included:
  the forward computed them anyway) is added to the store under that row's last two tokens, as are the tri-grams of
  each new prompt, so the store converges to this model on this kind of text. The store outlives requests; ``save``
  and ``load`` carry it across processes.
- Search: PUCT selection with the tri-gram prior, expansion of every successor, rollouts sampled from the tri-gram
  rows, the path probability under the tri-gram model as the reward, back-propagation; the most visited paths are
  extended greedily by one token, merged (shared prefixes once) and scored.
- Copies: a tri-gram sees only two tokens back, so the continuations of earlier occurrences of the context's last
  2-4 tokens (as prompt lookup finds them) join the searched paths in the same tree; ``copy_length=0`` turns this
  off for pure tri-gram drafts.
- Recycling (beyond the published method, on by default): the model's own latest top-k predictions after each token (Token
  Recycling's adjacency matrix, :class:`~draftwise.successors.SuccessorMatrix`) fill a small tree template that joins
  the same tree. They come free with every verification forward and see what the model did most recently, where the
  tri-gram counts average over everything; ``recycle_top_k=0`` turns this off.
- Scores: each node is scored with its learned acceptance rate (per tri-gram probability bucket, or copied n-gram
  length, and depth), so the engine verifies only the part of the tree that pays for itself on this machine.
- Idle sources: where the engine keeps few nodes (a large batch, whose forward is dear per row), the searched and
  recycled nodes may never be verified: a source none of whose nodes was verified in :attr:`AdedDrafter.IDLE_PROPOSALS`
  proposals in a row is left out, but for one proposal in :attr:`AdedDrafter.PROBE_EVERY`, so drafting costs what
  it brings (the copies are always drafted).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence

from ..decoding.drafter import Drafter, StepOutcome
from ..decoding.tree import ROOT, DraftTree, prefix_scores
from ..decoding.verify import greedy_choice
from .stores.acceptance import AcceptanceTracker
from .stores.ngram import NGramIndex
from .stores.successors import SuccessorMatrix, rank_template
from .stores.trigram import TrigramStore

#: Prefix of the recycled predictions' arrays in a saved state.
RECYCLED = "recycled_"

#: Upper edges of the probability buckets that acceptance is learned per.
PROBABILITY_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9)


def probability_bucket(probability: float) -> int:
    for bucket, edge in enumerate(PROBABILITY_BUCKETS):
        if probability < edge:
            return bucket
    return len(PROBABILITY_BUCKETS)


class SearchTree:
    """The Monte-Carlo search tree, as flat lists (node 0 is the root, the context's last token)."""

    def __init__(self, pair: tuple[int, int]) -> None:
        self.tokens: list[int] = [pair[1]]
        self.parents: list[int] = [ROOT]
        self.priors: list[float] = [1.0]
        self.path_probability: list[float] = [1.0]
        self.depths: list[int] = [0]
        self.pairs: list[tuple[int, int]] = [pair]
        self.visits: list[int] = [0]
        self.value: list[float] = [0.0]
        self.children: list[list[int] | None] = [None]  # None = not expanded yet

    def add(self, parent: int, token: int, prior: float) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.priors.append(prior)
        self.path_probability.append(self.path_probability[parent] * prior)
        self.depths.append(self.depths[parent] + 1)
        self.pairs.append((self.pairs[parent][1], token))
        self.visits.append(0)
        self.value.append(0.0)
        self.children.append(None)
        return node

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to ``node``."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def search(
    lookup,
    pair: tuple[int, int],
    iterations: int,
    max_depth: int,
    rollout_depth: int,
    c1: float,
    c2: float,
    rng: random.Random,
) -> SearchTree:
    """Monte-Carlo tree search over the tri-gram model from the context's last two tokens ``pair``.

    ``lookup(a, b)`` returns the successors of ``(a, b)`` and their probabilities, strongest first. Selection is
    PUCT: ``Q + (c1 + ln((N + c2 + 1) / c2)) * prior * sqrt(N) / (1 + n)``; the reward of an iteration is the
    probability of the selected path and its rollout under the tri-gram model.
    """
    tree = SearchTree(pair)
    for _ in range(iterations):
        node = 0
        while tree.children[node]:
            parent_visits = tree.visits[node]
            explore = (c1 + math.log((parent_visits + c2 + 1) / c2)) * math.sqrt(parent_visits)
            best, best_value = -1, -math.inf
            for child in tree.children[node]:
                visits = tree.visits[child]
                value = (tree.value[child] / visits if visits else 0.0) + explore * tree.priors[child] / (1 + visits)
                if value > best_value:
                    best, best_value = child, value
            node = best
        if tree.children[node] is None:
            tree.children[node] = []
            if tree.depths[node] < max_depth:
                successors, probabilities = lookup(*tree.pairs[node])
                tree.children[node] = [tree.add(node, t, p) for t, p in zip(successors, probabilities)]
        reward = tree.path_probability[node]
        a, b = tree.pairs[node]
        for _ in range(rollout_depth):
            successors, probabilities = lookup(a, b)
            if not successors:
                break
            choice = rng.choices(range(len(successors)), weights=probabilities)[0]
            reward *= probabilities[choice]
            a, b = b, successors[choice]
        while node >= 0:
            tree.visits[node] += 1
            tree.value[node] += reward
            node = tree.parents[node]
    return tree


class AdedDrafter(Drafter):
    """Draft trees from an adaptive tri-gram model searched by Monte-Carlo tree search.

    Args:
        corpus: a tri-gram store written by ``draftwise corpus build`` (or a saved state) to start from.
        top_k: successors kept per token pair (when starting empty).
        max_pairs: memory bound of the store, in token pairs.
        iterations: search iterations per step. Few pay best beside the copies and the recycled template: on 30
            Spec-Bench prompts (SmolLM2-135M, bfloat16, 2-core CPU) 4 iterations gave 1.35x plain decoding at MAT
            1.98, against 1.30x (MAT 1.94) at 16 and 1.29x (MAT 1.89) at 8: the search's Python time is a step's
            tenth at 16.
        max_depth: deepest search node (the draft may be one token deeper after greedy extension).
        rollout_depth: tokens sampled after a selected node to estimate its reward.
        paths: most visited paths kept from the search.
        c1, c2: PUCT exploration constants.
        learning_rate: weight added to a tri-gram the model produced (capped at ``cap``).
        context_rate: weight added to each tri-gram of a new prompt.
        cap: largest weight of a successor.
        seed: seed of the rollouts; drafting is deterministic for a fixed seed.
        copy_length: tokens copied after each earlier occurrence of the context's last n-gram (n from 4 down to 2),
            merged into the searched tree as further candidate paths; 0 turns copying off (pure tri-gram drafts).
        copy_matches: occurrences copied at most.
        recycle_top_k: the model's latest top-k predictions kept per token and drafted from a template beside the
            search (Token Recycling's source); 0 turns this off (pure tri-gram drafts).
        recycle_depth, recycle_rank_budget: that template's depth and width (see
            :func:`~draftwise.successors.rank_template`).
    """

    name = "aded"
    #: Proposals in a row without a verified node from a source (the search, the recycled template) after which it is
    #: left out, and how often it is tried again then. The search and the template cost about 0.4 ms of Python a
    #: sequence and step, where at batch 8 on two cores the cost rule keeps one or two nodes a sequence, mostly
    #: copies: on 32 Spec-Bench prompts this made `aded` 1.05x plain decoding at batch 8 instead of 1.01x, 1.09x at
    #: batch 4 instead of 1.06x, and left batch 1 as fast.
    IDLE_PROPOSALS = 4
    PROBE_EVERY = 8
    #: The sources that can be left out.
    OPTIONAL_SOURCES = ("search", "recycled")

    def __init__(
        self,
        corpus: str | None = None,
        top_k: int = 12,
        max_pairs: int = 4_000_000,
        iterations: int = 4,
        max_depth: int = 5,
        rollout_depth: int = 4,
        paths: int = 24,
        c1: float = 32.0,
        c2: float = 8.0,
        learning_rate: float = 0.5,
        context_rate: float = 0.1,
        cap: float = 3.0,
        seed: int = 0,
        copy_length: int = 12,
        copy_matches: int = 2,
        recycle_top_k: int = 8,
        recycle_depth: int = 4,
        recycle_rank_budget: int = 3,
    ) -> None:
        if iterations < 1 or max_depth < 1 or rollout_depth < 0 or paths < 1:
            raise ValueError("need iterations >= 1, max_depth >= 1, rollout_depth >= 0 and paths >= 1")
        if learning_rate < 0 or context_rate < 0 or cap <= 0:
            raise ValueError("need learning_rate >= 0, context_rate >= 0 and cap > 0")
        if copy_length < 0 or copy_matches < 1:
            raise ValueError("need copy_length >= 0 and copy_matches >= 1")
        if recycle_top_k < 0 or recycle_depth < 1 or recycle_rank_budget < 0:
            raise ValueError("need recycle_top_k >= 0, recycle_depth >= 1 and recycle_rank_budget >= 0")
        self.copy_length = copy_length
        self.copy_matches = copy_matches
        self.recycled = SuccessorMatrix(recycle_top_k) if recycle_top_k else None
        self.recycle_template = rank_template(recycle_depth, recycle_rank_budget, recycle_top_k) if recycle_top_k else []
        # A tri-gram sees two tokens back; a longer match in the context predicts verbatim repeats far better.
        self.index = NGramIndex(2, 4)
        self.store = TrigramStore(top_k=top_k, max_pairs=max_pairs)
        if corpus is not None:
            self.load(corpus)
        self.iterations = iterations
        self.max_depth = max_depth
        self.rollout_depth = rollout_depth
        self.paths = paths
        self.c1 = c1
        self.c2 = c2
        self.learning_rate = learning_rate
        self.context_rate = context_rate
        self.cap = cap
        self.rng = random.Random(seed)
        self.acceptance = AcceptanceTracker()
        self._kind_of_path: dict[tuple[int, ...], object] = {}
        self._own_source_state()

    def _own_source_state(self) -> None:
        # By optional source: proposals in a row without a verified node from it; the sources of the last proposal.
        self._idle = dict.fromkeys(self.OPTIONAL_SOURCES, 0)
        self._proposals = 0
        self._drafted_sources: tuple[str, ...] = ()

    def reset(self, prompt: Sequence[int]) -> None:
        self.index.reset()
        if self.context_rate:
            self.store.add_sequence(prompt, self.context_rate, self.cap)

    def _own_sequence_state(self) -> None:
        self.index = NGramIndex(2, 4)
        self.rng = random.Random(self.rng.random())
        self._kind_of_path = {}
        self._own_source_state()

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        self._kind_of_path = {}
        self._drafted_sources = ()
        if len(context) < 2 or budget < 1:
            return DraftTree()
        self._proposals += 1
        probe = self._proposals % self.PROBE_EVERY == 0
        self._drafted_sources = tuple(source for source, idle in self._idle.items()
                                      if idle < self.IDLE_PROPOSALS or probe)
        rows: dict[tuple[int, int], tuple[list[int], list[float]]] = {}

        def lookup(a: int, b: int) -> tuple[list[int], list[float]]:
            row = rows.get((a, b))
            if row is None:
                row = rows[(a, b)] = self.store.row(a, b)
            return row

        paths = self._copies(context)
        if "search" in self._drafted_sources:
            found = search(
                lookup, (context[-2], context[-1]), self.iterations, self.max_depth, self.rollout_depth,
                self.c1, self.c2, self.rng,
            )
            paths += self._searched_paths(found, lookup)
        scores = prefix_scores(paths)
        if "recycled" in self._drafted_sources:
            self._score_recycled(context, scores, budget)
        return DraftTree.from_prefix_scores(scores, budget)

    @staticmethod
    def _source(kind: object) -> str:
        """The source of a node's kind: ``"copy"``, ``"recycled"`` or ``"search"`` (a probability bucket)."""
        return kind[0] if isinstance(kind, tuple) else "search"

    def _note_verified_sources(self, tree: DraftTree) -> None:
        """Count, for each optional source of the last proposal, whether the engine verified any of its nodes."""
        if not self._drafted_sources:
            return
        prefixes: list[tuple[int, ...]] = []
        verified: set[str] = set()
        for token, parent in zip(tree.tokens, tree.parents):
            prefix = (token,) if parent == ROOT else (*prefixes[parent], token)
            prefixes.append(prefix)
            kind = self._kind_of_path.get(prefix)
            if kind is not None:
                verified.add(self._source(kind))
        for source in self._drafted_sources:
            self._idle[source] = 0 if source in verified else self._idle[source] + 1
        self._drafted_sources = ()

    def _score_recycled(self, context: Sequence[int], scores: dict[tuple[int, ...], float], budget: int) -> None:
        """Add the ``budget`` best nodes of the recycled-prediction template below the context's last token (kind:
        rank) to ``scores``, node by node: a node's score is its parent's times its own rate, as for a path through
        it."""
        if self.recycled is None:
            return
        prefixes: list[tuple[int, ...]] = []
        reaches: list[float] = []
        nodes = self.recycled.fill_best(
            context[-1], self.recycle_template,
            lambda rank, paired, depth: self.acceptance.rate(("recycled", rank), depth), budget,
        )
        for ranks, token, parent, _, _ in nodes:
            prefix = (token,) if parent == ROOT else (*prefixes[parent], token)
            kind = self._kind_of_path.setdefault(prefix, ("recycled", ranks[-1]))
            reach = (1.0 if parent == ROOT else reaches[parent]) * self.acceptance.rate(kind, len(prefix))
            prefixes.append(prefix)
            reaches.append(reach)
            scores[prefix] = max(scores.get(prefix, 0.0), reach)

    def _copies(self, context: Sequence[int]) -> list[tuple[list[float], list[int]]]:
        """What followed earlier occurrences of the context's last n-gram, longest n-grams first."""
        if not self.copy_length:
            return []
        self.index.extend(context)
        return [
            (self.acceptance.path_rates(continuation, [("copy", n)] * len(continuation), self._kind_of_path), list(continuation))
            for n, continuation in self.index.copies(context, self.copy_length, self.copy_matches)
        ]

    def _searched_paths(self, found: SearchTree, lookup) -> list[tuple[list[float], list[int]]]:
        """The most visited search paths, each extended by its greedy tri-gram successor, with calibrated
        acceptance rates (per tri-gram probability bucket and depth)."""
        visited = sorted((node for node in range(1, len(found.tokens)) if found.visits[node]),
                         key=lambda node: (-found.visits[node], found.depths[node]))[: self.paths]
        chosen = set(visited)
        for node in visited:  # ties can leave an ancestor out: keep the set prefix-closed
            chosen.update(found.path(node))
        leaves = [node for node in visited if not any(child in chosen for child in found.children[node] or ())]
        scored_paths = []
        for leaf in leaves:
            nodes = found.path(leaf)
            tokens = [found.tokens[node] for node in nodes]
            probabilities = [found.priors[node] for node in nodes]
            successors, successor_probabilities = lookup(*found.pairs[leaf])
            if successors:
                tokens.append(successors[0])
                probabilities.append(successor_probabilities[0])
            scored_paths.append((self.acceptance.path_rates(
                tokens, [probability_bucket(p) for p in probabilities], self._kind_of_path
            ), tokens))
        return scored_paths

    def observe(self, outcome: StepOutcome) -> None:
        tree = outcome.tree
        root, before = outcome.root, outcome.before_root
        row_tokens = tree.row_tokens(root)
        previous = tree.row_previous(root, before)
        if self.recycled is not None:
            predictions = self.recycled.observe(row_tokens, previous, outcome.logits)[:, 0].tolist()
        else:
            predictions = greedy_choice(outcome.logits[: len(row_tokens)]).tolist()
        # The model's top prediction at every row, under that row's last two tokens.
        pairs = zip(previous, row_tokens)
        for (a, b), prediction in zip(pairs, predictions):
            if a is not None:
                self.store.queue(a, b, prediction, self.learning_rate, self.cap)
        # The emitted tokens once more: the output itself weighs more than predictions off the path (and when
        # sampling, the emitted token need not be the top prediction).
        if before is not None:
            self.store.queue_sequence([before, root, *outcome.verification.tokens], self.learning_rate, self.cap)
        self.acceptance.learn_step(tree, outcome.verification, self._kind_of_path)
        self._note_verified_sources(tree)

    def save(self, path: str | os.PathLike) -> None:
        """Write the adapted store and the recycled predictions (numpy ``.npz``, the format of ``draftwise corpus
        build`` with the recycled state's arrays beside it)."""
        recycled = self.recycled.state() if self.recycled is not None else {}
        self.store.save(path, arrays={f"{RECYCLED}{name}": array for name, array in recycled.items()})

    def load(self, path: str | os.PathLike) -> None:
        """Replace the store with a saved one (a corpus or a saved state, which brings its recycled predictions)."""
        self.store, _, arrays = TrigramStore.read(path)
        if self.recycled is not None:
            recycled = {name[len(RECYCLED):]: array for name, array in arrays.items() if name.startswith(RECYCLED)}
            if recycled:  # a corpus has none; a saved state of another width is refused by load_state
                self.recycled.load_state(recycled)
