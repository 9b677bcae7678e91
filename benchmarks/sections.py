"""A standalone benchmark's output (benchmarks.lookup, benchmarks.prefix): its sections, one per model pair, as
<out>/<stem>.json (with the bench config) and <stem>.md, and printed.

    write_sections(cfg, "prefix", {"demo pair": section}, markdown)
"""
from __future__ import annotations

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
