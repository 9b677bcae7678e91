"""Prefix-aware replica choice (`router.prefix_affinity_slack`): a request whose prompt begins as an earlier one's
did goes to the replica that served that one, whose prefix cache holds those blocks (engine/prefix_cache.py),
unless that replica is out of the pool or holds more than `slack` sessions beyond the least loaded one; any other
request goes to the least loaded replica. A pool of one replica, a prompt shorter than a block, or slack -1 is
plain least-loaded choice. The router names the blocks as the workers do, keeps which replica last took each
(least recently used first out, at most `max_blocks`), and imports no torch.

    affinity = PrefixAffinity(slack=4)
    target = affinity.choose(targets, prompt_ids)     # and remembers that this replica now holds them
"""
from __future__ import annotations

from collections import OrderedDict

from engine.prefix_cache import BLOCK, block_names
from router.worker_client import WorkerClient, least_loaded


class PrefixAffinity:
    """Which replica of one pool last took each prompt block."""

    def __init__(self, slack: int = 4, max_blocks: int = 65536, block: int = BLOCK):
        self.slack, self.max_blocks, self.block = slack, max_blocks, block
        self._owners: OrderedDict[bytes, WorkerClient] = OrderedDict()

    def choose(self, clients: list[WorkerClient], prompt) -> WorkerClient:
        """The replica for a request with this prompt (token IDs), its blocks now counted as that replica's."""
        least = least_loaded(clients)
        if self.slack < 0 or len(clients) < 2:
            return least
        names = block_names(prompt, len(prompt) // self.block, self.block)
        chosen = self._owner(names, clients, least) or least
        for name in names:
            self._owners[name] = chosen
            self._owners.move_to_end(name)
        while len(self._owners) > self.max_blocks:
            self._owners.popitem(last=False)
        return chosen

    def _owner(self, names: list[bytes], clients: list[WorkerClient], least: WorkerClient) -> WorkerClient | None:
        """The replica that took the longest of these prefixes, if it may take this request too."""
        for name in reversed(names):
            owner = self._owners.get(name)
            if owner is not None:
                usable = owner in clients and owner.healthy and owner.outstanding <= least.outstanding + self.slack
                return owner if usable else None
        return None
