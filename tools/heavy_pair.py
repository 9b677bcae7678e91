"""The heavy benchmark pair: the demo target made as slow as a GPU-sized target is relative to a hop.

On the demo pair a target pass (~1.75 ms) costs about one router <-> worker hop; on a GPU a 70B target's pass
takes 20-50 ms, dozens of hops. A benchmark where hop and pass cost the same hides what matters there, so
`make bench` also runs this pair: the demo target plus `extra_layers` decoder layers whose output projections
(attention o_proj and MLP down_proj) are zero. Each extra layer does the full work of a real one, but adds
exactly 0.0 to the residual stream, so the model's logits, and its tokens, are bit for bit the demo target's.
The draft is the demo draft, unchanged. Nothing here is a real model: it exists to put the pass/hop ratio
where production has it.

    python -m tools.heavy_pair --extra-layers 40      # prints the draft and target folders
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from engine.model_pair import cache_dir, locked_build

DEMO_PAIR = Path(__file__).resolve().parent.parent / "deploy" / "models" / "demo-pair"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def heavy_target(demo_target: Path, extra_layers: int, seed: int = 0):
    """The demo target with `extra_layers` more layers, each computing but adding exactly zero."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(demo_target)
    layers = config.num_hidden_layers
    config.num_hidden_layers = layers + extra_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    missing, _ = model.load_state_dict(AutoModelForCausalLM.from_pretrained(demo_target).state_dict(), strict=False)
    assert all(".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= layers for name in missing)
    with torch.no_grad():
        for layer in model.model.layers[layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model.eval()


def build(out: Path, extra_layers: int) -> None:
    """Write `out/target` (the heavy target) and `out/draft` (a copy of the demo draft)."""
    heavy_target(DEMO_PAIR / "target", extra_layers).save_pretrained(out / "target")
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_PAIR / "target" / name, out / "target" / name)
    shutil.copytree(DEMO_PAIR / "draft", out / "draft")


def ensure_heavy_pair(extra_layers: int = 40) -> tuple[Path, Path]:
    """(draft, target) folders of the heavy pair, built once under the specpool cache."""
    out = cache_dir() / f"heavy-pair-{extra_layers}"
    locked_build(out, lambda tmp: build(tmp, extra_layers), f"heavy pair (+{extra_layers} zero-output layers)")
    return out / "draft", out / "target"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra-layers", type=int, default=40)
    print(*ensure_heavy_pair(parser.parse_args().extra_layers), sep="\n")


if __name__ == "__main__":
    main()
