"""A standalone benchmark's output (benchmarks.lookup, benchmarks.prefix, benchmarks.prediction): its sections, one
per model pair, as <out>/<stem>.json (with the bench config) and <stem>.md, and printed; its paired ratios' lines.

    write_sections(cfg, "prefix", {"demo pair": section}, markdown)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Callable


def write_sections(cfg, stem: str, sections: dict, markdown: Callable[[dict], str]) -> None:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    text = "".join(f"### {name}\n\n{markdown(section)}\n" for name, section in sections.items())
    (out / f"{stem}.json").write_text(json.dumps({"bench": dataclasses.asdict(cfg), **sections}, indent=2))
    (out / f"{stem}.md").write_text(text)
    print(text)


def ratio_lines(ratios: dict[str, tuple[float, float, float]]) -> list[str]:
    """Markdown lines of paired ratios (repeats.paired: median, lowest, highest)."""
    return [f"- {name}: {ratio:.2f} ({low:.2f}-{high:.2f} over the repeats)" for name, (ratio, low, high) in
            ratios.items()]


def pair_arguments(description: str, max_new_tokens: int, repeats: int) -> argparse.ArgumentParser:
    """A standalone benchmark's usual options: --config, --out, --max-new-tokens, --repeats, --heavy-layers."""
    from benchmarks.plan import BenchConfig
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=BenchConfig.config)
    parser.add_argument("--out", default=BenchConfig.out)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--heavy-layers", type=int, default=0, help="also on the heavy pair with this many "
                        "zero-output layers (tools/heavy_pair.py)")
    return parser
