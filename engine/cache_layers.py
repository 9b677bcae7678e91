"""The KV cache layers a session (or a batch) holds: full-attention layers that grow in place, and sliding-window
layers that hold what a query can still see, the window plus what a rollback may remove.

**Growing in place (GrowingLayer).** transformers' DynamicLayer appends a forward's keys and values with
torch.cat, a copy of the whole cache on every forward: at 8,192 tokens, 19 ms of a 36 ms decode step of 4 rows on
this machine. A GrowingLayer writes them into spare columns of its own buffer and reallocates (with 1/16 more
room) only when it is full, so a step copies what it appends. Its keys and values are views of the buffer; a view
assigned to it (a batch row handed back, a crop) becomes its buffer with no spare room, so its next append copies
once and nothing it handed out is ever written over.

**Sliding windows (WindowLayer).** A layer that attends over a window of W tokens (Mistral, Gemma 2 and 3, Qwen2
with `use_sliding_window`) needs only the keys and values of the last W - 1 tokens before a new one.
transformers' own DynamicSlidingWindowLayer keeps exactly those, so it cannot roll back: speculation appends drafts
and then removes the rejected ones. A WindowLayer keeps W - 1 + ROLLBACK_TOKENS columns, drops what lies before
them before a forward appends (once 1/16 of that is due, so that the appends between drops go in place), and tells transformers' mask builder where its columns begin
(get_mask_sizes), as transformers' own layer does. Its memory is bounded by the window, not by the context: on a
model with a window of 1,024 tokens, a 32k-token session's sliding layers hold 1,183 columns.

Columns are absolute: column c of a session is its c-th token, and a window layer holds columns [dropped, length).
In a batch (engine.modeling.RaggedBatch) every row shares the batch's columns, so a batch layer drops only the
columns before what every row still needs (drop_before). A rollback deeper than what is held raises SessionLost:
the router sends the context again, and the output is the same (only slower).

    layer = WindowLayer(window=8)            # engine.modeling.new_cache builds these for a windowed model
    layer.drop_before(length - layer.keep)   # before a forward appends
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from engine.sessions import SessionLost

ROLLBACK_TOKENS = 160   # columns kept beyond the window: the longest rollback a session sees, K drafts and a
                        # pre-draft of K + 1 tokens after them, K <= settings.schema.K_LIMIT = 64
SPARE_SHARE = 16        # a full buffer grows by 1/16 of what it holds (at least SPARE_MIN columns): about 6 % of
SPARE_MIN = 16          # memory spare, and a copy every held/16 appends instead of on every one
GROW_FROM = 256         # columns from which appends go in place: below, a copy costs little, and a decode step of
                        # the heavy pair's 44 layers measured 1.03-1.05x (noisy medians) with buffers from the start


class GrowingLayer(DynamicLayer):
    """A full-attention layer whose keys and values grow in place in a buffer with spare columns, once they hold
    GROW_FROM columns (below that, torch.cat as DynamicLayer: a copy that short costs less than the bookkeeping)."""

    def __init__(self):
        super().__init__()
        self._buffers = (None, None)   # keys', values' (buffer [B, heads, capacity, head_dim], the view of it last
                                       # handed out as keys or values): None, or a view replaced since, means no room

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.keys, self.values
        short = keys.dim() < 4 or keys.shape[2] + key_states.shape[2] < GROW_FROM
        if self._buffers[0] is None and short:                  # no buffer yet, and short: as DynamicLayer
            self.keys, self.values = torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
        else:
            (self.keys, key_buffer), (self.values, value_buffer) = (_appended(keys, self._buffers[0], key_states),
                                                                    _appended(values, self._buffers[1], value_states))
            self._buffers = (key_buffer, value_buffer)
        return self.keys, self.values


def _appended(held, buffer, new):
    """(held + new along the columns, its (buffer, view) or None): written in place where `held` is the view
    `buffer` last gave and it has room; else copied, into a new buffer with 1/SPARE_SHARE (at least SPARE_MIN)
    columns of room once GROW_FROM columns are held."""
    count = held.shape[2] if held.dim() == 4 else 0           # before the first append: an empty 1-D tensor
    end = count + new.shape[2]
    if buffer is not None and buffer[1] is held and buffer[0].shape[2] >= end:
        room = buffer[0]
    elif end < GROW_FROM:
        return torch.cat([held, new], dim=-2), None
    else:
        room = new.new_empty(new.shape[0], new.shape[1], end + max(SPARE_MIN, end // SPARE_SHARE), new.shape[3])
        if count:
            room[:, :, :count] = held
    room[:, :, count:end] = new
    view = room[:, :, :end]
    return view, (room, view)


class IndexedLayer(GrowingLayer):
    """A full-attention layer that also holds a sparse-attention indexer's keys, [B, columns, index_head_dim]
    (DeepSeek V3.2's and GLM-5's DSA; transformers' DynamicIndexedLayer): a column for each of its keys', cropped,
    padded into a batch and handed back with them (indexer_view)."""

    def __init__(self):
        super().__init__()
        self.indexer_keys: torch.Tensor | None = None

    def update_indexer(self, keys: torch.Tensor) -> torch.Tensor:        # [B, n_new, index_head_dim]
        self.indexer_keys = keys if self.indexer_keys is None else torch.cat([self.indexer_keys, keys], dim=1)
        return self.indexer_keys

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, :self.keys.shape[-2]]


def indexer_view(layer, row: int, columns):
    """Batch row `row`'s indexer keys at `columns` (a slice: a view; an index tensor: a copy), None for a layer
    without them."""
    keys = getattr(layer, "indexer_keys", None)
    return None if keys is None else keys[row:row + 1, columns]


class WindowLayer(GrowingLayer):
    """A sliding-window layer holding its last window - 1 + ROLLBACK_TOKENS columns, and up to 1/SPARE_SHARE of
    them more (drops wait until that many are due, so that appends between them go in place); more until the next
    append."""

    is_sliding = True

    def __init__(self, window: int):
        super().__init__()
        self.window, self.dropped = window, 0     # columns before `dropped` are no longer held

    @property
    def keep(self) -> int:
        """Columns to hold before a forward appends (ROLLBACK_TOKENS read now, so that a test may set it)."""
        return self.window - 1 + ROLLBACK_TOKENS

    @property
    def held(self) -> int:
        return DynamicLayer.get_seq_length(self)

    def get_seq_length(self) -> int:
        return self.dropped + self.held

    def get_mask_sizes(self, query) -> tuple[int, int]:
        """(columns the mask spans, its first column): the query's length in transformers 5.24, its cache positions
        in releases before."""
        return self.held + (query if isinstance(query, int) else query.shape[0]), self.dropped

    def drop_before(self, column: int) -> None:
        """Drop the columns before `column`, once that is at least 1/SPARE_SHARE of what it keeps (SPARE_MIN)."""
        cut = column - self.dropped
        if cut >= max(SPARE_MIN, self.keep // SPARE_SHARE) and self.is_initialized:
            self.keys, self.values = self.keys[:, :, cut:], self.values[:, :, cut:]
            self.dropped = column

    def columns(self, first: int, last: int) -> slice:
        """Where absolute columns [first, last) lie in the keys and values, clipped to those held."""
        return slice(max(first, self.dropped) - self.dropped, last - self.dropped)

    def head(self, length: int) -> int:
        """Held columns of the first `length` tokens; SessionLost where they no longer hold its window."""
        count = length - self.dropped
        if self.dropped and count < self.window - 1:
            raise SessionLost(f"a rollback to {length} tokens goes past the sliding window's {self.window - 1} "
                              f"columns held after column {self.dropped} (speculation's rollback is at most "
                              f"{ROLLBACK_TOKENS} tokens)")
        return count

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last -tokens_to_remove tokens (a positive value: keep that many, as earlier releases had it)."""
        count = self.head(tokens_to_remove if tokens_to_remove > 0 else self.get_seq_length() + tokens_to_remove)
        if self.is_initialized:
            self.keys, self.values = self.keys[:, :, :count], self.values[:, :, :count]


def first_column(layer) -> int:
    """The first column a cache layer holds (a full-length layer: 0)."""
    return layer.dropped if isinstance(layer, WindowLayer) else 0


def starts_at(layer, column: int) -> None:
    """Say that a layer's keys and values begin at absolute `column` (only a window layer's may not begin at 0)."""
    if isinstance(layer, WindowLayer):
        layer.dropped = column
    elif column:
        raise ValueError(f"a full-length cache layer holds every column; it cannot begin at {column}")


def head(layer, length: int) -> int:
    """Held columns of a layer's first `length` tokens (WindowLayer.head: SessionLost past its window)."""
    return layer.head(length) if isinstance(layer, WindowLayer) else length


def row_view(layer, row: int, columns):
    """(keys, values, first column held) of batch row `row` at `columns` (its real ones: a slice, or an index
    tensor on a full-length layer), as views where they are a slice; a window layer's clipped to those held,
    the first column counted from the row's first."""
    if not isinstance(layer, WindowLayer):
        return layer.keys[row:row + 1, :, columns], layer.values[row:row + 1, :, columns], 0
    if not isinstance(columns, slice):
        raise ValueError("a windowed batch keeps each row's columns contiguous")
    cut = layer.columns(columns.start, columns.stop)
    return layer.keys[row:row + 1, :, cut], layer.values[row:row + 1, :, cut], cut.start + layer.dropped - columns.start


def block_view(layer, start: int, stop: int):
    """(keys, values) of absolute columns [start, stop) of a one-row layer, copied, and an IndexedLayer's indexer
    keys third; None where a window layer no longer holds all of them (engine.prefix_cache keeps such a block
    without that layer)."""
    if start < first_column(layer):
        return None
    cut = layer.columns(start, stop) if isinstance(layer, WindowLayer) else slice(start, stop)
    indexer = indexer_view(layer, 0, cut)
    return (layer.keys[:, :, cut].clone(), layer.values[:, :, cut].clone()) + (() if indexer is None else
                                                                               (indexer.clone(),))


def servable(present: list[bool], window: int, block: int) -> int:
    """How many leading blocks of a chain a session may start on, where present[i] says whether a window layer
    has block i's keys and values: the chain's last blocks must hold the window the next token attends to (its
    last window - 1 tokens, or all of them)."""
    count = len(present)
    while count:
        tail = next((n for n in range(count) if not present[count - 1 - n]), count)
        if tail == count or tail * block >= window - 1:
            return count
        count -= tail + 1
    return 0
