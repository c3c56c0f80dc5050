"""Prefix caching: the keys and values of prompts already seen, reused by later requests that begin the same way.

Chat and agent clients resend their system prompt and the whole conversation with every turn; a server that keeps
the keys and values of those positions prefills only what is new (vLLM's automatic prefix caching, SGLang's radix
cache, llama.cpp's server slots).

The cache holds **blocks** of :data:`PREFIX_BLOCK` positions, each keyed by its tokens and everything before it: a
chained SHA-256 digest (the parent block's digest, then the block's token ids), as vLLM keys its blocks. A lookup
walks a prompt's blocks from the first and stops at the first one not held; every block found is checked against
its parent and its own tokens, so a hit is exact, never a hash collision. Blocks come from two places: a prompt
whose prefill has ended, and a sequence that has finished (its prompt and its output: the next turn of a
conversation resends that output).

Reuse is bitwise: on a target whose prompts are prefilled as verification rows (``Target.chunked_prefill``), a
position's keys and values are the same whether the position was computed alone, in a prompt's piece or as an
accepted draft row, since every row is bitwise one-row decoding; so a sequence started from cached blocks and
prefilled from there holds exactly the cache it would have built alone, and emits exactly the same tokens.

Blocks are copied into the sequence's own cache (a memory copy, far cheaper than the forward that made them: the
engine's attention reads each sequence's cache in place). Each block counts the cached blocks that continue it
(its references); only a block nobody continues is evicted, the least recently used first, when the blocks'
bytes exceed the bound. A lookup refreshes every block it uses.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: Positions per cached block (vLLM's default block size): a prompt's last partial block is prefilled again.
PREFIX_BLOCK = 16
#: Bytes of keys and values the server keeps for prefix caching unless told otherwise.
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30


@dataclass(eq=False)
class _Block:
    """One cached block: its tokens, its keys and values (every layer), and how many cached blocks continue it."""

    digest: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor
    children: int = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def block_digest(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a block: SHA-256 of its parent's key and its token ids."""
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


class PrefixCache:
    """Blocks of keys and values of earlier prompts and outputs, keyed by content, bounded in bytes.

    Args:
        capacity_bytes: most bytes of keys and values kept; least recently used blocks nobody continues are evicted
            past it.
        block: positions per block.

    Attributes:
        queried_tokens: prompt tokens looked up (vLLM's ``prefix_cache_queries``).
        hit_tokens: of those, tokens restored from the cache (vLLM's ``prefix_cache_hits``).
    """

    def __init__(self, capacity_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, block: int = PREFIX_BLOCK) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"the prefix cache's capacity must be a number of bytes >= 0, not {capacity_bytes!r}")
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"the prefix cache's block must be a positive number of positions, not {block!r}")
        self.capacity_bytes = capacity_bytes
        self.block = block
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens that were restored."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def match(self, tokens: Sequence[int], limit: int | None = None) -> list[_Block]:
        """The cached blocks that begin ``tokens``, in order (at most ``limit`` positions); refreshes them."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        found: list[_Block] = []
        parent: bytes | None = None
        for start in range(0, limit - self.block + 1, self.block):
            piece = tuple(int(token) for token in tokens[start : start + self.block])
            entry = self._blocks.get(block_digest(parent, piece))
            if entry is None or entry.parent != parent or entry.tokens != piece:
                break
            found.append(entry)
            parent = entry.digest
        for entry in reversed(found):  # (deepest first: an ancestor is never older than its continuations)
            self._blocks.move_to_end(entry.digest)
        return found

    def restore(self, target: Any, cache: Any, tokens: Sequence[int], limit: int) -> int:
        """Write the cached blocks that begin ``tokens`` (at most ``limit`` positions) into ``cache``, an empty cache
        of ``target``; returns how many positions it now holds (counted as hits, ``tokens`` as queries)."""
        found = self.match(tokens, limit)
        self.queried_tokens += len(tokens)
        if found:
            keys = torch.cat([entry.keys for entry in found], dim=2)
            values = torch.cat([entry.values for entry in found], dim=2)
            target.write_positions(cache, 0, keys, values)
        restored = len(found) * self.block
        self.hit_tokens += restored
        return restored

    def store(self, target: Any, cache: Any, tokens: Sequence[int]) -> int:
        """Keep the whole blocks of ``tokens`` whose keys and values ``cache`` holds at their positions (the first
        ``target.cache_length(cache)`` of them); returns how many blocks were new."""
        length = min(target.cache_length(cache), len(tokens))
        parent: bytes | None = None
        parent_entry: _Block | None = None
        added = 0
        for start in range(0, length - self.block + 1, self.block):
            piece = tuple(int(token) for token in tokens[start : start + self.block])
            digest = block_digest(parent, piece)
            entry = self._blocks.get(digest)
            if entry is None or entry.tokens != piece or entry.parent != parent:
                if entry is not None:  # (a collision: never overwrite, stop caching this sequence here)
                    break
                keys, values = target.read_positions(cache, start, start + self.block)
                entry = _Block(digest, parent, piece, keys, values)
                if entry.nbytes > self.capacity_bytes:
                    break
                self._blocks[digest] = entry
                self.bytes += entry.nbytes
                if parent_entry is not None:
                    parent_entry.children += 1
                added += 1
            else:
                self._blocks.move_to_end(digest)
            parent, parent_entry = digest, entry
        self._evict(keep=parent_entry)
        return added

    def clear(self) -> None:
        """Drop every block (the counters stay)."""
        self._blocks.clear()
        self.bytes = 0

    def _evict(self, keep: _Block | None) -> None:
        """Drop least recently used blocks that nobody continues until the bytes fit (``keep`` last of all)."""
        while self.bytes > self.capacity_bytes:
            victim = next((entry for entry in self._blocks.values() if not entry.children and entry is not keep), None)
            if victim is None:
                victim = keep if keep is not None and keep.digest in self._blocks else None
                if victim is None:
                    return
                keep = None
            del self._blocks[victim.digest]
            self.bytes -= victim.nbytes
            self.evicted_blocks += 1
            if victim.parent is not None and (parent := self._blocks.get(victim.parent)) is not None:
                parent.children -= 1
