"""A separate, smaller draft model with the target's vocabulary: chain drafts or dynamic trees (EAGLE-2's way).

The draft model keeps its own KV cache, synchronised before every proposal with the sequence as it now stands:
whatever the last verification accepted or rejected, the cache is rolled back to the longest prefix it shares with
the context and the rest is fed in one forward, so its state always equals a fresh prefill of the context.

**Trees.** From the root's draft distribution ``q``, the ``width`` best tokens (greedy) or ``width`` tokens drawn
without replacement (sampling) become nodes scored by their cumulative draft probability. Each level then expands
the ``width`` best-scoring nodes of the level before, and the engine keeps the globally best nodes that pay for
their verification (:func:`~draftwise.decoding.policy.size_trees`). ``width=1`` (the default) is a plain chain,
whose drafted rows stay in the draft cache for the next step. A level is only
drafted while its expected accepted tokens are worth more target time than the level's own forward costs.

**Vocabulary.** A draft model's output head is a large part of its forward (9 of the 53 ms of a one-row forward
of a 0.5B model with a 152k vocabulary). The draft scores only the ``vocab`` most frequent tokens (:class:`DraftHead`: the
lowest ids, which byte-level BPE and sentencepiece vocabularies give to their most frequent tokens) and every token
the context has held; that misses a rare token now and then, which costs a rejected draft, never a wrong output.
A quantised head is cut by whole tiles of its packed weights (Qwen2.5-Coder-0.5B's Q8_0 head on a Zen 5: 2.8 ms a
row for 151936 tokens, 0.39 ms for the lowest 32768).

**Sampling.** The proposal carries every row's ``q`` (the draft's softmax at the request's temperature), so the
engine verifies by rejection sampling (chain) or recursive rejection without replacement (trees): the output has
exactly the target's distribution. Siblings are numbered in the order they were drawn and scored so that any cut
of the tree keeps a prefix of those draws.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..backend.calibration.machine import finish_queued_work
from ..backend.forward.lean import LeanTarget
from ..backend.rows import CACHE, RowBlock
from ..backend.target import Target
from ..backend.weights.quantized import KINDS, TILE_OUTPUTS, QuantizedLinear, check_activation_bits
from ..decoding.drafter import Drafter, SequenceSetup, StepOutcome
from ..decoding.latency import LatencyModel
from ..decoding.sampling import SamplingParams
from ..decoding.tree import ROOT, DraftTree
from ..errors import UnsupportedModelError
from ..models import eos_token_ids, load_model, make_target
from .stores.acceptance import AcceptanceTracker


#: The draft model's weights (see :class:`DraftModelDrafter`).
DRAFT_WEIGHTS = ("file", *KINDS, "float")


def draft_distribution(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The draft distribution ``q`` of logit rows: softmax at the request's temperature (1 for greedy requests,
    where ``q`` only ranks and scores drafts)."""
    temperature = 1.0 if sampling.greedy else sampling.temperature
    return torch.softmax(logits.float() / temperature, dim=-1)


def pick_children(q: torch.Tensor, count: int, greedy: bool, generator: torch.Generator | None) -> list[int]:
    """``count`` indices of ``q``: the most likely ones (greedy), or draws without replacement in the order drawn
    (sampling), never one of probability 0."""
    count = min(count, int((q > 0).sum()))
    if count <= 0:
        return []
    if greedy:
        return torch.topk(q, count).indices.tolist()
    return torch.multinomial(q.cpu(), count, replacement=False, generator=generator).tolist()


#: Calibration buckets of draft probabilities (:func:`confidence_kind`).
CONFIDENCE_KINDS = 11


def confidence_kind(probability: float) -> int:
    """The calibration bucket of a draft token's probability: ``floor(-log2 q)``, 0 (q > 1/2) to 10."""
    return min(CONFIDENCE_KINDS - 1, int(-math.log2(max(probability, 1e-12))))


class DraftHead:
    """The draft model's output head over part of the vocabulary: the ``size`` lowest token ids, plus every token
    it is shown with :meth:`cover` (the context's tokens, the end-of-sequence tokens).

    Its logits are over those tokens only (column ``i`` is token :attr:`ids` ``[i]``); :meth:`expand` puts a
    distribution over them back on the whole vocabulary (zero elsewhere), so a sampled draft's ``q`` is exactly the
    distribution it was drawn from. A quantised head (:class:`QuantizedLinear`) is cut by whole tiles of 8 outputs
    (``size`` rounded up to them), its covered tokens' tiles gathered; float ones by rows.

    Args:
        draft: the draft model (the lean forward: its head is replaced in the forward).
        size: how many of the lowest ids are always scored.
    """

    def __init__(self, draft: LeanTarget, size: int) -> None:
        self._tiled = draft.head if isinstance(draft.head, QuantizedLinear) else None
        if self._tiled is not None:
            size = -(-size // TILE_OUTPUTS) * TILE_OUTPUTS
            self.vocab, self.size = self._tiled.out_features, size
            bias = self._tiled.bias
            self.base: Any = self._tiled.tile_product(slice(0, size // TILE_OUTPUTS))
            self._base_bias = None if bias is None else bias[:size]
        else:
            output = draft.model.get_output_embeddings()
            self.weight = output.weight.detach()
            self.vocab, self.size = self.weight.shape[0], size
            bias = None if output.bias is None else output.bias.detach()
            self.base = draft.linear(self.weight[:size], None if bias is None else bias[:size])
            self._base_bias = None
            self._extra_weight = self.weight[:0]
        self._bias = bias
        self._extra_bias = None
        self._extra_product: Any = None
        self._extra_columns: torch.Tensor | None = None
        self.extra: list[int] = []
        self._extra_set: set[int] = set()
        self.ids = torch.arange(size, device=(self._tiled.weight if self._tiled is not None else self.weight).device)

    def covers(self, token: int) -> bool:
        return token < self.size or token in self._extra_set

    def cover(self, tokens: Sequence[int]) -> None:
        """Score ``tokens`` from now on too."""
        new = sorted({int(token) for token in tokens if token >= self.size} - self._extra_set)
        new = [token for token in new if token < self.vocab]
        if not new:
            return
        self.extra += new
        self._extra_set.update(new)
        index = torch.tensor(self.extra, device=self.ids.device)
        if self._tiled is not None:
            tiles = sorted({token // TILE_OUTPUTS for token in self.extra})
            where = {tile: position for position, tile in enumerate(tiles)}
            self._extra_product = self._tiled.tile_product(torch.tensor(tiles, device=index.device))
            self._extra_columns = torch.tensor(
                [where[token // TILE_OUTPUTS] * TILE_OUTPUTS + token % TILE_OUTPUTS for token in self.extra],
                device=index.device)
        else:
            self._extra_weight = self.weight.index_select(0, index)
        self._extra_bias = None if self._bias is None else self._bias.index_select(0, index)
        self.ids = torch.cat([torch.arange(self.size, device=index.device), index])

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.base(hidden)
        if self._base_bias is not None:  # (one float32 addition, as the kernel adds a bias)
            logits = logits + self._base_bias
        if not self.extra:
            return logits
        if self._extra_product is None:
            extra = torch.nn.functional.linear(hidden, self._extra_weight, self._extra_bias)
        else:
            extra = self._extra_product(hidden).index_select(-1, self._extra_columns)
            if self._extra_bias is not None:
                extra = extra + self._extra_bias
        return torch.cat([logits, extra], -1)

    def expand(self, probabilities: torch.Tensor) -> torch.Tensor:
        """Rows of probabilities over :attr:`ids` as rows over the whole vocabulary."""
        full = probabilities.new_zeros(*probabilities.shape[:-1], self.vocab)
        return full.index_copy_(-1, self.ids[: probabilities.shape[-1]], probabilities)


class TreeGrowth:
    """A draft tree grown level by level below the root, with each expanded row's ``q``.

    Args:
        tracker: acceptance rates by draft-probability bucket and depth: a node's score is its parent's times the
            rate its bucket has had at its depth (raw draft probabilities are poor estimates: a flat but right draft
            would never be verified, an over-confident one always).
    """

    def __init__(self, tracker: AcceptanceTracker) -> None:
        self.tracker = tracker
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.depths: list[int] = []
        self.paths: list[tuple[int, ...]] = []
        self.kinds: dict[tuple[int, ...], int] = {}  # token path -> calibration bucket (see AcceptanceTracker)
        self.q_rows: dict[int, torch.Tensor] = {}  # row (0 = root, node + 1) -> q

    def add_children(self, node: int, q: torch.Tensor, count: int, greedy: bool, generator,
                     ids: torch.Tensor | None = None) -> list[int]:
        """Expand ``node`` (``ROOT`` for the root) with ``count`` children drawn from ``q``; returns the new nodes.
        ``q`` is over the whole vocabulary, or over the tokens ``ids`` (a draft head's, greedy drafts only: their
        ``q`` only ranks and scores)."""
        if ids is None:
            self.q_rows[node + 1] = q
        base = 1.0 if node == ROOT else self.scores[node]
        depth = 1 if node == ROOT else self.depths[node] + 1
        prefix = () if node == ROOT else self.paths[node]
        added = []
        ceiling = base
        for index in pick_children(q, count, greedy, generator):
            kind = confidence_kind(float(q[index]))
            token = index if ids is None else int(ids[index])
            # Scores never grow along the draw order of siblings, so keeping the best nodes keeps the first draws.
            ceiling = min(ceiling, base * self.tracker.rate(kind, depth))
            self.tokens.append(token)
            self.parents.append(node)
            self.scores.append(ceiling)
            self.depths.append(depth)
            self.paths.append((*prefix, token))
            self.kinds[self.paths[-1]] = kind
            added.append(len(self.tokens) - 1)
        return added

    def expected_child_gain(self, node: int) -> float:
        """Expected accepted tokens from expanding ``node``: its score times the rate its own bucket has one level
        deeper (a confident draft tends to stay confident)."""
        return self.scores[node] * self.tracker.rate(self.kinds[self.paths[node]], self.depths[node] + 1)

    def path_rows(self, nodes: Sequence[int]) -> tuple[list[int], list[int]]:
        """The nodes on the paths from the root down to ``nodes`` (ancestors first) and each one's parent among
        them (:data:`CACHE` below the root)."""
        keep: set[int] = set()
        for node in nodes:
            while node != ROOT and node not in keep:
                keep.add(node)
                node = self.parents[node]
        ordered = sorted(keep)
        index = {node: row for row, node in enumerate(ordered)}
        return ordered, [CACHE if self.parents[node] == ROOT else index[self.parents[node]] for node in ordered]

    def tree(self, with_q: bool) -> DraftTree:
        draft_probs = None
        if with_q and self.q_rows:
            reference = self.q_rows[0]
            rows = [self.q_rows.get(row, None) for row in range(len(self.tokens) + 1)]
            # Unexpanded leaves have no children, so their row is never read: zeros stand in.
            draft_probs = torch.stack([row if row is not None else torch.zeros_like(reference) for row in rows])
        return DraftTree(tuple(self.tokens), tuple(self.parents), tuple(self.scores), draft_probs)


class LevelClock:
    """Seconds of a draft forward by row count, learned as drafting goes (a moving average per count)."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        previous = self._seconds.get(rows)
        self._seconds[rows] = seconds if previous is None else 0.7 * previous + 0.3 * seconds

    def estimate(self, rows: int) -> float | None:
        if rows in self._seconds:
            return self._seconds[rows]
        known = [count for count in self._seconds if count <= rows]
        return self._seconds[max(known)] if known else None


def worth_another_level(
    latency: LatencyModel | None,
    clock: LevelClock,
    rows: int,
    expected_gain: float,
    scores: Sequence[float],
    budget: int,
    seconds_so_far: float,
    tree: bool = False,
) -> bool:
    """Whether drafting one more level (a forward of ``rows`` draft rows expected to add ``expected_gain`` accepted
    tokens) raises the step's expected tokens per second: ``(1 + kept scores) / (verification + drafting time)``,
    with the verification of the best ``budget`` nodes priced by the engine's cost model (as a tree's when
    ``tree``)."""
    if latency is None:
        return True
    level_seconds = clock.estimate(rows)
    if level_seconds is None:
        return True  # not measured yet: measure it
    kept = sorted(scores, reverse=True)[:budget]
    tokens = 1.0 + sum(kept)
    now = tokens / (latency.cost(1 + len(kept), tree=tree) + seconds_so_far)
    verify_after = latency.cost(1 + min(budget, len(kept) + max(1, round(expected_gain))), tree=tree)
    after = (tokens + expected_gain) / (verify_after + seconds_so_far + level_seconds)
    return after > now


def drafting_can_pay(latency: LatencyModel, level_seconds: float, rates: Sequence[float], margin: float = 1.0) -> bool:
    """Whether a chain of drafts could raise the tokens per second of a step ``margin`` times: for some length ``k``
    (up to ``len(rates)``), ``(1 + r1 + r1 r2 + ...) / (verification of 1 + k rows + k draft forwards)`` above
    ``margin`` times a plain step's ``1 / (one row)``, with ``rates`` the acceptance at each depth (given the ones
    above) and ``level_seconds`` a draft forward's time. Where it cannot, a draft model's forwards are wasted time:
    on a CPU whose forwards of several rows cost nearly a row each, even drafts accepted 85 % of the time lose."""
    plain = margin / latency.cost(1)
    tokens, reached = 1.0, 1.0
    for length, rate in enumerate(rates, 1):
        reached *= rate
        tokens += reached
        if tokens / (latency.cost(1 + length) + length * level_seconds) > plain:
            return True
    return False


class DraftModelDrafter(Drafter):
    """Drafts with a separate model that shares the target's tokenizer (``draft:model=NAME``).

    Args:
        model: the draft model: a preset name, a GGUF file or a checkpoint folder (loaded on the target's device
            in the target's dtype when the first sequence starts, and shared by every fork), or a loaded model
            (a :class:`~draftwise.backend.target.Target` or a transformers causal LM) used as it is.
        width: children per expanded node, and nodes expanded per level (EAGLE-2's top-k); 1 (the default) drafts a
            chain, whose rows stay in the draft cache (the next step feeds only what the target added). Trees pay
            where a many-row draft forward costs about what a one-row one does (GPUs); on a 2-core CPU, chains
            measured 1.41-1.55x plain decoding against 1.27-1.42x for width 2 (Qwen2.5-Coder 1.5B/0.5B, bf16).
        depth: most levels below the root.
        adaptive: stop adding levels once the next one's expected accepted tokens are worth less target time than
            its own forward costs (``False``: always draft ``depth`` levels; the engine still keeps only the nodes
            that pay for their verification).
        vocab: the draft scores this many of the most frequent tokens (the lowest ids) plus every token of the
            context (:class:`DraftHead`); 0, or a vocabulary no bigger, scores all. Where the sequences' tokens fall
            outside it more than one time in :attr:`MISS_LIMIT`, the whole vocabulary is scored from then on.
        backend: how the draft model runs (see :func:`draftwise.load_model`).
        weights: the draft model's weights when loaded by name: ``"file"`` (a GGUF file's blocks as shipped),
            ``"q8_0"``/``"q4_0"`` (quantised on load, packed once and cached), ``"float"`` (the target's float
            dtype), or ``None`` (the default): ``"q4_0"`` for a target whose quantised products run on the compiled
            CPU kernels, since a draft step reads the whole draft model and the smallest blocks read least (Qwen2.5-
            Coder-0.5B drafting for the 1.5B's Q4_K_M file on a Zen 5: 68.2 tok/s against 57.6 with the 0.5B file's
            own Q5_0/Q8_0 blocks), otherwise the kind the target was loaded with. Every kind leaves the output the
            target's: a draft only proposes.
        activation_bits: what a quantised draft quantises its activations to (see :func:`draftwise.load_model`):
            8, the default, whatever the target takes, since a draft's precision moves its acceptance at most, never
            the output, and its steps cost about half of 16 bits' (Qwen2.5-Coder-0.5B's file on a Zen 5: 9.2 against
            18.9 ms a step); or 16. A quantised draft keeps its own cache in float16 (the default beside quantised
            weights, see :func:`draftwise.load_model`'s ``kv_cache_dtype``): like its precision, it moves acceptance
            at most.
        cache_dir: where the draft's converted checkpoint or packed weights are kept (default: the target's cache
            folder).

    ``model="self"`` drafts with the target's own model quantised (a target from :func:`draftwise.load_model`), by
    default as ``q4_0``: a quantised copy of a full-precision target that shares its tokenizer by construction. A
    float32 target on the CPU lends its own tensors to be quantised; any other is loaded again from its source.
    """

    name = "draft"
    #: One new token in this many outside the draft head's tokens (after :attr:`MISS_WINDOW` tokens) turns it off.
    MISS_LIMIT = 8
    MISS_WINDOW = 256
    #: Draft tokens verified at depth 1 before their measured acceptance may keep an adaptive drafter from drafting
    #: at all (see :meth:`propose`).
    MIN_ATTEMPTS = 16
    #: The acceptance assumed at every depth until then: a good draft model's (Qwen2.5-Coder-0.5B for the 1.5B is
    #: accepted 80-86 % of the time on Spec-Bench's coding and maths prompts).
    HOPED_ACCEPTANCE = 0.9
    #: How much faster than plain steps drafting must promise to be: what is promised at the margin goes to what the
    #: estimate leaves out (steps whose drafts are all rejected, bringing the draft's cache up after a pause).
    #: Qwen2.5-Coder-1.5B's Q4_K_M file with 16-bit activations on a two-core Zen 2, drafted by the 0.5B: promised
    #: 1.003x at 90 % acceptance, ran at 0.93-0.96x.
    MIN_GAIN = 1.05
    #: Cached positions behind the one-row forwards timed when the draft model is prepared.
    LEVEL_PROMPT = 32

    def __init__(
        self,
        model: str | Target | torch.nn.Module | None = None,
        width: int = 1,
        depth: int = 8,
        adaptive: bool = True,
        vocab: int = 32768,
        backend: str = "auto",
        weights: str | None = None,
        activation_bits: int = 8,
        cache_dir: str | None = None,
    ) -> None:
        if model is None or (isinstance(model, str) and not model):
            raise ValueError("the draft method needs a draft model: draft:model=NAME (a preset, GGUF file or folder)")
        if width < 1 or depth < 1:
            raise ValueError(f"width and depth must be >= 1, got width={width}, depth={depth}")
        if vocab < 0:
            raise ValueError(f"vocab must be >= 0 (0: the whole vocabulary), got {vocab}")
        if weights is not None and weights not in DRAFT_WEIGHTS:
            raise ValueError(f"unknown draft weights {weights!r}; weights: {', '.join(DRAFT_WEIGHTS)}")
        if weights is not None and not isinstance(model, str):
            raise ValueError("weights applies to a draft model loaded by name; a loaded model runs as it is")
        check_activation_bits(activation_bits)
        self.model_name = model if isinstance(model, str) else type(model).__name__
        self._given = None if isinstance(model, str) else model
        self.width = int(width)
        self.depth = int(depth)
        self.adaptive = bool(adaptive)
        self.vocab = int(vocab)
        self.backend = backend
        self.weights = weights
        self.activation_bits = int(activation_bits)
        self.cache_dir = cache_dir
        # Shared by forks: the loaded draft model and what its forwards cost.
        self._shared: dict[str, Any] = {
            "draft": None, "target": None, "head": None, "clock": LevelClock(), "tracker": AcceptanceTracker(),
            "seen": 0, "missed": 0,
        }
        self._own_sequence_state()

    def _own_sequence_state(self) -> None:
        self._cache: Any = None
        self._cached: list[int] = []
        self._sampling = SamplingParams()
        self._latency: LatencyModel | None = None
        self._generator: torch.Generator | None = None
        self._kinds: dict[tuple[int, ...], int] = {}

    @property
    def draft(self) -> Target:
        if self._shared["draft"] is None:
            raise RuntimeError("the draft model is loaded when a sequence starts (Drafter.attach)")
        return self._shared["draft"]

    def prepare(self, target: Target) -> None:
        """Load (or bind) the draft model for ``target``, once per target (see :meth:`Drafter.prepare`)."""
        if self._shared["target"] is target:
            return
        if self._given is not None:
            draft = self._given if isinstance(self._given, Target) else make_target(
                self._given, backend=self.backend, calibrate=False)
            check_same_vocabulary(target, draft, getattr(draft, "tokenizer", None), self.model_name)
        else:
            draft = load_draft(self.model_name, target, self.backend, self.cache_dir, self.weights,
                               self.activation_bits)
        self._shared["draft"] = draft
        self._shared["target"] = target
        self._shared["head"] = self._make_head(draft, target)
        if self.adaptive:
            self._shared["clock"].record(1, self._level_seconds(draft))

    def _level_seconds(self, draft: Target) -> float:
        """A draft forward of one row on this machine (the median of a few after a short prompt), so that the first
        step can judge whether drafting pays (:meth:`_may_pay`) before the draft model reads a whole prompt."""
        extra = _head_option(self._shared["head"])
        cache = draft.new_cache(self.LEVEL_PROMPT + 1)
        with torch.inference_mode():
            vocab = draft.config.vocab_size
            draft.prefill([cache], [[(7 * index) % vocab for index in range(self.LEVEL_PROMPT)]], **extra)
            seconds = []
            for _ in range(5):
                finish_queued_work(draft.device)
                started = time.perf_counter()
                draft.forward([cache], [RowBlock.chain([1])], **extra)
                finish_queued_work(draft.device)
                seconds.append(time.perf_counter() - started)
        return sorted(seconds)[len(seconds) // 2]

    def attach(self, setup: SequenceSetup) -> None:
        self.prepare(setup.target)
        self._sampling = setup.sampling
        self._latency = setup.latency
        self._generator = setup.sampling.generator()

    def _make_head(self, draft: Target, target: Target) -> DraftHead | None:
        if not isinstance(draft, LeanTarget):
            return None
        quantized = isinstance(draft.head, QuantizedLinear)
        if draft.quantization is not None and not quantized:
            return None  # (a head dequantised per step, on CUDA: a float slice of it would read more bytes)
        vocabulary = draft.head.out_features if quantized else draft.model.get_output_embeddings().weight.shape[0]
        if not 0 < self.vocab < vocabulary:
            return None
        head = DraftHead(draft, self.vocab)
        head.cover(eos_token_ids(target.model, target.tokenizer))
        return head

    def reset(self, prompt: Sequence[int]) -> None:
        self._cache = None
        self._cached = []

    # ------------------------------------------------------------------------------------------------ cache

    def _sync(self, context: Sequence[int]) -> torch.Tensor:
        """Bring the draft cache to exactly ``context`` (all of it committed); returns the last row's logits."""
        draft = self.draft
        shared = 0
        limit = min(len(self._cached), len(context) - 1)  # the last token is always fed, for its logits
        while shared < limit and self._cached[shared] == context[shared]:
            shared += 1
        fresh = self._cache is None or shared == 0
        new = list(context if fresh else context[shared:])
        head = self._head(context, () if fresh else new)
        if fresh:
            self._cache = draft.new_cache(len(context) + 2 * self.depth + 64)
            logits = draft.prefill([self._cache], [new], **_head_option(head)).logits[0][-1]
        else:
            draft.truncate(self._cache, shared)
            logits = draft.forward([self._cache], [RowBlock.chain(new)], last_only=True,
                                   **_head_option(head)).logits[0][-1]
            draft.commit(self._cache, range(len(new)))
        self._cached = list(context)
        return logits

    def _head(self, context: Sequence[int], fed: Sequence[int]) -> DraftHead | None:
        """The draft head, covering ``context``; counts the tokens ``fed`` to the draft since its last
        synchronisation that it did not cover, and gives it up (the whole vocabulary from then on) when they are
        too many."""
        head = self._shared["head"]
        if head is None:
            return None
        shared = self._shared
        shared["seen"] += len(fed)
        shared["missed"] += sum(1 for token in fed if not head.covers(token))
        if shared["seen"] >= self.MISS_WINDOW and shared["missed"] * self.MISS_LIMIT > shared["seen"]:
            shared["head"] = None
            return None
        head.cover(context)
        return head

    def _distribution(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``q`` from draft logits (over the draft head's tokens when it has one) and the token of each column
        (``None``: column ``i`` is token ``i``). A sampled draft's ``q`` is put back on the whole vocabulary, since
        verification reads it there; a greedy draft's only ranks, and stays over the head's tokens."""
        q = draft_distribution(logits, self._sampling)
        head = self._shared["head"]
        if head is None or q.shape[-1] == head.vocab:
            return q, None
        if self._sampling.greedy:
            return q, head.ids[: q.shape[-1]]
        return head.expand(q), None

    def sync_logits(self, context: Sequence[int]) -> torch.Tensor:
        """The draft's logits after ``context`` (public for tests: they must equal a fresh prefill's)."""
        with torch.inference_mode():
            return self._sync(context)

    # --------------------------------------------------------------------------------------------- propose

    @torch.inference_mode()
    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        draft, clock = self.draft, self._shared["clock"]
        if budget <= 0 or len(context) + self.depth >= draft.context_length or not self._may_pay():
            return DraftTree()
        greedy = self._sampling.greedy
        growth = TreeGrowth(self._shared["tracker"])
        started = time.perf_counter()  # the step's drafting time, the synchronising forward included
        q, ids = self._distribution(self._sync(context))
        frontier = growth.add_children(ROOT, q, self.width, greedy, self._generator, ids)
        committed = len(context)
        chain: list[int] = []  # tokens a chain's levels committed to the draft cache
        try:
            for _ in range(self.depth - 1):
                if not frontier:
                    break
                expand = sorted(frontier, key=lambda node: -growth.scores[node])[: self.width]
                rows = 1 if self.width == 1 else len(growth.path_rows(expand)[0])
                gain = sum(growth.expected_child_gain(node) for node in expand)
                if self.adaptive and not worth_another_level(
                    self._latency, clock, rows, gain, growth.scores, budget, time.perf_counter() - started,
                    tree=self.width > 1,
                ):
                    break
                level_started = time.perf_counter()
                q_rows, ids = self._distribution(self._level(draft, growth, expand))
                finish_queued_work(draft.device)  # (the level's time, not its launch's)
                clock.record(rows, time.perf_counter() - level_started)
                if self.width == 1:
                    chain.append(growth.tokens[expand[0]])
                frontier = []
                for node, q in zip(expand, q_rows):
                    frontier += growth.add_children(node, q, self.width, greedy, self._generator, ids)
        except BaseException:
            draft.truncate(self._cache, committed)
            raise
        if self.width == 1:
            # The chain's rows stay: the next synchronisation keeps its accepted part and feeds only the rest.
            self._cached = [*context, *chain]
        else:
            draft.truncate(self._cache, committed)
        self._kinds = growth.kinds
        # Every level offers width x width candidates; the best ``budget`` of all levels form the draft.
        return growth.tree(with_q=not greedy).best(budget)

    def _may_pay(self) -> bool:
        """Whether drafting could pay on this machine, by the acceptance measured so far (over this drafter's
        sequences) and the measured cost of a draft forward (:func:`drafting_can_pay`). Where it cannot, the draft
        model is not run at all, so no step pays to bring its cache up to the context (a whole prompt at first, the
        tokens of a pause later) for drafts the engine then drops. Until :attr:`MIN_ATTEMPTS` drafts were verified,
        their acceptance is taken as :attr:`HOPED_ACCEPTANCE`."""
        tracker, level_seconds = self._shared["tracker"], self._shared["clock"].estimate(1)
        if not self.adaptive or self._latency is None or level_seconds is None:
            return True
        if tracker.attempts(1) < self.MIN_ATTEMPTS:
            rates = [self.HOPED_ACCEPTANCE] * self.depth
        elif self.width == 1:
            rates = [tracker.pooled_rate(depth) for depth in range(1, self.depth + 1)]
        else:  # (a tree's siblings mostly fail: the best-calibrated bucket's rate stands for its best path)
            rates = [max(tracker.rate(kind, depth) for kind in range(CONFIDENCE_KINDS))
                     for depth in range(1, self.depth + 1)]
        return drafting_can_pay(self._latency, level_seconds, rates, self.MIN_GAIN)

    def observe(self, outcome: StepOutcome) -> None:
        if len(outcome.tree):
            self._shared["tracker"].learn_step(outcome.tree, outcome.verification, self._kinds)

    def _level(self, draft: Target, growth: TreeGrowth, expand: list[int]) -> torch.Tensor:
        """The draft's logits at the nodes ``expand``, one row each. A chain is extended one committed row at a
        time (its earlier nodes were committed by earlier levels); a tree level runs the paths down to ``expand``
        in one tree-masked forward."""
        extra = _head_option(self._shared["head"])
        if self.width == 1:
            logits = draft.forward([self._cache], [RowBlock.chain([growth.tokens[expand[0]]])], **extra).logits[0]
            draft.commit(self._cache, [0])
            return logits
        nodes, parents = growth.path_rows(expand)
        block = RowBlock(tuple(growth.tokens[node] for node in nodes), tuple(parents))
        logits = draft.forward([self._cache], [block], **extra).logits[0]
        row_of = {node: row for row, node in enumerate(nodes)}
        return logits[[row_of[node] for node in expand]]


def _head_option(head: DraftHead | None) -> dict[str, Any]:
    """The forward's keyword for a draft head (none without one: only the lean forward takes it)."""
    return {} if head is None else {"head": head}


def load_draft(name: str, target: Target, backend: str = "auto", cache_dir: str | None = None,
               weights: str | None = None, activation_bits: int = 8) -> Target:
    """Load draft model ``name`` (``"self"``: the target's source) on ``target``'s device, with ``weights`` (``None``:
    the kind ``target`` was loaded with; float weights in the target's dtype; quantised ones take their activations
    at ``activation_bits``), refusing one whose vocabulary differs."""
    if name == "self":
        if target.source is None:
            raise UnsupportedModelError("draft:model=self loads the target's model again: give a target loaded by "
                                        "name (draftwise.load_model), or name the draft model")
        weights = weights or "q4_0"
        if (weights in KINDS and isinstance(target, LeanTarget) and target.weights is None
                and target.dtype == torch.float32):
            # The target's own float32 tensors, quantised: no second load, no second float copy.
            draft = make_target(target.model, backend="lean", calibrate=False, weights=weights,
                                activation_bits=activation_bits)
            draft.tokenizer, draft.source, draft.weights = target.tokenizer, target.source, weights
            return draft
        name = target.source
    if weights is None and target.weights is not None and not getattr(target, "dequantizing", True):
        weights = "q4_0"  # (see DraftModelDrafter's weights)
    kind = (target.weights or "float") if weights is None else weights
    dtype = target.dtype if kind == "float" else "auto"
    if cache_dir is None and target.options is not None:
        cache_dir = target.options.cache_dir
    draft, tokenizer = load_model(name, dtype=dtype, device=target.device, backend=backend, cache_dir=cache_dir,
                                  calibrate=False, progress=True, weights=kind, activation_bits=activation_bits)
    check_same_vocabulary(target, draft, tokenizer, name)
    return draft


def check_same_vocabulary(target: Target, draft: Target, draft_tokenizer: Any, name: str) -> None:
    """Refuse a draft model whose token ids mean other tokens than the target's."""
    target_size = target.model.get_output_embeddings().weight.shape[0]
    draft_size = draft.model.get_output_embeddings().weight.shape[0]
    if target_size != draft_size:
        raise UnsupportedModelError(
            f"draft model {name!r} has {draft_size} output tokens, the target {target_size}: a draft model must "
            "share the target's tokenizer"
        )
    target_tokenizer = getattr(target, "tokenizer", None)
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise UnsupportedModelError(
                f"draft model {name!r} has another vocabulary than the target: a draft model must share the "
                "target's tokenizer"
            )

