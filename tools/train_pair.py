"""Train a small draft/target Llama pair offline on the Python standard library's own sources.

    python -m tools.train_pair --out deploy/models/demo-pair

Nothing is downloaded: the training text is the `.py` files of the running interpreter's standard
library (sorted; test folders, test_*.py and site-packages skipped; every `heldout_every`-th file
is held out). Both models share one tokenizer, a small byte-level BPE trained here on the training
files (`--tokenizer bytes` uses model_pair's plain byte tokenizer instead). Training has two parts:

1. joint: on the same batches, the target learns next-token cross-entropy and the draft learns a
   mix of cross-entropy and KL to the target's (detached) logits;
2. distillation: the target greedily continues random training windows, and the draft is trained
   on those continuations (the text greedy decoding actually produces, where speculative decoding
   needs the draft to agree) with KL to the target's logits plus cross-entropy to its argmax.

Seeds, file order and batch order are fixed, so a rerun on the same interpreter rebuilds the same
pair. The build then measures held-out losses and greedy acceptance (`measure_acceptance`, K=4, on
held-out files) and writes the figures to `out/pair.json`. Any `TrainConfig` field can be
overridden from the command line, e.g. `--steps 200 --tokenizer bytes`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from engine.model_pair import EOS_TOKEN, PairSpec, build_tokenizer, new_llama
from engine.modeling import cache_keyword

# The pair continues Python code, so a chat turns into Python comments and the answer is the code after them;
# tools are listed as a comment (name and parameters' JSON Schema), and an assistant's calls follow its content.
CHAT_TEMPLATE = ("{% if tools %}# tools:{% for tool in tools %} {{ tool.function.name }}"
                 "{{ (tool.function.parameters or {}) | tojson }}{% endfor %}{{ '\\n' }}{% endif %}"
                 "{% for message in messages %}# {{ message['role'] }}: {{ message['content'] }}"
                 "{% for call in message.tool_calls or [] %} {{ call.function.name }}"
                 "{{ call.function.arguments | tojson }}{% endfor %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:\n{% endif %}")
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class TrainConfig:
    seed: int = 1337
    tokenizer: str = "bpe"            # "bpe" (trained here) or "bytes" (model_pair.build_tokenizer)
    vocab_size: int = 768             # BPE only: bytes + merges + EOS
    heldout_every: int = 20           # file i is held out when i % heldout_every == heldout_every // 2
    context: int = 256                # training sequence length
    batch_size: int = 8
    steps: int = 1000
    target_hidden: int = 192
    target_layers: int = 5
    target_heads: int = 4
    draft_hidden: int = 64
    draft_layers: int = 2             # two layers: enough for induction (copying) heads
    draft_heads: int = 2
    kv_heads: int = 2
    max_positions: int = 1024
    target_lr: float = 4e-3
    draft_lr: float = 6e-3
    min_lr_frac: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    distill_weight: float = 0.8       # draft loss = (1-w) * CE + w * KL(target || draft)
    rollouts: int = 512               # target greedy continuations of training windows ...
    rollout_batch: int = 64
    distill_steps: int = 400          # ... on which the draft is then distilled (see distill_draft)
    distill_batch: int = 16
    distill_lr: float = 4e-3
    distill_hard: float = 0.5         # distillation loss = KL + distill_hard * CE(target's argmax)
    log_every: int = 50
    eval_windows: int = 48            # held-out windows of `context` tokens for the loss figures
    prompts: int = 20                 # held-out code windows (see heldout_prompts) for acceptance
    prompt_tokens: int = 64
    gen_tokens: int = 128
    k: int = 4
    threads: int = 2


# ----------------------------------------------------------------------------- data

def stdlib_files() -> tuple[Path, list[Path]]:
    """The stdlib's .py files in sorted order, without test folders, test_*.py and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        files.append(path)
    return root, files


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def split_files(files: list[Path], every: int) -> tuple[list[Path], list[Path]]:
    held = [f for i, f in enumerate(files) if i % every == every // 2]
    train = [f for i, f in enumerate(files) if i % every != every // 2]
    return train, held


def train_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenisation) with EOS, trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=len(texts))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)
    tokenizer.chat_template = CHAT_TEMPLATE       # saved as chat_template.jinja: chat works out of the box
    return tokenizer


def make_tokenizer(cfg: TrainConfig, texts: list[str]):
    if cfg.tokenizer == "bytes":
        return build_tokenizer(None)
    if cfg.tokenizer == "bpe":
        return train_bpe(texts, cfg.vocab_size)
    raise ValueError(f"unknown tokenizer {cfg.tokenizer!r}")


def encode_stream(tokenizer, texts: list[str]):
    """All texts as one 1-D LongTensor, each followed by EOS."""
    import torch

    ids = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def get_batch(stream, cfg: TrainConfig, gen):
    import torch

    starts = torch.randint(0, len(stream) - cfg.context - 1, (cfg.batch_size,), generator=gen)
    x = torch.stack([stream[s:s + cfg.context] for s in starts.tolist()])
    y = torch.stack([stream[s + 1:s + 1 + cfg.context] for s in starts.tolist()])
    return x, y


# ----------------------------------------------------------------------------- models and training

def build_model(cfg: TrainConfig, tokenizer, role: str):
    hidden, layers, heads = (getattr(cfg, f"{role}_{k}") for k in ("hidden", "layers", "heads"))
    spec = PairSpec(kv_heads=cfg.kv_heads, max_positions=cfg.max_positions)
    return new_llama(len(tokenizer), hidden, layers, heads, spec, tokenizer.eos_token_id,
                     seed=cfg.seed + (0 if role == "target" else 1))


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def make_optimizer(model, lr: float, weight_decay: float):
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr_frac`."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(opt, base: float, factor: float) -> None:
    for group in opt.param_groups:
        group["lr"] = base * factor


def kl_to_target(d_logits, t_logits):
    """KL(target || draft) per position, averaged."""
    import torch.nn.functional as F

    t_logp = F.log_softmax(t_logits.flatten(0, 1), dim=-1)
    d_logp = F.log_softmax(d_logits.flatten(0, 1), dim=-1)
    return F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean")


def train_step(target, draft, opts, x, y, cfg: TrainConfig) -> tuple[float, float]:
    """One step for both: target on CE; draft on (1-w) CE + w KL(target || draft)."""
    import torch.nn.functional as F

    t_logits = target(input_ids=x).logits
    t_loss = F.cross_entropy(t_logits.flatten(0, 1), y.flatten())
    t_loss.backward()
    d_logits = draft(input_ids=x).logits
    d_ce = F.cross_entropy(d_logits.flatten(0, 1), y.flatten())
    kl = kl_to_target(d_logits, t_logits.detach())
    ((1 - cfg.distill_weight) * d_ce + cfg.distill_weight * kl).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return t_loss.item(), d_ce.item()


def train(target, draft, stream, cfg: TrainConfig) -> float:
    """Train both models for cfg.steps; prints progress; returns seconds spent."""
    import torch

    gen = torch.Generator().manual_seed(cfg.seed)
    opts = [make_optimizer(target, cfg.target_lr, cfg.weight_decay),
            make_optimizer(draft, cfg.draft_lr, cfg.weight_decay)]
    target.train()
    draft.train()
    start, t_sum, d_sum = time.time(), 0.0, 0.0
    for step in range(cfg.steps):
        factor = lr_factor(step, cfg)
        set_lr(opts[0], cfg.target_lr, factor)
        set_lr(opts[1], cfg.draft_lr, factor)
        t_loss, d_loss = train_step(target, draft, opts, *get_batch(stream, cfg, gen), cfg)
        t_sum, d_sum = t_sum + t_loss, d_sum + d_loss
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            n = (step % cfg.log_every) + 1
            print(f"step {step + 1:4d}/{cfg.steps}  target loss {t_sum / n:.3f}  draft loss {d_sum / n:.3f}"
                  f"  lr x{factor:.2f}  elapsed {time.time() - start:6.1f}s", flush=True)
            t_sum, d_sum = 0.0, 0.0
    target.eval()
    draft.eval()
    return time.time() - start


def target_rollouts(target, stream, cfg: TrainConfig, gen):
    """Greedy target continuations (to `context` tokens) of random `prompt_tokens` training windows."""
    import torch
    from transformers import DynamicCache

    n_new, rows = cfg.context - cfg.prompt_tokens, []
    with torch.no_grad():
        for _ in range(0, cfg.rollouts, cfg.rollout_batch):
            starts = torch.randint(0, len(stream) - cfg.prompt_tokens, (cfg.rollout_batch,), generator=gen)
            ids = torch.stack([stream[s:s + cfg.prompt_tokens] for s in starts.tolist()])
            cache, feed = DynamicCache(config=target.config), ids
            keyword = cache_keyword(type(target))
            for _ in range(n_new):
                feed = target(input_ids=feed, **{keyword: cache}, use_cache=True).logits[:, -1:].argmax(-1)
                ids = torch.cat([ids, feed], dim=1)
            rows.append(ids)
    return torch.cat(rows)[:cfg.rollouts]


def distill_loss(d_logits, t_logits, hard_weight: float):
    """KL(target || draft) + hard_weight * CE(draft, target's argmax)."""
    import torch.nn.functional as F

    hard = F.cross_entropy(d_logits.flatten(0, 1), t_logits.argmax(-1).flatten())
    return kl_to_target(d_logits, t_logits) + hard_weight * hard


def distill_draft(draft, target, rollouts, cfg: TrainConfig, gen) -> float:
    """Fine-tune the draft on the target's own greedy text, matching the target's logits there.

    The rollouts are the text greedy decoding produces, so the draft learns the target's choices
    where it will be asked for them. The argmax term is what greedy acceptance rewards; the KL term
    keeps the draft a calibrated distribution (for sampled decoding and its held-out loss).
    """
    import torch

    opt = make_optimizer(draft, cfg.distill_lr, cfg.weight_decay)
    sched = dataclasses.replace(cfg, steps=cfg.distill_steps, warmup=min(cfg.warmup, cfg.distill_steps))
    draft.train()
    start, total = time.time(), 0.0
    for step in range(cfg.distill_steps):
        set_lr(opt, cfg.distill_lr, lr_factor(step, sched))
        x = rollouts[torch.randint(0, len(rollouts), (cfg.distill_batch,), generator=gen)]
        with torch.no_grad():
            t_logits = target(input_ids=x).logits
        loss = distill_loss(draft(input_ids=x).logits, t_logits, cfg.distill_hard)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total += loss.item()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.distill_steps:
            mean = total / ((step % cfg.log_every) + 1)
            print(f"distill {step + 1:4d}/{cfg.distill_steps}  KL + {cfg.distill_hard:g} x argmax CE "
                  f"{mean:.3f}  elapsed {time.time() - start:6.1f}s", flush=True)
            total = 0.0
    draft.eval()
    return time.time() - start


# ----------------------------------------------------------------------------- evaluation

def heldout_loss(model, stream, cfg: TrainConfig) -> float:
    """Mean next-token CE over `eval_windows` evenly spaced held-out windows of `context` tokens."""
    import torch
    import torch.nn.functional as F

    n_windows = min(cfg.eval_windows, (len(stream) - 1) // cfg.context)
    stride = (len(stream) - 1 - cfg.context) // max(1, n_windows - 1)
    starts = [i * stride for i in range(n_windows)]
    x = torch.stack([stream[s:s + cfg.context] for s in starts])
    y = torch.stack([stream[s + 1:s + 1 + cfg.context] for s in starts])
    total = 0.0
    with torch.no_grad():
        for i in range(0, n_windows, 8):
            logits = model(input_ids=x[i:i + 8]).logits
            total += F.cross_entropy(logits.flatten(0, 1), y[i:i + 8].flatten(), reduction="sum").item()
    return total / y.numel()


def _crop(cache, keep: int) -> None:
    """Drop cached positions beyond `keep` (transformers 5 crops by a negative count)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


def _greedy_next(model, new_ids, cache):
    import torch

    out = model(input_ids=torch.tensor([new_ids]), **{cache_keyword(type(model)): cache}, use_cache=True)
    return out.logits[0].argmax(-1).tolist()


def speculate_greedy(draft, target, prompt_ids: list[int], k: int, max_new: int, eos: int):
    """Greedy speculative decoding of one prompt; returns (rounds, proposed, accepted, new ids)."""
    from transformers import DynamicCache

    ids = list(prompt_ids)
    d_cache, t_cache = DynamicCache(config=draft.config), DynamicCache(config=target.config)
    d_len = t_len = 0
    rounds = proposed = accepted = 0
    while len(ids) - len(prompt_ids) < max_new and ids[-1] != eos:
        _crop(d_cache, d_len)
        feed, drafts = ids[d_len:], []
        for _ in range(k):
            drafts.append(_greedy_next(draft, feed, d_cache)[-1])
            feed = drafts[-1:]
        d_len = len(ids) + k - 1
        _crop(t_cache, t_len)
        choice = _greedy_next(target, ids[t_len:] + drafts, t_cache)[-(k + 1):]
        n_ok = next((i for i in range(k) if drafts[i] != choice[i]), k)
        ids += drafts[:n_ok] + [choice[n_ok]]
        t_len, d_len = len(ids) - 1, min(d_len, len(ids) - 1)
        rounds, proposed, accepted = rounds + 1, proposed + k, accepted + n_ok
    return rounds, proposed, accepted, ids[len(prompt_ids):]


def acceptance(draft, target, tokenizer, prompts: list[str], k: int = 4, max_new_tokens: int = 128) -> dict:
    """Greedy acceptance of in-memory models; see `measure_acceptance`."""
    import torch

    totals = [0, 0, 0]
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            stats = speculate_greedy(draft, target, ids, k, max_new_tokens, tokenizer.eos_token_id)[:3]
            totals = [a + b for a, b in zip(totals, stats)]
    rounds, proposed, accepted = totals
    return {"k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "rounds": rounds,
            "proposed": proposed, "accepted": accepted, "alpha": accepted / max(1, proposed),
            "mean_accepted": accepted / max(1, rounds),
            "tokens_per_round": (accepted + rounds) / max(1, rounds)}


def measure_acceptance(draft_dir, target_dir, prompts: list[str], k: int = 4,
                       max_new_tokens: int = 128) -> dict:
    """Greedy acceptance of the draft folder against the target folder over `prompts` (strings).

    Each round the draft proposes `k` tokens greedily, the target's greedy choice is checked
    position by position, drafts are accepted up to the first mismatch and the target's token is
    appended (also after k accepted drafts). alpha = accepted drafts / proposed drafts;
    mean_accepted = accepted drafts per round; tokens_per_round = mean_accepted + 1.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    return acceptance(draft, target, tokenizer, prompts, k, max_new_tokens)


def code_start(text: str) -> int:
    """Offset of the first line starting with `def ` or `class ` (0 if none): prompts start in code."""
    for keyword in ("\ndef ", "\nclass "):
        pos = text.find(keyword)
        if pos >= 0:
            return pos + 1
    return 0


def heldout_prompts(tokenizer, texts: list[str], cfg: TrainConfig) -> list[str]:
    """`prompt_tokens` tokens from the first def/class line of the first `prompts` held-out files
    that are long enough (prompt + gen_tokens)."""
    prompts = []
    for text in texts:
        ids = tokenizer(text[code_start(text):], add_special_tokens=False)["input_ids"]
        if len(ids) >= cfg.prompt_tokens + cfg.gen_tokens:
            prompts.append(tokenizer.decode(ids[:cfg.prompt_tokens]))
        if len(prompts) == cfg.prompts:
            break
    return prompts


# ----------------------------------------------------------------------------- build

def save_model(model, tokenizer, path: Path) -> int:
    """save_pretrained (safetensors) + tokenizer; returns the safetensors bytes written."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def load_data(cfg: TrainConfig):
    root, files = stdlib_files()
    train_files, held_files = split_files(files, cfg.heldout_every)
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    tokenizer = make_tokenizer(cfg, train_texts)
    train_stream, held_stream = encode_stream(tokenizer, train_texts), encode_stream(tokenizer, held_texts)
    data = {"source": f"Python {sys.version.split()[0]} stdlib .py files under {root}, sorted; "
                      f"skipped dirs {sorted(SKIP_DIRS)} and test_*.py",
            "train_files": len(train_texts), "heldout_files": len(held_texts),
            "train_bytes": sum(len(t.encode()) for t in train_texts), "train_tokens": len(train_stream),
            "heldout_tokens": len(held_stream),
            "heldout_example": [str(f.relative_to(root)) for f in held_files[:5]]}
    return tokenizer, train_stream, held_stream, held_texts, data


def log_data(data: dict, vocab: int, t0: float) -> None:
    print(f"data: {data['train_files']} train files, {data['train_tokens']} tokens "
          f"({data['train_bytes'] / data['train_tokens']:.2f} bytes/token), {data['heldout_files']} held-out "
          f"files; vocab {vocab}; {time.time() - t0:.1f}s", flush=True)


def build_pair_models(cfg: TrainConfig, tokenizer):
    target, draft = build_model(cfg, tokenizer, "target"), build_model(cfg, tokenizer, "draft")
    params = {"target": n_params(target), "draft": n_params(draft)}
    print(f"params: target {params['target']:,}  draft {params['draft']:,}  "
          f"ratio {params['target'] / params['draft']:.1f}x", flush=True)
    assert params["target"] >= 10 * params["draft"], "target must have at least 10x the draft's parameters"
    return target, draft, params


def log_acceptance(tag: str, acc: dict, seconds: float) -> None:
    print(f"greedy acceptance {tag} (k={acc['k']}, {acc['prompts']} held-out prompts): "
          f"alpha {acc['alpha']:.3f}  mean accepted/round {acc['mean_accepted']:.2f}  ({seconds:.1f}s)",
          flush=True)


def sample(target, tokenizer, prompt: str, n: int) -> str:
    import torch

    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = target.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, len(ids):].tolist())


def train_all(target, draft, tokenizer, train_stream, held_stream, prompts, cfg: TrainConfig) -> dict:
    """Joint training, then the draft's distillation on target rollouts; returns timings and figures."""
    import torch

    fig = {"train_seconds": train(target, draft, train_stream, cfg)}
    fig["heldout_loss_nats_per_token"] = {"target": heldout_loss(target, held_stream, cfg),
                                          "draft_before_distill": heldout_loss(draft, held_stream, cfg)}
    t0 = time.time()
    fig["acceptance_before_distill"] = acceptance(draft, target, tokenizer, prompts, cfg.k, cfg.gen_tokens)
    log_acceptance("before distillation", fig["acceptance_before_distill"], time.time() - t0)
    t0, gen = time.time(), torch.Generator().manual_seed(cfg.seed + 1)
    rollouts = target_rollouts(target, train_stream, cfg, gen)
    fig["rollout_seconds"] = time.time() - t0
    print(f"rollouts: {tuple(rollouts.shape)} target greedy tokens in {fig['rollout_seconds']:.1f}s",
          flush=True)
    fig["distill_seconds"] = distill_draft(draft, target, rollouts, cfg, gen)
    fig["heldout_loss_nats_per_token"]["draft"] = heldout_loss(draft, held_stream, cfg)
    return fig


def build(out_dir: str | os.PathLike, cfg: TrainConfig) -> dict:
    import torch

    torch.set_num_threads(cfg.threads)
    t0, out = time.time(), Path(out_dir)
    tokenizer, train_stream, held_stream, held_texts, data = load_data(cfg)
    log_data(data, len(tokenizer), t0)
    prompts = heldout_prompts(tokenizer, held_texts, cfg)
    target, draft, params = build_pair_models(cfg, tokenizer)
    fig = train_all(target, draft, tokenizer, train_stream, held_stream, prompts, cfg)
    losses = fig["heldout_loss_nats_per_token"]
    print(f"held-out loss (nats/token): target {losses['target']:.3f}  draft {losses['draft']:.3f}  "
          f"(draft before distillation {losses['draft_before_distill']:.3f})", flush=True)
    sizes = {name: save_model(m, tokenizer, out / name) for name, m in (("draft", draft), ("target", target))}
    acc_t0 = time.time()
    acc = measure_acceptance(out / "draft", out / "target", prompts, cfg.k, cfg.gen_tokens)
    log_acceptance("(saved pair)", acc, time.time() - acc_t0)
    report = {"tokenizer": {"kind": cfg.tokenizer, "vocab_size": len(tokenizer)}, "params": params,
              "safetensors_bytes": sizes, "acceptance": acc, **fig, "build_seconds": time.time() - t0,
              "torch_threads": cfg.threads, "data": data, "config": dataclasses.asdict(cfg),
              "sample": {"prompt": prompts[0], "target_greedy": sample(target, tokenizer, prompts[0], 96)}}
    (out / "pair.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def parse_args(argv=None) -> tuple[str, TrainConfig]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (gets draft/, target/, pair.json)")
    for f in dataclasses.fields(TrainConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(f.default),
                            default=f.default)
    args = vars(parser.parse_args(argv))
    return args.pop("out"), TrainConfig(**args)


def main(argv=None) -> None:
    out, cfg = parse_args(argv)
    report = build(out, cfg)
    print(f"wrote {out}/draft, {out}/target, {out}/pair.json in {report['build_seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
