"""Helpers for the test suite: tiny random models, a character tokenizer, prompt generators and test drafters."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence

import torch
import transformers

from draftwise.decoding.drafter import Drafter
from draftwise.decoding.latency import LatencyModel
from draftwise.decoding.tree import DraftTree

VOCAB = 96
CONTEXT = 256


def tiny_config(kind: str, vocab: int = VOCAB, **overrides):
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
    )
    common.update(overrides)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    raise ValueError(kind)


def make_tiny_model(kind: str, seed: int = 0, vocab: int = VOCAB, scale: float = 8.0, **overrides):
    """A float32 random model whose output head and embeddings are scaled up so greedy argmax is well separated
    (no near-ties) and varied (not one token forever). Its generation config has no EOS."""
    torch.manual_seed(seed)
    config = tiny_config(kind, vocab, **overrides)
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        model.model.embed_tokens.weight.mul_(scale)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    return model


class CharTokenizer:
    """One character per token id (``chr(0x100 + id)``), enough for the API's text paths: encode, decode, stop."""

    eos_token_id = None
    chat_template = None
    OFFSET = 0x100

    def __init__(self, vocab_size: int = VOCAB) -> None:
        self.vocab_size = vocab_size

    def encode_text(self, text: str) -> list[int]:
        return [(ord(char) - self.OFFSET) % self.vocab_size for char in text]

    def __call__(self, text: str, add_special_tokens: bool = True):
        return {"input_ids": self.encode_text(text)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(self.OFFSET + int(token)) for token in ids)


class TextTokenizer(CharTokenizer):
    """A character tokenizer with the parts of the transformers interface a datastore build uses."""

    name_or_path = "text-chars"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.encode_text(text)

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return {chr(self.OFFSET + token): token for token in range(self.vocab_size)}


class ChatCharTokenizer(CharTokenizer):
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{message['role']}>{message['content']}" for message in messages) + "<a>"
        return self.encode_text(text)


def brute_force_continuations(tokens, n):
    """Positions right after earlier occurrences of the last ``n`` tokens, most recent first (the suffix itself
    excluded): what an n-gram index must answer."""
    if len(tokens) < n:
        return []
    suffix = list(tokens[len(tokens) - n :])
    return [p for p in range(len(tokens) - 1, n - 1, -1) if list(tokens[p - n : p]) == suffix]


def repetitive_prompt(rng: random.Random, vocab: int = VOCAB, low: int = 5, high: int = 40) -> list[int]:
    """A prompt of ``low..high`` tokens built from a few segments, some repeated, so that n-grams recur."""
    length = rng.randint(low, high)
    segments = [[rng.randrange(vocab) for _ in range(rng.randint(2, 7))] for _ in range(rng.randint(1, 3))]
    prompt: list[int] = []
    while len(prompt) < length:
        if rng.random() < 0.7:
            prompt.extend(rng.choice(segments))
        else:
            prompt.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))
    return prompt[:length]


def random_tree(rng: random.Random, size: int, vocab: int = VOCAB, tokens_at_depth=None) -> DraftTree:
    """A random tree of at most ``size`` nodes. ``tokens_at_depth(depth)`` (optional) suggests a token for a node."""
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    used: set[tuple[int, int]] = set()
    attempts = 0
    while len(tokens) < size and attempts < 4 * size + 4:
        attempts += 1
        parent = rng.randrange(-1, len(tokens))
        depth = 1 if parent == -1 else depths[parent] + 1
        token = None
        if tokens_at_depth is not None and rng.random() < 0.6:
            token = tokens_at_depth(depth)
        if token is None:
            token = rng.randrange(vocab)
        if (parent, token) in used:
            continue
        used.add((parent, token))
        tokens.append(token)
        parents.append(parent)
        depths.append(depth)
    return DraftTree(tuple(tokens), tuple(parents))


class ReferenceDrafter(Drafter):
    """Base of test drafters that know the true greedy continuation ``reference`` of ``prompt``."""

    def __init__(self, prompt: Sequence[int], reference: Sequence[int], vocab: int = VOCAB) -> None:
        self.prompt = list(prompt)
        self.reference = list(reference)
        self.vocab = vocab
        self.resets = 0
        self.proposals = 0
        self.outcomes = []
        self.contexts = []  # the context after each observed step

    def reset(self, prompt: Sequence[int]) -> None:
        assert list(prompt) == self.prompt
        self.resets += 1

    def position(self, context: Sequence[int]) -> int:
        """Index in ``reference`` of the next token to emit."""
        emitted = len(context) - len(self.prompt)
        assert list(context[: len(self.prompt)]) == self.prompt
        assert list(context[len(self.prompt) :]) == self.reference[:emitted], "context left the greedy path"
        return emitted

    def truth(self, context: Sequence[int], count: int) -> list[int]:
        start = self.position(context)
        return self.reference[start : start + count]

    def wrong(self, token: int, rng: random.Random) -> int:
        """A token different from ``token``."""
        return (token + rng.randrange(1, self.vocab)) % self.vocab

    def observe(self, outcome) -> None:
        self.outcomes.append(outcome)
        self.contexts.append(list(outcome.new_context))


class OracleChainDrafter(ReferenceDrafter):
    """Proposes the next ``length`` true tokens as a chain."""

    name = "oracle-chain"

    def __init__(self, prompt, reference, length: int = 6, vocab: int = VOCAB) -> None:
        super().__init__(prompt, reference, vocab)
        self.length = length

    def propose(self, context, budget):
        self.proposals += 1
        return DraftTree.chain(self.truth(context, min(self.length, budget)))


class OracleTreeDrafter(ReferenceDrafter):
    """Proposes the true continuation inside a tree whose wrong branches come first in node order, so that the
    accepted path is never the prefix rows 1..k (the cache must compact)."""

    name = "oracle-tree"

    def __init__(self, prompt, reference, length: int = 5, seed: int = 0, vocab: int = VOCAB) -> None:
        super().__init__(prompt, reference, vocab)
        self.length = length
        self.rng = random.Random(seed)

    def propose(self, context, budget):
        self.proposals += 1
        truth = self.truth(context, self.length)
        paths = []
        for depth in range(len(truth)):
            wrong = self.wrong(truth[depth], self.rng)
            tail = [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(0, 2))]
            paths.append([*truth[:depth], wrong, *tail])
        paths.append(truth)
        return DraftTree.from_paths(paths)


class WrongDrafter(ReferenceDrafter):
    """Proposes only trees whose first-level tokens are never the true next token (chain or bushy tree)."""

    name = "wrong"

    def __init__(self, prompt, reference, shape: str = "chain", seed: int = 0, vocab: int = VOCAB) -> None:
        super().__init__(prompt, reference, vocab)
        self.shape = shape
        self.rng = random.Random(seed)

    def propose(self, context, budget):
        self.proposals += 1
        truth = self.truth(context, 8)
        if not truth:
            return DraftTree()
        first_wrong = self.wrong(truth[0], self.rng)
        if self.shape == "chain":
            # The true tokens, shifted by one wrong token: plausible-looking but never accepted.
            return DraftTree.chain([first_wrong, *truth][:budget])
        size = self.rng.randint(1, max(budget, 1))
        tree = random_tree(self.rng, size, self.vocab)
        # Replace any root child carrying the true token.
        tokens = list(tree.tokens)
        root_tokens = {token for token, parent in zip(tokens, tree.parents) if parent == -1}
        for node, parent in enumerate(tree.parents):
            if parent == -1 and tokens[node] == truth[0]:
                replacement = first_wrong
                while replacement in root_tokens or replacement == truth[0]:
                    replacement = (replacement + 1) % self.vocab
                tokens[node] = replacement
                root_tokens.add(replacement)
        return DraftTree(tuple(tokens), tree.parents)


class RandomTreeDrafter(ReferenceDrafter):
    """Random shapes up to the budget; tokens are random or (often) the true token for their depth, so that partial
    acceptance happens anywhere in the tree."""

    name = "random-tree"

    def __init__(self, prompt, reference, seed: int = 0, vocab: int = VOCAB) -> None:
        super().__init__(prompt, reference, vocab)
        self.rng = random.Random(seed)

    def propose(self, context, budget):
        self.proposals += 1
        start = self.position(context)

        def suggest(depth: int):
            index = start + depth - 1
            return self.reference[index] if index < len(self.reference) else None

        size = self.rng.randint(0, budget)
        return random_tree(self.rng, size, self.vocab, suggest)


class FixedCosts(LatencyModel):
    """Forward costs from the prior alone: measured forwards change nothing, so which drafts the cost rule keeps does
    not depend on the machine's timings."""

    def record(self, rows, seconds, sequences=1, tree=False):
        pass


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's CPU thread count set to ``count`` inside, put back on leaving."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def drafting_transformers(model):
    """``model`` on the transformers backend with drafting on, unchecked. Its verification rows are not bitwise one-row
    decoding's (the check at load would turn drafting off), but the tiny models' greedy tokens are far apart (see
    :func:`make_tiny_model`), so greedy ids still match: tests of the engine's logic (tree walks, statistics,
    drafters' learning) run on it without the lean forward's row plan."""
    from draftwise.backend.target import TransformersTarget

    target = TransformersTarget(model)
    target.exact_trees, target.drafting_off_reason = True, None
    return target


def planned(model, folder, kernel: bool | None = None):
    """``model`` on the engine's lean forward with its row plan measured (the measurements kept in ``folder``);
    ``kernel``: as :class:`~draftwise.backend.forward.lean.LeanTarget`'s (``False``: attention by the library path)."""
    from draftwise.backend.calibration.invariance import plan_rows
    from draftwise.backend.calibration.machine import MeasurementStore
    from draftwise.backend.forward.graphed import GraphedLeanTarget
    from draftwise.backend.forward.lean import LeanTarget

    target = GraphedLeanTarget(model) if model.device.type == "cuda" else LeanTarget(model, kernel=kernel)
    plan_rows(target, MeasurementStore(folder))
    return target


def prefill_and_chain_logits(target, prompt: list[int], chain: list[int], capacity: int) -> tuple:
    """``target``'s logits for ``prompt`` prefilled into a fresh cache, then for ``chain`` verified after it."""
    from draftwise.backend.rows import RowBlock

    cache = target.new_cache(capacity)
    with torch.inference_mode():
        first = target.prefill([cache], [prompt]).logits[0]
        return first, target.forward([cache], [RowBlock.chain(chain)]).logits[0]


def prefilled_caches(target, prompts, capacity: int) -> list:
    """A fresh cache of ``capacity`` positions per prompt, each prompt prefilled alone."""
    caches = [target.new_cache(capacity) for _ in prompts]
    for cache, prompt in zip(caches, prompts):
        target.prefill([cache], [prompt])
    return caches


def noisy_copy(model, noise: float = 0.02, seed: int = 99):
    """A copy of ``model`` with small random changes to its weights: a draft model that is often, not always, right."""
    import copy

    twin = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in twin.parameters():
            change = torch.randn(parameter.shape, generator=generator).to(parameter.device)
            parameter.add_((change * noise * parameter.float().std().clamp(min=1e-3)).to(parameter.dtype))
    return twin


def drafter_for(method: str, model) -> Drafter:
    """A drafter of ``method`` for a tiny ``model`` (a transformers model or a target): the draft-model method gets a
    noisy copy of the model as its draft."""
    import draftwise
    from draftwise.backend.target import Target
    from draftwise.drafters.draft_model import DraftModelDrafter

    if method == "draft":
        base = model.model if isinstance(model, Target) else model
        return DraftModelDrafter(model=noisy_copy(base), width=2, depth=5)
    if method == "layerskip" and getattr(model, "backend", None) != "lean":
        import pytest

        pytest.skip("layerskip drafts with the lean forward")
    return draftwise.make_drafter(method)


def tiny_serving_model() -> tuple:
    """``(target, tokenizer)`` of ``make_tiny_model("qwen2", seed=0)`` on the lean forward with planned rows: what a
    server started in another process (a Ray Serve replica) loads."""
    import tempfile

    from draftwise.backend.calibration.invariance import plan_rows
    from draftwise.backend.calibration.machine import MeasurementStore
    from draftwise.backend.forward.lean import LeanTarget

    target = LeanTarget(make_tiny_model("qwen2", seed=0))
    plan_rows(target, MeasurementStore(tempfile.mkdtemp(prefix="draftwise-machine-")))
    return target, ChatCharTokenizer()


#: A prompt that begins so stops the engine's worker thread of :func:`poisonable_serving_model`'s target.
POISON = (7, 7, 7, 7, 7, 7)


def poisonable_serving_model() -> tuple:
    """:func:`tiny_serving_model` whose forward raises ``SystemExit`` (as an exit called deep in a library would) for
    a block of rows that begins with :data:`POISON`: the engine's worker thread stops, the replica lives on."""
    target, tokenizer = tiny_serving_model()
    forward = target.forward

    def checked(caches, blocks, **options):
        if any(tuple(block.tokens[: len(POISON)]) == POISON for block in blocks):
            raise SystemExit("a library called exit")
        return forward(caches, blocks, **options)

    target.forward = checked
    return target, tokenizer
