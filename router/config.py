"""specpool's YAML config: one dataclass per section, validated at load.

    specpool serve --config deploy/local.yaml

An unknown key or a bad value raises ConfigError naming it (e.g. "draft.replicas: must be >= 1").
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from draft_worker.config import DraftConfig
from router.controller import ControllerConfig
from target_worker.config import ConfigError, TargetConfig, TlsConfig

DRAFT_SAMPLING_MODES = ("greedy", "sampled")


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"          # interface the public gRPC server binds
    port: int = 50051
    worker_timeout_s: float = 30.0   # per router -> worker call
    ready_timeout_s: float = 600.0   # how long serve waits for every pool to load
    metrics_port: int = -1           # Prometheus /metrics on router.host (-1: off, 0: any free port)
    max_active_requests: int = 64    # requests generating at once; more wait in the admission queue
    max_queued_requests: int = 256   # beyond this, RESOURCE_EXHAUSTED at once
    max_prompt_tokens: int = 0       # size cap on prompts (0: the model's context)
    max_new_tokens: int = 4096       # size cap on outputs (0: the model's context)
    shutdown_grace_s: float = 30.0   # on SIGTERM: how long in-flight requests may take to finish
    target_recovery_s: float = 60.0  # how long a request waits for a failed target to come back

    def validate(self, section: str = "router") -> None:
        for key in ("port", "metrics_port"):
            if not -1 <= getattr(self, key) <= 65535 or (key == "port" and self.port < 0):
                raise ConfigError(f"{section}.{key}: must be a port number (got {getattr(self, key)!r})")
        for key in ("worker_timeout_s", "ready_timeout_s", "max_active_requests", "shutdown_grace_s",
                    "target_recovery_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{section}.{key}: must be > 0 (got {getattr(self, key)!r})")
        for key in ("max_queued_requests", "max_prompt_tokens", "max_new_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{section}.{key}: must be >= 0 (got {getattr(self, key)!r})")


@dataclass
class SpeculationConfig(ControllerConfig):
    """The K controller's knobs (router/controller.py) plus how drafts are sampled."""
    draft_sampling: str = "greedy"   # greedy: q one-hot, IDs only; sampled: draft samples, sends hidden states

    def validate(self, section: str = "speculation") -> None:
        try:
            super().validate(section)
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if self.draft_sampling not in DRAFT_SAMPLING_MODES:
            raise ConfigError(f"{section}.draft_sampling: must be one of {DRAFT_SAMPLING_MODES} "
                              f"(got {self.draft_sampling!r})")


@dataclass
class RayConfig:
    address: str = ""                # "" starts a local Ray instance; "auto" or host:port joins a cluster
    namespace: str = "specpool"
    node_ip: str = ""                # address workers bind and advertise ("": their Ray node's IP);
                                     # 127.0.0.1 keeps a single-machine deployment on loopback
    num_cpus: int = 0                # local instance only: logical CPUs (0: Ray's default)
    resources: dict = field(default_factory=dict)   # local instance only: custom resources to declare

    def validate(self, section: str = "ray") -> None:
        if self.num_cpus < 0:
            raise ConfigError(f"{section}.num_cpus: must be >= 0 (got {self.num_cpus!r})")


@dataclass
class SpecpoolConfig:
    router: RouterConfig = field(default_factory=RouterConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)


def _coerce(value, kind, key: str):
    """Check one scalar against its dataclass field type; ints are accepted where floats are."""
    origin = typing.get_origin(kind) or kind
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be a mapping (got {value!r})")
        return dict(value)
    if not isinstance(value, origin) or (origin is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: must be {origin.__name__} (got {value!r})")
    return value


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: must be a mapping (got {data!r})")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            kwargs[name] = _build(kind, value or {}, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, kind, prefix + name)
    return cls(**kwargs)


def config_from_dict(data: dict) -> SpecpoolConfig:
    config = _build(SpecpoolConfig, data or {}, "")
    for section in dataclasses.fields(SpecpoolConfig):
        getattr(config, section.name).validate(section.name)
    return config


def load_config(path: str | os.PathLike) -> SpecpoolConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    return config_from_dict(with_model_paths_from(data, path.parent))


def with_model_paths_from(data, folder: Path):
    """A relative model path that names a folder next to the YAML file is read from there (so a config
    works from any directory); anything else (hub IDs, builtin: pairs, absolute paths) is left alone."""
    for section in ("draft", "target"):
        pool = data.get(section) if isinstance(data, dict) else None
        model = pool.get("model") if isinstance(pool, dict) else None
        if isinstance(model, str) and model and not Path(model).is_absolute() and (folder / model).is_dir():
            pool["model"] = str((folder / model).resolve())
    return data


def config_to_yaml(config) -> str:
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)
