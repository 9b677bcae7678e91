"""Which K each round uses: the request's own controller once it has seen enough of its rounds
(its text may draft better or worse than the pool's average), else the pool's controller. Both
learn from every round; the metrics see every round too."""
from __future__ import annotations

import random

from router.controller import KController
from settings.schema import ControllerConfig
from router.metrics import Metrics
from router.speculation import RequestState, Round


class KSelector:
    """The pool's KController, per-request KControllers, and the metrics they feed."""

    def __init__(self, config: ControllerConfig, metrics: Metrics, rng: random.Random | None = None):
        self._rng = rng or random.Random()
        self.config = config
        self.pool = KController(config, self._rng)
        self.metrics = metrics
        self.active: set[KController] = set()
        metrics.k.set(self.pool.k)

    def attach(self, state: RequestState) -> None:
        state.controller = KController(self.config, random.Random(self._rng.getrandbits(64)))
        self.active.add(state.controller)

    def detach(self, state: RequestState) -> None:
        self.active.discard(state.controller)

    def choose_k(self, state: RequestState) -> int:
        own = state.controller
        if own is not None and own.rounds >= self.config.warmup_rounds:
            return own.choose_k()
        return self.pool.choose_k()

    @property
    def overlap(self) -> bool:
        """Whether rounds pre-draft the next one while the target verifies (speculation.overlap)."""
        return self.config.overlap

    @property
    def predraft_k(self) -> int:
        """The most drafts a pre-draft may carry after its guess (speculation.overlap_tokens - 1)."""
        return (self.config.overlap_tokens or self.config.k_max + 1) - 1

    def observe(self, state: RequestState, round_: Round) -> None:
        self.pool.observe(round_.k, round_.accepted, round_.timings)
        if state.controller is not None:
            state.controller.observe(round_.k, round_.accepted, round_.timings)
        self.metrics.observe_round(round_)
        self.metrics.k.set(self.pool.k)

    def update_config(self, config: ControllerConfig) -> None:
        """Between rounds: new requests and the pool use it; statistics are kept."""
        self.config = config
        for controller in (self.pool, *self.active):
            controller.update_config(config)
        self.metrics.k.set(self.pool.k)
