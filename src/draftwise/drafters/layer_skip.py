"""Self-speculation by layer skipping (SWIFT's way): the target drafts for itself with some sub-layers left out.

No second model and no training: the draft is the target's own lean forward with a *skip set* (attention and MLP
sub-layers of the middle layers; the first and last layer are always kept). Drafting runs on the sequence's own KV
cache after its committed length: a kept attention layer reads the context's real keys and values and writes its
draft rows' there, a skipped one writes nothing. Those slots are scratch that every verification forward overwrites,
and the cache is rolled back to its committed length after each proposal, so the target's cache is never changed.

**The skip set is searched online.** Each candidate drafts for a few steps and is scored by the tokens per second its
steps delivered (accepted drafts plus the target's own token, over the target's and the draft's time). The first
candidate skips the middle layers' attentions (then their MLPs); the next ones are random sets of the configured
size or, mostly, mutations of the best one (a skipped sub-layer swapped for a kept one): a random search over the
sets. Once the trials are spent the best set is kept.

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

from ..backend.lean import LayerSkip, LeanTarget
from ..backend.rows import RowBlock
from ..decoding.drafter import Drafter, SequenceSetup, StepOutcome
from ..decoding.latency import LatencyModel
from ..decoding.sampling import SamplingParams
from ..decoding.tree import ROOT, DraftTree
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


@dataclass
class Trial:
    """One candidate skip set and what its steps delivered."""

    skipped: frozenset[SubLayer]
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SkipSearch:
    """Online random search over skip sets of ``size`` sub-layers (see the module docstring).

    Args:
        layers: the target's layer count.
        ratio: share of the skippable sub-layers left out.
        trials: candidates evaluated before the best is kept for good.
        steps_per_trial: drafting steps that score a candidate.
        seed: seed of the search's random choices.
    """

    layers: int
    ratio: float = 0.45
    trials: int = 24
    steps_per_trial: int = 6
    seed: int = 0
    history: list[Trial] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)
        self._pool = skippable(self.layers)
        self.size = round(self.ratio * len(self._pool))
        self.current = Trial(self._first())

    def _first(self) -> frozenset[SubLayer]:
        # Start from the attentions of the middle layers, then their MLPs: on SmolLM2, skipping five middle
        # attentions kept 8 of 11 next-token argmaxes, skipping seven late-layer attentions 2 of 11.
        middle = (self.layers - 1) / 2
        ranked = sorted(self._pool, key=lambda sub: (sub[1] != "attention", abs(sub[0] - middle), sub[0]))
        return frozenset(ranked[: self.size])

    @property
    def searching(self) -> bool:
        return len(self.history) < self.trials

    @property
    def best(self) -> Trial:
        scored = [trial for trial in self.history if trial.steps] + ([self.current] if self.current.steps else [])
        return max(scored, key=lambda trial: trial.rate, default=self.current)

    @property
    def skip(self) -> LayerSkip:
        return as_layer_skip(self.current.skipped)

    def record(self, tokens: int, seconds: float) -> None:
        """One drafting step with the current set: ``tokens`` emitted in ``seconds`` (target and draft)."""
        self.current.steps += 1
        self.current.tokens += tokens
        self.current.seconds += seconds
        if self.searching and self.current.steps >= self.steps_per_trial:
            self.history.append(self.current)
            self.current = Trial(self._candidate()) if self.searching else Trial(self.best.skipped)

    def _candidate(self) -> frozenset[SubLayer]:
        if not self._pool or self.size == 0:
            return frozenset()
        if self._random.random() < 0.25 or not self.history:
            return frozenset(self._random.sample(self._pool, self.size))
        best = set(self.best.skipped)
        kept = [sub for sub in self._pool if sub not in best]
        for _ in range(self._random.choice((1, 1, 2))):
            if not kept or not best:
                break
            out, into = self._random.choice(sorted(best)), self._random.choice(kept)
            best.remove(out)
            best.add(into)
            kept.remove(into)
            kept.append(out)
        return frozenset(best)


class LayerSkipDrafter(Drafter):
    """Drafts with the target itself, some sub-layers skipped (``layerskip``); needs the lean backend.

    Args:
        ratio: share of the middle layers' sub-layers skipped.
        depth: longest draft chain.
        threshold: stop the chain when the draft's probability of its token falls below this.
        trials: skip sets tried (a few steps each) before the best is kept.
        adaptive: also stop when the next level's expected accepted tokens are worth less than its cost.
        seed: seed of the skip-set search.
    """

    name = "layerskip"

    def __init__(
        self,
        ratio: float = 0.45,
        depth: int = 8,
        threshold: float = 0.5,
        trials: int = 24,
        adaptive: bool = True,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"ratio must be in [0, 1), got {ratio}")
        if depth < 1 or trials < 0 or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"need depth >= 1, trials >= 0 and 0 <= threshold <= 1 (got {depth}, {trials}, {threshold})")
        self.ratio, self.depth, self.threshold = float(ratio), int(depth), float(threshold)
        self.trials, self.adaptive, self.seed = int(trials), bool(adaptive), int(seed)
        # Shared by forks: the search, the acceptance calibration and the draft's measured cost.
        self._shared: dict[str, Any] = {
            "target": None, "search": None, "tracker": AcceptanceTracker(), "clock": LevelClock(),
        }
        self._own_sequence_state()

    def _own_sequence_state(self) -> None:
        self._cache: Any = None
        self._sampling = SamplingParams()
        self._latency: LatencyModel | None = None
        self._generator: torch.Generator | None = None
        self._kinds: dict[tuple[int, ...], int] = {}
        self._draft_seconds = 0.0

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
                search=SkipSearch(len(setup.target.layers), self.ratio, self.trials, seed=self.seed),
            )
        self._cache = setup.cache
        self._sampling = setup.sampling
        self._latency = setup.latency
        self._generator = setup.sampling.generator()

    @torch.inference_mode()
    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        target: LeanTarget = self._shared["target"]
        committed = target.cache_length(self._cache)
        if budget <= 0 or committed != len(context) - 1:
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
        self._draft_seconds = time.perf_counter() - started
        return growth.tree(with_q=not greedy)

    def observe(self, outcome: StepOutcome) -> None:
        if not len(outcome.tree):
            return
        self._shared["tracker"].learn_step(outcome.tree, outcome.verification, self._kinds)
        forward = self._latency.cost(len(outcome.tree) + 1) if self._latency is not None else 0.0
        self.search.record(len(outcome.emitted), forward + self._draft_seconds)
