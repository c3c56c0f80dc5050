"""The target model as the engine sees it: a forward over blocks of new rows, and a KV cache per sequence in which
rejected rows cost nothing.

:class:`Target` is the interface; :class:`TransformersTarget` runs any supported transformers causal LM through its
public forward, with an explicit 4D attention mask and explicit position ids, on a
:class:`~draftwise.backend.cache.TreeKVCache`.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .cache import TreeKVCache, check_full_attention
from .rows import RowBlock, attention_mask, position_ids


#: Why a target whose rows were never compared with one-row decoding verifies no drafts.
UNCHECKED_ROWS = ("its verification rows were not checked against one-row decoding on this machine (draftwise."
                  "load_model and draftwise.models.make_target check them)")


def context_length(model: torch.nn.Module) -> int:
    """The model's maximum number of positions (prompt plus generated tokens)."""
    config = model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def last_rows_only(last_only: bool | Sequence[bool], blocks: int) -> list[bool]:
    """A forward's ``last_only`` argument as one flag per block."""
    if isinstance(last_only, bool):
        return [last_only] * blocks
    flags = [bool(flag) for flag in last_only]
    if len(flags) != blocks:
        raise ValueError(f"last_only has {len(flags)} flags for {blocks} blocks")
    return flags


@dataclass
class ForwardOutput:
    """What one forward computed, per block in the order given.

    Attributes:
        logits: ``(rows, vocab)`` per block (only the last row where ``last_only`` says so).
        hidden_states: the input of the output head at the same rows, when asked for.
    """

    logits: list[torch.Tensor]
    hidden_states: list[torch.Tensor] | None = None


class Target(ABC):
    """A model the engine verifies drafts with.

    Attributes:
        model: the transformers model behind it (the reference: configuration, generation config, ``generate``).
        backend: which forward runs it (``"lean"``: the engine's own, ``"transformers"``: the model's public one).
        exact_trees, cost_prior, tree_cost_prior: see below.
    """

    model: Any
    backend: str = ""
    #: The model's tokenizer when it was loaded with one (:func:`draftwise.load_model`): draft models are checked
    #: against its vocabulary.
    tokenizer: Any = None
    #: What :func:`draftwise.load_model` loaded it from (a preset, GGUF file or folder) and with which ``weights``
    #: (``None``: float weights); a draft model defaults to the same kind of weights, ``draft:model=self`` quantises
    #: this target's model (loaded again from ``source`` where its own tensors cannot lend themselves).
    source: str | None = None
    weights: str | None = None
    #: Whether verification rows are bitwise plain decoding's on this machine (see
    #: :mod:`draftwise.backend.calibration.invariance`); when not, the engine verifies no drafts with this target.
    exact_trees: bool = True
    #: Why the engine verifies no drafts with this target (``None`` while :attr:`exact_trees`): each generation's
    #: statistics carry it (``GenerationStats.drafting_off``).
    drafting_off_reason: str | None = None
    #: The :class:`~draftwise.models.LoadOptions` it was loaded with, where :func:`draftwise.load_model` loaded it.
    options: Any = None
    #: Forward seconds by row count measured on this machine (:mod:`draftwise.backend.calibration.costs`), if measured.
    cost_prior: dict[int, float] | None = None
    #: The same for trees (rows that branch), if measured.
    tree_cost_prior: dict[int, float] | None = None
    #: Whether several sequences' chains of rows are verified on a leaner path than their trees (so that a batch's
    #: drafts are cut to their best path).
    batch_chains: bool = False
    #: Whether a prompt may be prefilled in pieces, each piece a chain of rows in a :meth:`forward` beside other
    #: sequences' rows, with the same bits as :meth:`prefill` gives it whole (the prompt's rows are verification
    #: rows here): a scheduler then interleaves long prompts with decoding steps.
    chunked_prefill: bool = False

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def generation_config(self) -> Any:
        return getattr(self.model, "generation_config", None)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the caches keep keys and values in: the model's, unless the forward keeps them otherwise (see
        :class:`~draftwise.backend.forward.lean.LeanTarget`)."""
        return self.dtype

    @functools.cached_property
    def context_length(self) -> int:
        """Most positions a sequence may reach, prompt and output together: the model's, or less where
        :meth:`limit_context` was given less."""
        # (kept: the engine asks every step, and transformers' config attributes cost microseconds each to read)
        return context_length(self.model)

    def limit_context(self, length: int) -> None:
        """Let sequences reach at most ``length`` positions (vLLM's ``max_model_len``): longer requests are refused
        with a clear error. Call it before any sequence starts; targets whose every step covers the whole context
        (the graphed forward of GPUs) get cheaper steps."""
        model_length = context_length(self.model)
        if not 0 < length <= model_length:
            raise ValueError(f"max_model_len must be 1..{model_length} (the model's context), not {length}")
        self.context_length = int(length)

    @abstractmethod
    def new_cache(self, capacity: int) -> Any:
        """An empty KV cache for one sequence, with room for ``capacity`` positions (it grows when needed)."""

    @abstractmethod
    def cache_length(self, cache: Any) -> int:
        """Committed positions in ``cache``."""

    @abstractmethod
    def prefill(
        self, caches: Sequence[Any], prompts: Sequence[Sequence[int]], hidden_states: bool = False
    ) -> ForwardOutput:
        """Run each prompt on its empty cache and commit it; returns the logits (and hidden states) of each
        prompt's last row."""

    @abstractmethod
    def forward(
        self,
        caches: Sequence[Any],
        blocks: Sequence[RowBlock],
        *,
        last_only: bool | Sequence[bool] = False,
        hidden_states: bool = False,
    ) -> ForwardOutput:
        """Run the rows of ``blocks[i]`` on top of ``caches[i]``; the new rows' keys and values are written after
        each cache's committed length but not committed (see :meth:`commit`). ``last_only`` (for every block, or
        one flag per block): return only the block's last row."""

    @abstractmethod
    def commit(self, cache: Any, rows: Sequence[int]) -> None:
        """Keep the rows ``rows`` (ascending, indices into the last forward's block) of ``cache``; drop the rest."""

    @abstractmethod
    def truncate(self, cache: Any, length: int) -> None:
        """Roll ``cache`` back to its first ``length`` committed positions."""

    @property
    def prefix_caching(self) -> bool:
        """Whether a sequence may start from keys and values another computed (:mod:`draftwise.decoding.prefix_cache`):
        its cache's positions can be read and written (:meth:`read_positions`, :meth:`write_positions`) and its
        prompts' rows are verification rows (:attr:`chunked_prefill`), so reused positions are bitwise its own."""
        return False

    def read_positions(self, cache: Any, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of committed positions ``start .. end - 1``, every layer: two
        ``(layers, kv_heads, end - start, head_dim)`` tensors."""
        raise NotImplementedError(f"{type(self).__name__} has no prefix caching")

    def write_positions(self, cache: Any, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys and values (as :meth:`read_positions` gives them) at positions ``start ..`` of ``cache``, which
        holds ``start`` committed positions, and commit them."""
        raise NotImplementedError(f"{type(self).__name__} has no prefix caching")


class TransformersTarget(Target):
    """Any transformers causal LM whose layers are all full attention, through its public forward.

    Its verification rows come out of the library's kernels, whose rounding may depend on the number of rows a
    product has (on CPUs it does), so they are not taken as plain decoding's until checked:
    :func:`~draftwise.backend.calibration.invariance.check_rows` (run by :func:`draftwise.load_model` and
    :func:`draftwise.models.make_target`) compares them with one-row decoding bit for bit and turns drafting on where
    they agree. Unchecked, it decodes one token a step (exactly plain decoding).

    Args:
        model: the model (left unmodified; see :func:`draftwise.load_model` for the CPU kernels it can use).
    """

    backend = "transformers"
    exact_trees = False
    drafting_off_reason = UNCHECKED_ROWS

    def __init__(self, model: Any) -> None:
        check_full_attention(model)
        self.model = model
        self._layers = model.config.get_text_config(decoder=True).num_hidden_layers

    def new_cache(self, capacity: int) -> TreeKVCache:
        return TreeKVCache(self._layers, batch_size=1, capacity=capacity)

    def cache_length(self, cache: TreeKVCache) -> int:
        return cache.lengths[0]

    def prefill(
        self, caches: Sequence[TreeKVCache], prompts: Sequence[Sequence[int]], hidden_states: bool = False
    ) -> ForwardOutput:
        blocks = [RowBlock.chain(prompt) for prompt in prompts]
        output = self.forward(caches, blocks, last_only=True, hidden_states=hidden_states)
        for cache, block in zip(caches, blocks):
            self.commit(cache, range(len(block)))
        return output

    def forward(
        self,
        caches: Sequence[TreeKVCache],
        blocks: Sequence[RowBlock],
        *,
        last_only: bool | Sequence[bool] = False,
        hidden_states: bool = False,
    ) -> ForwardOutput:
        # One forward per sequence: padding sequences into one batch would change every row's arithmetic.
        logits: list[torch.Tensor] = []
        hidden: list[torch.Tensor] = []
        for cache, block, last in zip(caches, blocks, last_rows_only(last_only, len(blocks))):
            row_logits, row_hidden = self._forward_one(cache, block, last, hidden_states)
            logits.append(row_logits)
            if row_hidden is not None:
                hidden.append(row_hidden)
        return ForwardOutput(logits, hidden if hidden_states else None)

    def _forward_one(
        self, cache: TreeKVCache, block: RowBlock, last_only: bool, want_hidden: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        device, dtype = self.device, self.dtype
        lengths = cache.lengths
        captured: list[torch.Tensor] = []
        hook = None
        if want_hidden:
            head = self.model.get_output_embeddings()
            hook = head.register_forward_pre_hook(lambda module, inputs: captured.append(inputs[0]))
        try:
            output = self.model(
                input_ids=torch.tensor([block.tokens], dtype=torch.long, device=device),
                attention_mask=attention_mask([block.parents], lengths, dtype, device),
                position_ids=position_ids([block.parents], lengths, device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
            )
        finally:
            if hook is not None:
                hook.remove()
        hidden = captured[0][0, -1:] if last_only and captured else (captured[0][0] if captured else None)
        return output.logits[0], hidden

    def commit(self, cache: TreeKVCache, rows: Sequence[int]) -> None:
        cache.keep(0, rows)

    def truncate(self, cache: TreeKVCache, length: int) -> None:
        cache.truncate(0, length)


def as_target(model: Any) -> Target:
    """``model`` itself when it is a :class:`Target`, else the transformers model wrapped in one."""
    return model if isinstance(model, Target) else TransformersTarget(model)
