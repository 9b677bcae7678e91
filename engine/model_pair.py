"""Build a small draft/target model pair offline and save it as Hugging Face model folders.

Nothing here downloads anything: the tokenizer is built in memory (byte-level, or a tiny
character alphabet for tests) and the models are Llama-architecture, random-initialised.
Real deployments point the config at real model folders or hub IDs instead.

    python -m engine.model_pair --out ~/.cache/specpool/random-pair
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"


@dataclass
class PairSpec:
    """Shapes of the pair. The defaults are the local demo pair (random init)."""
    alphabet: str | None = None       # None: byte-level tokenizer (256 bytes + EOS)
    target_hidden: int = 256
    target_layers: int = 4
    target_heads: int = 4
    draft_hidden: int = 64
    draft_layers: int = 1
    draft_heads: int = 2
    kv_heads: int = 2
    max_positions: int = 1024
    init_std: float = 0.02
    seed: int = 0
    extra: dict = field(default_factory=dict)


BUILTIN = "builtin:"
BUILTIN_PAIRS = {"random-pair": PairSpec()}


def build_tokenizer(alphabet: str | None):
    """A PreTrainedTokenizerFast: byte-level BPE with no merges, or one token per alphabet char."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if alphabet is None:
        byte_chars = pre_tokenizers.ByteLevel.alphabet()
        vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
    else:
        vocab = {ch: i for i, ch in enumerate(alphabet)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=alphabet[0]))
        tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)


def llama_config(vocab_size: int, hidden: int, layers: int, heads: int, spec: PairSpec, eos: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=min(spec.kv_heads, heads), max_position_embeddings=spec.max_positions,
        initializer_range=spec.init_std, tie_word_embeddings=False,
        eos_token_id=eos, bos_token_id=eos, pad_token_id=eos, **spec.extra,
    )


def new_llama(vocab_size: int, hidden: int, layers: int, heads: int, spec: PairSpec, eos: int, seed: int):
    """A random-initialised LlamaForCausalLM of that shape (the demo pair's training script starts from it)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(vocab_size, hidden, layers, heads, spec, eos))
    model.generation_config.pad_token_id = eos
    return model


def build_pair(out_dir: str | os.PathLike, spec: PairSpec = PairSpec()) -> tuple[Path, Path]:
    """Write `out_dir/draft` and `out_dir/target` (model + tokenizer). Returns their paths."""
    out = Path(out_dir)
    tokenizer = build_tokenizer(spec.alphabet)
    vocab_size = len(tokenizer)
    eos = tokenizer.eos_token_id
    shapes = {"draft": (spec.draft_hidden, spec.draft_layers, spec.draft_heads),
              "target": (spec.target_hidden, spec.target_layers, spec.target_heads)}
    paths = []
    for i, (name, (hidden, layers, heads)) in enumerate(shapes.items()):
        model = new_llama(vocab_size, hidden, layers, heads, spec, eos, seed=spec.seed * 2 + i)
        path = out / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    (out / "pair.json").write_text(json.dumps({"alphabet": spec.alphabet, "seed": spec.seed}))
    return paths[0], paths[1]


def ensure_pair(out_dir: str | os.PathLike, spec: PairSpec = PairSpec()) -> tuple[Path, Path]:
    """Build the pair once (under a file lock, so concurrent workers build it once) and reuse it."""
    out = Path(out_dir).expanduser()
    locked_build(out, lambda tmp: build_pair(tmp, spec), "random-init draft/target pair")
    return out / "draft", out / "target"


def locked_build(out: Path, build, what: str) -> None:
    """Run build(tmp_folder) once for `out` (a file lock serialises concurrent callers), then move the result
    into place; a finished build leaves `out` and is reused."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            print(f"[specpool] building {what} in {out} ...", flush=True)
            tmp = Path(tempfile.mkdtemp(dir=out.parent))
            build(tmp)
            tmp.rename(out)
            print("[specpool] ready", flush=True)


def cache_dir() -> Path:
    return Path(os.environ.get("SPECPOOL_CACHE", "~/.cache/specpool")).expanduser()


def resolve_model(name: str) -> str:
    """`builtin:random-pair/draft|target` -> the cached folder (built on first use); else unchanged."""
    if not name.startswith(BUILTIN):
        return name
    pair, _, role = name[len(BUILTIN):].partition("/")
    if pair not in BUILTIN_PAIRS or role not in ("draft", "target"):
        raise ValueError(f"unknown builtin model {name!r}; known: "
                         + ", ".join(f"{BUILTIN}{p}/{r}" for p in BUILTIN_PAIRS for r in ("draft", "target")))
    draft, target = ensure_pair(cache_dir() / pair, BUILTIN_PAIRS[pair])
    return str(draft if role == "draft" else target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(cache_dir() / "random-pair"))
    args = parser.parse_args()
    print(*ensure_pair(args.out), sep="\n")


if __name__ == "__main__":
    main()
