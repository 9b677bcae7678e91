"""What one run of the speedup benchmark measures: the prompt set, lengths, repeats, the fixed K values and
the stream counts of the sweep (BenchConfig), and the smaller settings of a --quick smoke run.

    python -m benchmarks.speedup --quick --max-new-tokens 32   # QUICK, a flag given overriding its value
"""
from __future__ import annotations

from dataclasses import dataclass, field

PREDICTABLE = ["def __init__(self, *args, **kwargs):\n        super().__init__(",
               "import os\nimport sys\n\n\ndef main():\n    parser = argparse.",
               "    for i in range(len(self.items)):\n        if self.items[i] is None:\n"]
UNPREDICTABLE = ["Quartz jackdaws vex my big sphinx; 7 zebras", "xq9 #Lr! vZ2 @@ 1k7 ;;p", "The weather in Oslo"]
QUICK = {"max_new_tokens": 16, "repeats": 1, "lookup_repeats": 1, "ks": (2, 4)}   # --quick, for smoke runs


@dataclass
class BenchConfig:
    config: str = "deploy/local.yaml"
    out: str = "benchmarks/results"
    max_new_tokens: int = 96
    repeats: int = 3
    lookup_repeats: int = 7           # the prompt-lookup section's (benchmarks/lookup.py): its goals compare rows
                                      # whose expected speeds are close, so more repeats than the others
    ks: tuple = (1, 2, 4, 6, 8)
    concurrency: tuple = (1, 2, 4, 8, 16)
    prompts: list = field(default_factory=lambda: PREDICTABLE + UNPREDICTABLE)
    sweep_only: bool = False          # skip the single-stream rows (transformers, K, wire, trace)
    heavy_layers: int = 40            # zero-output layers of the heavy pair (tools/heavy_pair.py; 0: skip it)
