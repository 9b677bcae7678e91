"""Loading Hugging Face causal LMs and running them incrementally over a session's KV cache."""
from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import Callable

import torch

from engine.sessions import Session
from engine.cache_layers import (GrowingLayer, IndexedLayer, WindowLayer, first_column, head, indexer_view, row_view,
                                 starts_at)
from engine.recurrent_states import kept, rewindable

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WASTED_SLACK = 64       # columns of padding and holes a batch may carry before WASTED_SHARE applies
WASTED_SHARE = 0.25     # beyond the slack, the share of a batch's columns that may be padding or holes


def load_model(name_or_path: str, dtype: str = "float32", device: str = "cpu", tp_plan: str | None = None):
    """An eval-mode AutoModelForCausalLM; tp_plan="auto" shards it over the initialised process group."""
    from transformers import AutoModelForCausalLM

    check_device(device)
    kwargs = {"dtype": DTYPES[dtype]}
    if tp_plan:
        kwargs.update(tensor_parallel(tp_plan))
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if not tp_plan:
        model.to(device)
    return model.eval()


def check_device(device: str | torch.device) -> None:
    """Refuse a CUDA device this process cannot see, saying why. Ray hides every GPU from an actor that asks for none
    (CUDA_VISIBLE_DEVICES=""), so a pool on `cuda` needs `num_gpus` > 0."""
    if torch.device(device).type != "cuda" or torch.cuda.is_available():
        return
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        why = ("CUDA_VISIBLE_DEVICES is empty: Ray hides every GPU from an actor that asks for none; give the pool "
               "num_gpus > 0")
    else:
        why = "this node has no GPU, or torch here is a CPU build"
    raise RuntimeError(f"device {device!r}: this process sees no CUDA device ({why})")


def tensor_parallel(tp_plan: str) -> dict:
    """from_pretrained's keyword for a TP plan: `distributed_config` where transformers has
    DistributedConfig (it deprecates a bare `tp_plan`), `tp_plan` in the releases before."""
    try:
        from transformers import DistributedConfig
    except ImportError:
        return {"tp_plan": tp_plan}
    return {"distributed_config": DistributedConfig(tp_plan=tp_plan)}


def load_lm_head(name_or_path: str, dtype: str = "float32", device: str = "cpu") -> torch.nn.Module:
    """Only the output projection of a causal LM (the draft's LM head, held by the target)."""
    return load_model(name_or_path, dtype, device).get_output_embeddings()


def tokenizer_vocab(name_or_path: str) -> dict[str, int] | None:
    """token -> id of the model's tokenizer.json, or None when the model has none."""
    path = Path(name_or_path) / "tokenizer.json"
    if not path.exists():
        try:
            from huggingface_hub import hf_hub_download
            path = Path(hf_hub_download(name_or_path, "tokenizer.json"))
        except Exception:
            return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def check_same_vocabulary(draft: str, target: str, draft_vocab_size: int, target_vocab_size: int) -> None:
    """Refuse a pair whose vocabularies differ: speculation compares token IDs position by position."""
    problem = None
    if draft_vocab_size != target_vocab_size:
        problem = f"vocab sizes differ ({draft_vocab_size} vs {target_vocab_size})"
    elif tokenizer_vocab(draft) != tokenizer_vocab(target):
        problem = "their tokenizers map tokens to different IDs"
    if problem:
        raise ValueError(f"draft model {draft!r} and target model {target!r} do not share a vocabulary: {problem}")


def model_info(model) -> dict:
    """What the router needs to validate requests: vocab size, context length, EOS ids."""
    config = model.config
    eos = model.generation_config.eos_token_id if model.generation_config else config.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return {"vocab_size": int(config.vocab_size),
            "max_context": int(getattr(config, "max_position_embeddings", 0) or 0),
            "eos_token_ids": eos_ids,
            "hidden_size": int(config.hidden_size)}


def _layer_kinds(model) -> tuple[str, ...]:
    """The kind of each cache layer transformers would give this model: "full", "sliding", "indexed" (full, with a
    sparse-attention indexer's keys) or "other" (the state of a recurrent or linear-attention layer, or layers
    transformers cannot crop freely). Worked out once per model."""
    return tuple(kind for kind, _ in _layers(model))


def _layers(model) -> tuple[tuple[str, int | None], ...]:
    """(kind, sliding window or None) of each cache layer transformers would give this model, once per model."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer

    layers = getattr(model, "_specpool_layers", None)
    if layers is None:
        names = {DynamicLayer: "full", DynamicSlidingWindowLayer: "sliding", DynamicIndexedLayer: "indexed"}
        layers = tuple((names.get(type(layer), "other"), getattr(layer, "sliding_window", None))
                       for layer in DynamicCache(config=model.config).layers)
        model._specpool_layers = layers
    return layers


def attention_only(model) -> bool:
    """Whether every cache layer holds attention keys and values, full or sliding-window: such sessions roll back
    by cropping and pad into one batch."""
    return "other" not in _layer_kinds(model)


def windowed(model) -> bool:
    """Whether some layer attends over a sliding window (its mask measures the window in cache columns)."""
    return "sliding" in _layer_kinds(model)


batchable = attention_only


def widest_window(model) -> int:
    """The widest sliding window of the model's layers (0: none)."""
    return max((window for kind, window in _layers(model) if kind == "sliding"), default=0)


@functools.lru_cache(maxsize=None)
def cache_keyword(model_class: type) -> str:
    """The keyword a model class's forward takes its KV cache by: `cache` since transformers deprecated
    `past_key_values` (5.24 warns that it goes in 5.40), `past_key_values` in the 5.x releases before."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def new_cache(model):
    """An empty KV cache for one session (or one batch).

    An attention-only model gets a layer of its own for each cache layer (engine.cache_layers): a GrowingLayer,
    appended in place, where it attends to every token, a WindowLayer where it attends over a sliding window. A
    WindowLayer holds the window plus the columns a rollback may remove, so a rollback is a plain crop, sessions
    pad into one batch and memory stays bounded by the window; the model's own sliding-window mask, which counts
    the window in the cache's columns, hides what lies outside it. Other models get transformers' own cache for
    their config.
    """
    from transformers import DynamicCache

    if not attention_only(model):
        return DynamicCache(config=model.config)
    cache = DynamicCache()
    kinds = {"sliding": WindowLayer, "indexed": lambda _: IndexedLayer(), "full": lambda _: GrowingLayer()}
    cache.layers.extend(kinds[kind](window) for kind, window in _layers(model))
    return cache


def decoder(model):
    """The model without its LM head: get_decoder()'s, or the `model` inside where that gives the model itself
    (transformers 5.25's Llama4ForCausalLM)."""
    inner = model.get_decoder()
    return model.model if inner is model else inner


class RaggedBatch:
    """Several sessions' KV caches padded into one batch cache, so one forward serves them all.

    Columns of the batch cache, row i (P = the most tokens any row holds):
        [ left padding | the L_i tokens session i holds | forward 1: its n_i new tokens | right padding to
          the longest of forward 1 | forward 2 ... ]
    The 2-D attention mask hides every padding column and position_ids continue each row's own positions,
    so a row computes what it would alone (up to floating-point summation order). unpack() hands each
    session back a cache of its real columns only, lazily: a session takes its view when its cache is next
    asked for (Session.cache), so a batch that runs on as it is hands back nothing. A batch of one session
    simply runs on its own cache. A sliding-window mask counts the window in columns, so for a windowed model a
    row's columns must stay contiguous: before a forward that would append to a row after right padding, the
    batch is packed again.

    Packing copies every row's cache. The next forward over the same sessions can skip that: holds() tells
    whether they are still as unpack() left them (a decode run's steady state) or rolled back in place
    (crop_row: a speculative round's rejected drafts become masked holes), and then the batch runs on as it is.
    """

    def __init__(self, model, sessions: list[Session], runs_on: bool = False):
        self.model, self.sessions = model, sessions
        self.runs_on = runs_on             # its owner may run the next forward on it (extend_batch): see crop_row
        self.lengths = [s.length for s in sessions]
        self._handed: list | None = None   # each session's layer-0 keys as unpack() left them (see holds)
        if len(sessions) == 1:             # no padding, mask or copies
            if sessions[0].cache is None:
                sessions[0].cache = new_cache(model)
            self.cache, self.mask = sessions[0].cache, None
            return
        self._pack()

    def _pack(self) -> None:
        """The batch cache: each session's cache left-padded to the longest."""
        past = max(self.lengths)
        held = [s.cache for s in self.sessions if s.length]   # (hands back any left in a batch: this one too)
        self.cache = new_cache(self.model)
        self.mask = _right_aligned_mask(self.lengths, past, self.model.device)
        self.segments = [[(past - n, n)] if n else [] for n in self.lengths]   # per row: (first column, count)
        for index in range(len(held[0].layers) if held else 0):
            layers = [s.cache.layers[index] if s.length else None for s in self.sessions]
            width = max(layer.keys.shape[2] for layer in layers if layer is not None)   # a window layer's: fewer
            self.cache.update(_padded(layers, "keys", width), _padded(layers, "values", width), index)
            starts_at(self.cache.layers[index], past - width)
            if isinstance(self.cache.layers[index], IndexedLayer):
                self.cache.layers[index].indexer_keys = _padded_indexer(layers, width)

    def _gapped(self, token_lists: list[list[int]]) -> bool:
        """Whether this forward would leave padding inside some row's columns."""
        width = self.mask.shape[1]
        return any(t and seg and seg[-1][0] + seg[-1][1] != width for t, seg in zip(token_lists, self.segments))

    def forward(self, token_lists: list[list[int]], decoder_only: bool = False, keep: int | torch.Tensor = 0):
        """Append token_lists[i] to row i (an empty list: nothing for that row) in one forward; `keep` is the model's
        `logits_to_keep` (extend_batch)."""
        if self.mask is not None and windowed(self.model) and self._gapped(token_lists):
            self.unpack()
            self._pack()
        if windowed(self.model):
            self._drop_unneeded()
        if self.mask is None and self.sessions[0].checkpoints is not None:      # a recurrent model's session
            kept(self.sessions[0].checkpoints, self.sessions[0].settled, self.cache, self.lengths[0])
        inputs = self._padded_inputs(token_lists) if self.mask is not None else \
            {"input_ids": torch.tensor(token_lists, dtype=torch.long, device=self.model.device)}
        self.lengths = [n + len(t) for n, t in zip(self.lengths, token_lists)]
        inputs.update({cache_keyword(type(self.model)): self.cache, "use_cache": True})
        if decoder_only:
            return decoder(self.model)(**inputs).last_hidden_state               # [B, n_new, hidden]
        return self.model(**inputs, logits_to_keep=keep).logits                  # [B, kept, vocab] or [kept, vocab]

    def _drop_unneeded(self) -> None:
        """Before a forward appends: drop the window layers' columns that no row needs any more (each row keeps
        the window and the rollback after its last column, WindowLayer.keep)."""
        ends = [self.lengths[0]] if self.mask is None else [seg[-1][0] + seg[-1][1] for seg in self.segments if seg]
        for layer in self.cache.layers if ends else ():
            if isinstance(layer, WindowLayer):
                layer.drop_before(min(ends) - layer.keep)

    def _padded_inputs(self, token_lists: list[list[int]]) -> dict:
        """Right-padded input ids, the grown attention mask and each row's own position ids."""
        width, n_new = self.mask.shape[1], max(len(t) for t in token_lists)
        device = self.model.device
        ids = torch.tensor([t + [0] * (n_new - len(t)) for t in token_lists], dtype=torch.long, device=device)
        counts = [len(t) for t in token_lists]
        step_mask = (torch.arange(n_new, device=device) < torch.tensor(counts, device=device)[:, None]).long()
        for segments, count in zip(self.segments, counts):
            if count and segments and sum(segments[-1]) == width:   # right after its last columns: one segment
                segments[-1] = (segments[-1][0], segments[-1][1] + count)
            elif count:
                segments.append((width, count))
        self.mask = torch.cat([self.mask, step_mask], dim=1)
        positions = torch.tensor(self.lengths, device=device)[:, None] + torch.arange(n_new, device=device)
        return {"input_ids": ids, "attention_mask": self.mask, "position_ids": positions}

    def unpack(self) -> None:
        """Hand each session back a cache of its own real columns (held tokens plus everything appended): a view
        of the batch cache where they are contiguous (the usual case), else a gathered copy. Lazily: each session
        is left in this batch and takes its view when its cache is next asked for (Session.cache, hand_back), so
        a forward that runs on this batch as it is (holds) slices nothing, nor do a pre-draft's forked rows."""
        if self.mask is None:
            self.sessions[0].length = self.lengths[0]
            return
        for i, session in enumerate(self.sessions):
            session.length = self.lengths[i]
            session.leave_in(self, i)
        self._handed = [None] * len(self.sessions)

    def hand_back(self, i: int, own):
        """Row i's cache as a session's own: `own` (or a new cache) holding a view of the row's real columns."""
        take = _columns(self.segments[i], self.model.device)
        fresh = own is None or not own.layers or not own.layers[0].is_initialized
        own = new_cache(self.model) if fresh else own
        for index, layer in enumerate(self.cache.layers):
            keys, values, first = row_view(layer, i, take)
            if fresh:
                own.update(keys, values, index)
            else:
                own.layers[index].keys, own.layers[index].values = keys, values
            starts_at(own.layers[index], first)
            if isinstance(layer, IndexedLayer):
                own.layers[index].indexer_keys = indexer_view(layer, i, take)
        self._handed[i] = own.layers[0].keys
        return own

    def holds(self, sessions: list[Session]) -> bool:
        """Whether this unpacked batch holds exactly `sessions`, in this order, each as unpack() left it or
        rolled back in place (crop_row), and wastes few enough columns, so that the next forward can run on it
        with no copy. A crop outside it, a forward elsewhere or a session started again gives the session new
        cache tensors (or a new length), which this notices."""
        return self._handed is not None and len(sessions) == len(self.sessions) and not self._wasteful() and all(
            session is own and session.length == length and session.held_in(self, handed)
            for session, own, length, handed in zip(sessions, self.sessions, self.lengths, self._handed))

    def crop_row(self, i: int, length: int) -> bool:
        """Roll row i back to its first `length` tokens in place: the columns past them (rejected drafts) are
        masked out, holes the row no longer attends to, so that the batch still holds the row and the next forward
        runs on it uncopied. Holes cost memory and attention over masked columns until the batch is packed again
        (holds: at most WASTED_SHARE of its columns beyond WASTED_SLACK). False, and nothing done, where the row
        must be cropped on its own cache: a batch nobody runs on again (the draft's: holes would only turn its
        sessions' views into copies), a batch of one (it has no mask), or a windowed model (its mask counts the
        window in columns, so a row's columns stay contiguous)."""
        if not self.runs_on or self.mask is None or self._handed is None or windowed(self.model):
            return False
        drop, segments = self.lengths[i] - length, self.segments[i]
        while drop > 0:
            start, count = segments.pop()
            cut = min(drop, count)
            self.mask[i, start + count - cut:start + count] = 0
            if cut < count:
                segments.append((start, count - cut))
            drop -= cut
        self.lengths[i] = length
        return True

    def _wasteful(self) -> bool:
        """Whether padding and holes (crop_row) have grown past WASTED_SHARE of the batch's columns, beyond the
        first WASTED_SLACK: then the next forward packs the sessions afresh."""
        width = self.mask.shape[1] if self.mask is not None else 0
        return width - max(self.lengths, default=0) > WASTED_SLACK + WASTED_SHARE * width


def replayer(model) -> Callable[[Session, list[int]], None] | None:
    """What computes tokens again on a session's own cache after a recurrent model's rollback (SessionStore's
    replay; engine.recurrent_states), for a model whose cache checkpoints roll back; None for another."""
    if attention_only(model) or not rewindable(new_cache(model)):
        return None

    def replay(session: Session, tokens: list[int]) -> None:
        batch = RaggedBatch(model, [session])
        batch.forward([tokens], keep=1)
        batch.unpack()
    return replay


def fork_session(model, session: Session, length: int) -> Session:
    """A new session holding a copy of the first `length` tokens of `session`'s cache (for an attention-only
    model: each layer's keys and values are cut at that column), so that it can go on elsewhere."""
    fork = Session(sampling=session.sampling, length=length)
    if length:
        fork.cache = new_cache(model)
        for index, layer in enumerate(session.cache.layers):
            count = head(layer, length)
            fork.cache.update(layer.keys[:, :, :count], layer.values[:, :, :count], index)
            starts_at(fork.cache.layers[index], first_column(layer))
            if isinstance(layer, IndexedLayer):
                fork.cache.layers[index].indexer_keys = indexer_view(layer, 0, slice(0, count))
    return fork


def _padded(layers: list, kind: str, width: int) -> torch.Tensor:   # [B, heads, width, head_dim]
    """One layer's keys or values of each row (None: a row holding nothing) right-aligned in `width` columns."""
    like = next(getattr(layer, kind) for layer in layers if layer is not None)
    out = like.new_zeros((len(layers), like.shape[1], width, like.shape[3]))
    for i, layer in enumerate(layers):
        if layer is not None:
            held = getattr(layer, kind)[0]
            out[i, :, width - held.shape[1]:] = held
    return out


def _padded_indexer(layers: list, width: int) -> torch.Tensor:   # [B, width, index_head_dim]
    """One layer's indexer keys of each row (None: a row holding nothing) right-aligned in `width` columns."""
    like = next(layer.indexer_keys for layer in layers if layer is not None)
    out = like.new_zeros((len(layers), width, like.shape[2]))
    for i, layer in enumerate(layers):
        if layer is not None:
            out[i, width - layer.indexer_keys.shape[1]:] = layer.indexer_keys[0]
    return out


def _right_aligned_mask(lengths: list[int], width: int, device) -> torch.Tensor:   # [B, width]
    """1 on the last lengths[i] columns of row i, 0 on the left padding."""
    return (torch.arange(width, device=device) >= width - torch.tensor(lengths, device=device)[:, None]).long()


def _columns(segments: list[tuple[int, int]], device):
    """A row's real columns from its (first column, count) segments: a slice where they are contiguous
    (so the session gets a view), else an index tensor (a gathered copy)."""
    if not segments:
        return slice(0, 0)
    if all(start == prev + count for (prev, count), (start, _) in zip(segments, segments[1:])):
        first, last = segments[0][0], segments[-1][0] + segments[-1][1]
        return slice(first, last)
    return torch.cat([torch.arange(start, start + count, device=device) for start, count in segments])


@torch.inference_mode()
def extend_batch(model, sessions: list[Session], token_lists: list[list[int]], keeps: list[int],
                 last: RaggedBatch | None = None) -> tuple[list[torch.Tensor], RaggedBatch]:
    """Append token_lists[i] to sessions[i]'s cache, all in one forward. Returns the logits of row i's last
    keeps[i] positions [keeps[i], vocab], and the batch: passed back as `last`, it is run on again, uncopied,
    while it holds the same sessions as they were left (RaggedBatch.holds). Pass no `last` after a forward that
    raised: its batch may be half-updated."""
    batch = last if last is not None and last.holds(sessions) else RaggedBatch(model, sessions, runs_on=True)
    ends = [len(t) for t in token_lists]                     # each row's new tokens end at its own column
    if len(set(ends)) == 1:                                  # one end column: keep the last max(keeps) columns
        logits = batch.forward(token_lists, keep=max(keeps))  # [B, max(keeps), vocab]
        rows = [logits[i, logits.shape[1] - k:] for i, k in enumerate(keeps)]
    elif takes_row_masks(type(model)):                       # ragged ends: exactly each row's columns
        logits = batch.forward(token_lists, keep=_kept_mask(ends, keeps, model.device))  # [sum(keeps), vocab]
        rows = list(logits.split(keeps))
    else:                                                    # an older model: the union of the rows' columns
        columns = sorted({c for end, k in zip(ends, keeps) for c in range(end - k, end)})
        logits = batch.forward(token_lists, keep=torch.tensor(columns, device=model.device))  # [B, U, vocab]
        rows = [logits[i, columns.index(end - k):columns.index(end - k) + k] if k else logits[i, :0]
                for i, (end, k) in enumerate(zip(ends, keeps))]
    batch.unpack()
    return rows, batch


def _kept_mask(ends: list[int], keeps: list[int], device) -> torch.Tensor:   # [B, n_new] bool
    """True on row i's last keeps[i] new columns, which end at column ends[i] (rows are right-padded)."""
    column = torch.arange(max(ends), device=device)
    end, keep = torch.tensor(ends, device=device)[:, None], torch.tensor(keeps, device=device)[:, None]
    return (column < end) & (column >= end - keep)


@functools.lru_cache(maxsize=None)
def takes_row_masks(model_class: type) -> bool:
    """Whether a model class's forward takes `logits_to_keep` as a per-row mask [B, n_new] (and returns the kept
    positions' logits flattened, [kept, vocab]): it slices its hidden states with transformers'
    slice_logits_to_keep, in a release that takes boolean masks. The model's own post-processing of its logits
    (Gemma's soft-capping, say) then applies as usual."""
    helper = getattr(inspect.getmodule(model_class), "slice_logits_to_keep", None)
    try:
        return helper is not None and tuple(helper(torch.zeros(1, 2, 1), torch.tensor([[False, True]])).shape) == (1, 1)
    except Exception:                                        # noqa: BLE001 - a release that takes no masks
        return False
