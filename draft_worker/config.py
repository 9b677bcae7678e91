"""Config of the draft pool (the `draft:` section of the YAML). No torch here."""
from __future__ import annotations

from dataclasses import dataclass

from target_worker.config import PoolConfig


@dataclass
class DraftConfig(PoolConfig):
    model: str = "builtin:random-pair/draft"

    def validate(self, section: str = "draft") -> None:
        super().validate(section)
