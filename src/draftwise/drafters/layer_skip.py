"""Self-speculation by layer skipping (SWIFT's way): the target drafts for itself with some sub-layers left out.

No second model and no training: the draft is the target's own lean forward with a *skip set* (attention and MLP
sub-layers of the middle layers; the first and last layer are always kept). Drafting runs on the sequence's own KV
cache after its committed length: a kept attention layer reads the context's real keys and values and writes its
draft rows' there, a skipped one writes nothing. Those slots are scratch that every verification forward overwrites,
and the cache is rolled back to its committed length after each proposal, so the target's cache is never changed.

**The skip set is searched online, as SWIFT does.** A candidate set is scored by its *matchness*: the share of a
window of tokens the model already generated (the first ``window + 1`` of a sequence's output) whose next token the
skipped model's argmax predicts, all positions in one forward of the skipped model over the committed cache
(:meth:`~draftwise.backend.forward.lean.LeanTarget.skipped_logits`, which leaves the cache bitwise as it was). One
candidate is scored per decoding step, drafted or not (a set that does not pay must not stall the search): random sets
of the configured size, and every ``bayes_interval``-th one the suggestion of a Bayesian optimiser (a Gaussian process
over the sets scored so far, by `bayesian-optimization`_). A candidate that scores above the best replaces it; the
best is scored again on every new sequence's window and ranked by its mean (one lucky window must not crown a set).
The search stops once the best reaches ``target_match``, after ``patience`` candidates without improvement or
``trials`` in all, and it gives up (and drafting with it) when even drafts accepted as often as the best set matches
could not pay for their forwards at the measured costs. It takes at most ``search_share`` of the decoding time, counts
as drafting time, and is shared by every sequence a drafter serves.

.. _bayesian-optimization: https://github.com/bayesian-optimization/BayesianOptimization

**Drafting stops when the draft is unsure:** a chain continues while the skipped model's probability of its own
token stays above ``threshold`` and the next level's expected accepted tokens are worth its cost.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from bayes_opt import BayesianOptimization, acquisition

from ..backend.calibration.machine import finish_queued_work
from ..backend.forward.lean import LayerSkip, LeanTarget
from ..backend.rows import RowBlock
from ..decoding.drafter import Drafter, SequenceSetup, StepOutcome
from ..decoding.latency import LatencyModel
from ..decoding.sampling import SamplingParams
from ..decoding.tree import ROOT, DraftTree
from ..decoding.verify import greedy_choice
from ..errors import UnsupportedModelError
from .draft_model import LevelClock, TreeGrowth, draft_distribution, worth_another_level
from .stores.acceptance import AcceptanceTracker

#: A sub-layer: (layer index, "attention" or "mlp").
SubLayer = tuple[int, str]


def skippable(layers: int) -> list[SubLayer]:
    """Every sub-layer a draft may skip: those of all layers but the first and the last."""
    return [(layer, part) for layer in range(1, layers - 1) for part in ("attention", "mlp")]


def as_layer_skip(skipped: frozenset[SubLayer]) -> LayerSkip:
    return LayerSkip(
        attention=frozenset(layer for layer, part in skipped if part == "attention"),
        mlp=frozenset(layer for layer, part in skipped if part == "mlp"),
    )


def chain_speedup(match: float, level_seconds: float, latency: LatencyModel, depth: int) -> float:
    """The best speedup over plain steps of draft chains up to ``depth`` long whose tokens are each accepted with
    probability ``match``, a draft level costing ``level_seconds`` and verification priced by ``latency``."""
    plain, tokens, reach, best = latency.cost(1), 1.0, 1.0, 0.0
    for length in range(1, depth + 1):
        reach *= match
        tokens += reach
        best = max(best, tokens * plain / (length * level_seconds + latency.cost(length + 1)))
    return best


def matchness(predicted: torch.Tensor, actual: Sequence[int]) -> float:
    """Share of positions where the skipped model's greedy token (``predicted[i]``) is the token that came next."""
    expected = torch.as_tensor(list(actual), dtype=predicted.dtype, device=predicted.device)
    return float((predicted[: len(expected)] == expected).float().mean()) if len(expected) else 0.0


@dataclass
class SkipSearch:
    """SWIFT's online search over skip sets of ``size`` sub-layers (see the module docstring).

    Args:
        layers: the target's layer count.
        ratio: share of the skippable sub-layers left out.
        trials: most candidates scored.
        patience: stop after this many candidates in a row that did not beat the best.
        target_match: stop once the best set's matchness reaches this.
        bayes_interval: every this many candidates, the Bayesian optimiser's suggestion instead of a random set.
        seed: seed of the random sets and of the optimiser.
    """

    layers: int
    ratio: float = 0.45
    trials: int = 200
    patience: int = 60
    target_match: float = 0.93
    bayes_interval: int = 25
    seed: int = 0
    #: Every scored candidate and its matchness, in order.
    history: list[tuple[frozenset[SubLayer], float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)
        self._pool = skippable(self.layers)
        self.size = round(self.ratio * len(self._pool))
        self.best: frozenset[SubLayer] = self._first()
        self.best_match = -1.0
        self.given_up = False
        #: Score the best set again next (set for every new sequence: a new window of text).
        self.rescore = False
        self._scores: dict[frozenset[SubLayer], list[float]] = {}
        self._since_best = 0
        self._optimiser: BayesianOptimization | None = None

    def _first(self) -> frozenset[SubLayer]:
        # Start from the attentions of the middle layers, then their MLPs: on SmolLM2, skipping five middle
        # attentions kept 8 of 11 next-token argmaxes, skipping seven late-layer attentions 2 of 11.
        middle = (self.layers - 1) / 2
        ranked = sorted(self._pool, key=lambda sub: (sub[1] != "attention", abs(sub[0] - middle), sub[0]))
        return frozenset(ranked[: self.size])

    @property
    def searching(self) -> bool:
        return bool(self._pool) and self.size > 0 and not self.given_up and len(self.history) < self.trials and (
            self.best_match < self.target_match and self._since_best < self.patience
        )

    @property
    def skip(self) -> LayerSkip:
        """The skip set drafts use: the best scored so far."""
        return as_layer_skip(self.best)

    def candidate(self) -> frozenset[SubLayer]:
        """The next set to score: the starting set first, then random sets, every ``bayes_interval``-th one the
        Bayesian optimiser's suggestion."""
        if not self.history or self.rescore:
            self.rescore = False
            return self.best
        if (len(self.history) + 1) % self.bayes_interval == 0:
            suggestion = self._optimiser_of().suggest()
            ranked = sorted(range(len(self._pool)), key=lambda index: -suggestion[f"x{index}"])
            return frozenset(self._pool[index] for index in ranked[: self.size])
        return frozenset(self._random.sample(self._pool, self.size))

    def record(self, skipped: frozenset[SubLayer], match: float) -> None:
        """The matchness of one scored candidate. The best set is the one with the highest mean over the windows it
        was scored on: the best of many one-window scores flatters its set, so the best is scored again on every new
        sequence's window and keeps its place only while its mean stays ahead."""
        self.history.append((skipped, match))
        scores = self._scores.setdefault(skipped, [])
        if not scores:  # (the optimiser takes each point once)
            self._optimiser_of().register(params=self._point(skipped), target=match)
        scores.append(match)
        previous = self.best_match
        means = ((candidate, sum(values) / len(values)) for candidate, values in self._scores.items())
        self.best, self.best_match = max(means, key=lambda pair: pair[1])
        self._since_best = 0 if self.best_match > previous else self._since_best + 1

    def judge(self, level_seconds: float, latency: LatencyModel, depth: int) -> None:
        """Give up once the random sets before the first Bayesian suggestion are scored and even drafts accepted as
        often as the best set matches would not pay for their forwards (a draft level costing ``level_seconds``): the
        search's cost could not be won back, and drafting with that set would only slow decoding down."""
        if len(self.history) >= self.bayes_interval - 1:
            self.given_up = chain_speedup(self.best_match, level_seconds, latency, depth) < 1.0

    def _point(self, skipped: frozenset[SubLayer]) -> dict[str, float]:
        return {f"x{index}": float(sub in skipped) for index, sub in enumerate(self._pool)}

    def _optimiser_of(self) -> BayesianOptimization:
        if self._optimiser is None:
            # SWIFT's settings: a coordinate per sub-layer in [0, 1] (the top ``size`` are skipped), upper
            # confidence bound with kappa 2.5, observation noise 1e-2 (matchness over a short window is noisy).
            self._optimiser = BayesianOptimization(
                f=None, pbounds={f"x{index}": (0.0, 1.0) for index in range(len(self._pool))},
                acquisition_function=acquisition.UpperConfidenceBound(kappa=2.5),
                random_state=self.seed, verbose=0,
            )
            self._optimiser.set_gp_params(alpha=1e-2)
        return self._optimiser


class LayerSkipDrafter(Drafter):
    """Drafts with the target itself, some sub-layers skipped (``layerskip``); needs the lean backend.

    Args:
        ratio: share of the middle layers' sub-layers skipped.
        depth: longest draft chain.
        threshold: stop the chain when the draft's probability of its token falls below this.
        window: generated tokens whose next token a candidate skip set is scored on (its matchness).
        trials: most skip sets scored (one per decoding step) before the best is kept for good.
        patience: stop searching after this many sets in a row that did not beat the best.
        target_match: stop searching once the best set's matchness reaches this.
        bayes_interval: every this many sets, the Bayesian optimiser's suggestion instead of a random one.
        search_share: most share of decoding time the search may take (a set is scored once the search's time so far
            is below this share of the steps seen, priced at one plain step each).
        adaptive: also stop when the next level's expected accepted tokens are worth less than its cost.
        seed: seed of the skip-set search.
    """

    name = "layerskip"

    def __init__(
        self,
        ratio: float = 0.45,
        depth: int = 8,
        threshold: float = 0.5,
        window: int = 32,
        trials: int = 200,
        patience: int = 60,
        target_match: float = 0.93,
        bayes_interval: int = 25,
        search_share: float = 0.1,
        adaptive: bool = True,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"ratio must be in [0, 1), got {ratio}")
        if depth < 1 or trials < 0 or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"need depth >= 1, trials >= 0 and 0 <= threshold <= 1 (got {depth}, {trials}, {threshold})")
        if window < 1 or patience < 1 or bayes_interval < 1 or not 0.0 <= target_match <= 1.0 or search_share <= 0:
            raise ValueError(
                f"need window, patience and bayes_interval >= 1, 0 <= target_match <= 1 and search_share > 0 "
                f"(got {window}, {patience}, {bayes_interval}, {target_match}, {search_share})"
            )
        self.ratio, self.depth, self.threshold = float(ratio), int(depth), float(threshold)
        self.window, self.trials, self.patience = int(window), int(trials), int(patience)
        self.target_match, self.bayes_interval = float(target_match), int(bayes_interval)
        self.search_share = float(search_share)
        self.adaptive, self.seed = bool(adaptive), int(seed)
        # Shared by forks: the search, the acceptance calibration and the draft's measured cost.
        self._shared: dict[str, Any] = {
            "target": None, "search": None, "tracker": AcceptanceTracker(), "clock": LevelClock(),
            "steps": 0, "search_seconds": 0.0,
        }
        self._own_sequence_state()

    def _own_sequence_state(self) -> None:
        self._cache: Any = None
        self._sampling = SamplingParams()
        self._latency: LatencyModel | None = None
        self._generator: torch.Generator | None = None
        self._kinds: dict[tuple[int, ...], int] = {}
        self._prompt_length: int | None = None

    @property
    def search(self) -> SkipSearch:
        return self._shared["search"]

    def attach(self, setup: SequenceSetup) -> None:
        if not isinstance(setup.target, LeanTarget):
            raise UnsupportedModelError(
                "layerskip drafts with the engine's own forward: load the model with backend='lean' or 'auto' "
                "(llama and qwen2 families)"
            )
        if self._shared["target"] is not setup.target:
            self._shared.update(
                target=setup.target,
                search=SkipSearch(len(setup.target.layers), self.ratio, self.trials, self.patience,
                                  self.target_match, self.bayes_interval, seed=self.seed),
            )
        self._cache = setup.cache
        self._sampling = setup.sampling
        self._latency = setup.latency
        self._generator = setup.sampling.generator()

    def reset(self, prompt: Sequence[int]) -> None:
        self._prompt_length = len(prompt)
        if self.search is not None and self.search.history:
            self.search.rescore = True

    @torch.inference_mode()
    def _score_candidate(self, sequence: Sequence[int]) -> None:
        """Score one candidate skip set on the sequence's first ``window + 1`` generated tokens, once the cache holds
        them all (SWIFT's window: every candidate of a sequence is scored on the same text) and the search is within
        its share of the decoding time."""
        shared, search, start = self._shared, self.search, self._prompt_length
        target: LeanTarget = shared["target"]
        shared["steps"] += 1
        if start is None or not search.searching or target.cache_length(self._cache) < start + self.window + 1:
            return
        step_seconds = self._latency.cost(1) if self._latency is not None else 0.0
        if shared["search_seconds"] > self.search_share * shared["steps"] * step_seconds:
            return
        level_seconds = shared["clock"].estimate(1)
        if level_seconds is not None and self._latency is not None:
            search.judge(level_seconds, self._latency, self.depth)
            if search.given_up:
                return
        started = time.perf_counter()
        candidate = search.candidate()
        rows = sequence[start : start + self.window + 1]
        predicted = greedy_choice(target.skipped_logits(self._cache, rows, start, as_layer_skip(candidate)))
        search.record(candidate, matchness(predicted[:-1], rows[1:]))
        shared["search_seconds"] += time.perf_counter() - started

    @torch.inference_mode()
    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        target: LeanTarget = self._shared["target"]
        committed = target.cache_length(self._cache)
        if budget <= 0 or committed != len(context) - 1 or self.search.given_up:
            return DraftTree()
        started = time.perf_counter()
        greedy = self._sampling.greedy
        growth = TreeGrowth(self._shared["tracker"])
        clock = self._shared["clock"]
        skip = self.search.skip
        node, token = ROOT, int(context[-1])
        try:
            for _ in range(min(self.depth, budget)):
                if self.adaptive and node != ROOT and not worth_another_level(
                    self._latency, clock, 1, growth.expected_child_gain(node), growth.scores, budget,
                    time.perf_counter() - started
                ):
                    break
                level_started = time.perf_counter()
                logits = target.forward([self._cache], [RowBlock.chain([token])], skip=skip).logits[0][-1]
                target.commit(self._cache, [0])
                finish_queued_work(target.device)  # (the level's time, not its launch's)
                clock.record(1, time.perf_counter() - level_started)
                q = draft_distribution(logits, self._sampling)
                added = growth.add_children(node, q, 1, greedy, self._generator)
                if not added or float(q[growth.tokens[added[0]]]) < self.threshold:
                    break
                node = added[0]
                token = growth.tokens[node]
        finally:
            target.truncate(self._cache, committed)
        self._kinds = growth.kinds
        return growth.tree(with_q=not greedy)

    def observe(self, outcome: StepOutcome) -> None:
        if len(outcome.tree):
            self._shared["tracker"].learn_step(outcome.tree, outcome.verification, self._kinds)
        # Every step, drafted or not: a pause in drafting (the current set does not pay) must not stop the search.
        self._score_candidate((*outcome.context, *outcome.emitted))
