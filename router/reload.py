"""Reloading a running router's config (Admin.Reload, SIGHUP): which keys a reload may change, the command line's
values over the reloaded file's, the document's checks, and the operator's log line of what changed (secrets
redacted)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import yaml

from router.oplog import say
from settings.schema import ConfigError, SpecpoolConfig, check_ports, shown
from settings.yaml_doc import parse_yaml

if TYPE_CHECKING:
    from router.server import Router


class RestartRequired(ValueError):
    """A reload tried to change something only a restart can change."""


def check_reloadable(old: SpecpoolConfig, new: SpecpoolConfig, draft_pool: bool | None = None,
                     document: dict | None = None) -> None:
    """Raise RestartRequired naming the first key a reload cannot change, with the running value and the new one
    (replicas may only grow; router.log_requests and admin_keys may change; draft.method may change, to a method
    that uses the draft model only if a draft pool runs: `draft_pool`, by default whether the old method started
    one). `document`: the reloaded YAML, to say when the new value is a default because the key is absent from it."""
    for section in ("router", "ray", "draft", "target", "tls", "http"):
        before, after = getattr(old, section), getattr(new, section)
        if section == "router":
            after = dataclasses.replace(after, **{key: getattr(before, key) for key in ROUTER_RELOADABLE})
        if section in ("draft", "target"):
            if after.replicas < before.replicas:
                raise RestartRequired(f"{section}.replicas: scaling down needs a restart (running "
                                      f"{before.replicas}, this document {after.replicas})")
            after = dataclasses.replace(after, replicas=before.replicas)
        if section == "draft":
            if after.uses_model and not (before.uses_model if draft_pool is None else draft_pool):
                raise RestartRequired("draft.method: no draft pool was started (method ngram); using the draft "
                                      "model needs a restart")
            after = dataclasses.replace(after, **{key: getattr(before, key) for key in DRAFT_RELOADABLE})
        changed = [f.name for f in dataclasses.fields(before) if getattr(before, f.name) != getattr(after, f.name)]
        if changed:
            key = changed[0]
            written = (document or {}).get(section)
            absent = document is not None and (not isinstance(written, dict) or key not in written)
            raise RestartRequired(f"{section}.{key}: changing this needs a restart (running "
                                  f"{shown(before, key)}, this document {shown(after, key)}"
                                  f"{': the default, as the key is absent' if absent else ''})")


def config_changes(old: SpecpoolConfig, new: SpecpoolConfig) -> list[str]:
    """What a reload changed, one `section.key old -> new` per key (for the operator's log; a secret's values
    redacted)."""
    changes = []
    for section in dataclasses.fields(old):
        before, after = getattr(old, section.name), getattr(new, section.name)
        changes += [f"{section.name}.{f.name} {shown(before, f.name, str)} -> {shown(after, f.name, str)}"
                    for f in dataclasses.fields(before) if getattr(before, f.name) != getattr(after, f.name)]
    return changes


async def logged_reload(router: "Router", read: Callable[[], dict], config_dir: str | None,
                        source: str) -> list[str]:
    """Reload the router with the document `read()` returns, and log it the same way whoever asked (Admin.Reload,
    SIGHUP): what changed, or "no change"; a refusal with its reason (and re-raised). Returns what changed."""
    before = router.config
    try:
        await router.reload(read(), config_dir)
    except (ValueError, yaml.YAMLError) as exc:     # ConfigError, RestartRequired, bad YAML
        say(f"reload {source} refused, running config kept: {exc}")
        raise
    changes = config_changes(before, router.config)
    say(f"reloaded {source}: {', '.join(changes) or 'no change'}")
    return changes


DRAFT_RELOADABLE = ("method", "ngram_min", "ngram_max", "ngram_max_tokens", "prediction_max_tokens",   # router-side:
                    "prediction_trial_rounds")                                                      # new requests
ROUTER_RELOADABLE = ("log_requests", "admin_keys")          # read as each request ends, as each Admin call comes


def with_overrides(config: SpecpoolConfig, overrides: dict) -> SpecpoolConfig:
    """`config` with the command line's values over the file's: `overrides` maps a section to its keys' values,
    e.g. {"router": {"port": 50071}} for `serve --port 50071`. Each overridden section is checked again (`serve
    --port 50052` beside the default router.admin_port is refused naming both, not failed as a busy port)."""
    for section, values in overrides.items():
        config = dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **values)})
        getattr(config, section).validate(section)
    check_ports(config)
    return config


def reload_document(config_yaml: str) -> dict:
    """A ReloadRequest's config as parsed YAML (a key given twice is refused, naming its line), not empty."""
    return not_empty(parse_yaml(config_yaml, "config_yaml"), "config_yaml")


def not_empty(data, source: str):
    """A reloaded document, refused when empty (or comments only; a file caught while being rewritten): reloading
    every default is almost surely a mistake."""
    if data is None:
        raise ConfigError(f"{source}: empty")
    return data
