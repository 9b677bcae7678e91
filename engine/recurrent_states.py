"""Rollback for caches with recurrent layers: linear attention and state-space layers (Qwen3-Next's Gated DeltaNet,
Mamba hybrids), beside full-attention ones. transformers' cache layers for them cannot be cropped: a recurrent state
is the sum of every token the layer has seen, so speculation's rejected drafts cannot be taken out of it. A session
of such a model keeps checkpoints instead: before each forward (engine.modeling.RaggedBatch), a copy of those
layers' states and the number of tokens it holds then. A rollback (SessionStore.open) restores the last checkpoint at
or before where it goes back to, cuts the attention layers' keys and values there, and computes the tokens in
between again (replay: one forward of them, the accepted drafts), so the session holds exactly what it would hold
had it never seen the rejected drafts.

    session.checkpoints = []                                  # a recurrent model's session (SessionStore)
    kept(session, cache, length)                              # before a forward
    held = restore(session.cache, best(session.checkpoints, position))   # a rollback to `position`
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

# A recurrent layer's fields that a forward changes (tensors copied, flags as they are), those the layer has: its
# token count (transformers 5.25 on, whose get_seq_length gives the positions of the next forward) among them
STATE_FIELDS = ("conv_states", "recurrent_states", "is_conv_states_initialized", "is_recurrent_states_initialized",
                "has_previous_state", "conv_kernel_size", "cumulative_length_linear")
MAX_CHECKPOINTS = 16    # a session's (a draft's K steps and a pre-draft's have one each): past that the oldest after
                        # the committed tokens go, and a rollback to them restores an earlier one and computes more


@dataclass(frozen=True)
class Checkpoint:
    length: int             # tokens the session held
    states: tuple           # per cache layer: its recurrent fields (copies), None for an attention layer


def rewindable(cache) -> bool:
    """Whether checkpoints roll this cache back: some layer is recurrent, and every layer is that or full attention
    (not transformers' sliding-window layers, which drop the columns a rollback restores)."""
    layers = cache.layers
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers) and all(
        isinstance(layer, LinearAttentionCacheLayerMixin) or type(layer) is DynamicLayer for layer in layers) and \
        not any(isinstance(layer, DynamicSlidingWindowLayer) for layer in layers)


def _copied(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    return {key: _copied(item) for key, item in value.items()} if isinstance(value, dict) else value


def checkpoint(cache, length: int) -> Checkpoint:
    return Checkpoint(length, tuple({name: _copied(getattr(layer, name)) for name in STATE_FIELDS
                                     if hasattr(layer, name)}
                                    if isinstance(layer, LinearAttentionCacheLayerMixin) else None
                                    for layer in cache.layers))


def kept(checkpoints: list, settled: int, cache, length: int) -> None:
    """Add a checkpoint of `cache` at `length` before a forward, keeping those a rollback can still need: the last
    at or before the `settled` (committed) tokens, and the latest after them, MAX_CHECKPOINTS in all."""
    base = [c for c in checkpoints if c.length <= settled][-1:]
    later = [c for c in checkpoints if c.length > settled][-(MAX_CHECKPOINTS - 1 - len(base)):]
    checkpoints[:] = base + later + [checkpoint(cache, length)]


def best(checkpoints: list, position: int) -> Checkpoint | None:
    """The checkpoint a rollback to `position` restores: the last at or before it."""
    return max((c for c in checkpoints if c.length <= position), key=lambda c: c.length, default=None)


def restore(cache, point: Checkpoint) -> int:
    """Put `cache` back as it was at `point`: its recurrent layers' states (copied again: a checkpoint may be
    restored twice), its attention layers' keys and values cut at its length. Returns that length."""
    for layer, state in zip(cache.layers, point.states):
        for name, value in (state or {}).items():
            setattr(layer, name, _copied(value))
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            if point.length:
                layer.keys, layer.values = layer.keys[..., :point.length, :], layer.values[..., :point.length, :]
            else:
                layer.keys = layer.values = None
                layer.is_initialized = False
    return point.length
