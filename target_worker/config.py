"""Config of a worker pool (the `draft:` and `target:` sections of the YAML). No torch here."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

DTYPE_NAMES = ("float32", "float16", "bfloat16")


class ConfigError(ValueError):
    """A config value is missing, unknown or out of range; the message names the key."""


@dataclass
class PoolConfig:
    model: str = ""                 # HF model folder, hub ID, or builtin:random-pair/{draft,target}
    replicas: int = 1
    dtype: str = "float32"
    device: str = "cpu"             # "cpu" or "cuda"
    num_gpus: float = 0.0           # GPUs per actor (per rank for the target)
    num_cpus: float = 1.0           # logical CPUs Ray reserves per actor
    resources: dict = field(default_factory=dict)   # Ray custom resources that pick this pool's nodes
    num_threads: int = 0            # torch intra-op threads per actor (0: torch's default)
    max_sessions: int = 256         # KV caches held per worker (LRU beyond that)
    max_batch_size: int = 16        # calls run as one batched forward (1: no batching)
    batch_wait_ms: float = 0.0      # after a call arrives at an idle worker, wait this long for more to batch
                                    # with it (calls arriving while a batch runs always join the next one)

    def validate(self, section: str) -> None:
        checks = [
            (bool(self.model), "model", "must name a model folder or hub ID"),
            (self.replicas >= 1, "replicas", "must be >= 1"),
            (self.dtype in DTYPE_NAMES, "dtype", f"must be one of {DTYPE_NAMES}"),
            (self.device == "cpu" or self.device.startswith("cuda"), "device", "must be 'cpu' or 'cuda'"),
            (self.num_gpus >= 0, "num_gpus", "must be >= 0"),
            (self.num_cpus >= 0, "num_cpus", "must be >= 0"),
            (self.num_threads >= 0, "num_threads", "must be >= 0"),
            (self.max_sessions >= 1, "max_sessions", "must be >= 1"),
            (self.max_batch_size >= 1, "max_batch_size", "must be >= 1"),
            (0 <= self.batch_wait_ms <= 1000, "batch_wait_ms", "must be in [0, 1000]"),
            (all(isinstance(v, (int, float)) for v in self.resources.values()), "resources",
             "must map resource names to numbers"),
        ]
        for ok, key, message in checks:
            if not ok:
                raise ConfigError(f"{section}.{key}: {message} (got {getattr(self, key)!r})")


@dataclass
class TargetConfig(PoolConfig):
    model: str = "builtin:random-pair/target"
    tensor_parallel_size: int = 1   # ranks per target replica, packed on one node

    def validate(self, section: str = "target") -> None:
        super().validate(section)
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"{section}.tensor_parallel_size: must be >= 1 (got {self.tensor_parallel_size!r})")


@dataclass
class TlsConfig:
    """The `tls:` section: TLS on the public port and (mutual) TLS on router <-> worker channels.
    Paths must exist on every node that reads them (router and workers)."""
    cert: str = ""                  # PEM certificate chain of this deployment ("": TLS off)
    key: str = ""                   # its PEM private key
    ca: str = ""                    # PEM CA bundle that signed the peers' certificates
    client_auth: bool = False       # public port: require client certificates (mutual TLS)
    internal: bool = True           # router <-> workers over mutual TLS (both present `cert`)
    server_name: str = ""           # name to check in worker certificates ("": their address)

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def validate(self, section: str = "tls") -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError(f"{section}.key: cert and key go together (cert={self.cert!r}, key={self.key!r})")
        if self.enabled and not self.ca and (self.internal or self.client_auth):
            raise ConfigError(f"{section}.ca: needed to verify peers when internal or client_auth is on")
        for key in ("cert", "key", "ca"):
            path = getattr(self, key)
            if path and not os.path.isfile(os.path.expanduser(path)):
                raise ConfigError(f"{section}.{key}: no such file {path!r}")
