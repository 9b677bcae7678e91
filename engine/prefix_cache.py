"""Automatic prefix caching: the KV of recent contexts' leading blocks, so that a session starting with tokens
seen before (a shared system prompt, a few-shot preamble, the earlier turns of a chat, the n choices of one
request, a session re-prefilled after a worker lost it) computes only the tokens after them.

A context is cut into blocks of `block` tokens. Block i is named by a digest of block i - 1's name and its own
tokens, so a name stands for the whole prefix up to it; a cached block holds its keys and values on every layer
([1, kv_heads, block, head_dim] each, on the model's device; DeepSeek V3.2's and GLM-5's sparse-attention indexer
keys too, [1, block, index_head_dim]). A session that starts (holds nothing yet) on a
context whose first n blocks are cached gets their concatenation as its KV cache, and its first forward computes
only the rest: always at least the context's last token, whose logits the call needs. After that forward, the
context's full blocks that were not cached yet are copied in, and so are, as a session ends (its release), the
blocks of everything it committed: the next turn of a chat begins with the last one's prompt and answer.

The cache is bounded in tokens (so that every rank of a tensor-parallel group, each holding its own shard's
bytes, counts the same) and evicts the least recently used block first. Every lookup and insertion touches
a context's blocks from its deepest to its first, so a chain loses its tail before its head, and the first blocks
that many contexts share stay longest. Sharing changes no output beyond floating-point summation order: a row
attends to the same keys and values it would have computed itself. Only attention-only models (whose caches
crop and concatenate: engine.modeling.attention_only) take part; the ranks of a tensor-parallel group hold their
own shards and, running the same calls in the same order, make the same choices.

    cache = PrefixCache(max_tokens=8192)
    found = cache.attach(model, session, context)   # before the session's first forward
    ...                                              # the forward over context[found:]
    cache.remember(session, context)                 # after it
    cache.keep(session)                              # as it ends: all it committed
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING

from protos.specpool.v1.generation_pb2 import PrefixCacheStats

if TYPE_CHECKING:                  # the router names blocks too (router/affinity.py): no torch at import
    import torch

    from engine.sessions import Session, SessionStore

BLOCK = 16          # tokens per cached block


def block_names(tokens, count: int, block: int = BLOCK) -> list[bytes]:
    """The names of the first `count` full blocks of `tokens`: block i's is a digest of block i - 1's name and its
    own tokens, so that it stands for the whole prefix up to it."""
    names, name = [], b""
    for start in range(0, count * block, block):
        digest = hashlib.blake2b(name, digest_size=16)
        digest.update(array("q", tokens[start:start + block]).tobytes())
        name = digest.digest()
        names.append(name)
    return names


class PrefixCache:
    """Blocks of contexts' KV, by the name of the prefix they end, least recently used first."""

    def __init__(self, max_tokens: int, block: int = BLOCK):
        if max_tokens < 0 or block < 1:
            raise ValueError(f"need max_tokens >= 0 and block >= 1 (got {max_tokens}, {block})")
        self.block, self.max_blocks = block, max_tokens // block
        self.bytes = 0                 # held on this rank (its shard of each layer)
        self._blocks: OrderedDict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()

    @property
    def tokens(self) -> int:
        """Tokens held (whole blocks)."""
        return len(self._blocks) * self.block

    def names(self, tokens, count: int) -> list[bytes]:
        return block_names(tokens, count, self.block)

    def attach(self, model, session: Session, context) -> int:
        """Give `session`, if it holds nothing yet, the cached KV of the longest run of `context`'s first blocks,
        short of its last token; returns the tokens it holds now (0: none were cached, or the session holds some)."""
        if session.length or not self.max_blocks:
            return 0
        from engine.modeling import new_cache, widest_window
        from engine.cache_layers import servable
        found = []
        for name in self.names(context, (len(context) - 1) // self.block):
            if name not in self._blocks:
                break
            found.append(name)
        present = [all(piece is not None for piece in self._blocks[name]) for name in found]
        found = found[:servable(present, widest_window(model), self.block)]
        if not found:
            return 0
        self._touch(found)
        cache = new_cache(model)
        for index, pieces in enumerate(zip(*(self._blocks[name] for name in found))):   # one layer's blocks
            self._fill(cache, index, pieces)
        session.cache, session.length = cache, len(found) * self.block
        return session.length

    def _fill(self, cache, index: int, pieces: list) -> None:
        """Layer `index` of a new cache from a chain's blocks: all of them, or on a window layer, those it holds
        at the chain's end (each block's piece is None where a window layer had dropped it)."""
        import torch

        from engine.cache_layers import starts_at
        held = next((n for n in range(len(pieces)) if pieces[-1 - n] is None), len(pieces))   # the held tail
        tail = pieces[len(pieces) - held:]
        cache.update(torch.cat([piece[0] for piece in tail], dim=2), torch.cat([piece[1] for piece in tail], dim=2),
                     index)
        starts_at(cache.layers[index], (len(pieces) - held) * self.block)
        if tail and len(tail[0]) > 2:                  # an IndexedLayer's indexer keys
            cache.layers[index].indexer_keys = torch.cat([piece[2] for piece in tail], dim=1)

    def remember(self, session: Session, context) -> None:
        """Copy in the full blocks of `context` (the first tokens `session` holds) that are not cached yet."""
        if not self.max_blocks:
            return
        from engine.cache_layers import block_view
        names = self.names(context, min(len(context), session.length) // self.block)
        layers = session.cache.layers if names else ()
        for number, name in enumerate(names):
            if name not in self._blocks:
                start = number * self.block
                self._blocks[name] = [block_view(layer, start, start + self.block) for layer in layers]
                self.bytes += block_bytes(self._blocks[name])
        self._touch(names)
        while len(self._blocks) > self.max_blocks:
            _, evicted = self._blocks.popitem(last=False)
            self.bytes -= block_bytes(evicted)

    def keep(self, session: Session) -> None:
        """Copy in the blocks of what a session that ends had committed (Session.settled): the next turn of a chat
        begins with its prompt and its answer."""
        if session.length:
            self.remember(session, session.tokens[:session.settled])

    def release(self, sessions: SessionStore, session_id: int) -> bool:
        """Drop a session that ended from `sessions`, leaving what it committed here (keep); False: not held."""
        session = sessions.take(session_id)
        if session is not None:
            self.keep(session)
        return session is not None

    def _touch(self, names: list[bytes]) -> None:
        """Mark a chain's blocks used, deepest first, so that its first block is the most recently used."""
        for name in reversed(names):
            self._blocks.move_to_end(name)


def block_bytes(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(tensor.nbytes for piece in layers if piece is not None for tensor in piece)


def lookup_stats(request, found: int) -> PrefixCacheStats:
    """A session start's answer about its prefix-cache lookup: the context's tokens (`request.new_token_ids`), and
    the first ones found; none looked up by a target start that gathers prompt logprobs, which reads no cache."""
    skipped = "prompt_logprobs" in request.DESCRIPTOR.fields_by_name and request.HasField("prompt_logprobs")
    return PrefixCacheStats(looked_up=0 if skipped else len(request.new_token_ids), found=found)
