"""Build tools that are not part of any runtime: the demo pair's training script and the benchmark's heavy pair."""
