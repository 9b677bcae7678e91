"""What `specpool status` prints first: a dozen lines an on-call engineer can read at a glance, built from
Admin.GetStatus's running config and live statistics (the whole of both, ~500 lines: `specpool status --full`;
the statistics alone as JSON, for jq and scripts: `specpool status --json`).

    specpool status --config deploy/local.yaml
"""
from __future__ import annotations

from settings.cpu_list import format_cpus

FOOTER = "all of the config and statistics: specpool status --full (the statistics as JSON: --json)"


def summary(config: dict, stats: dict) -> str:
    """The summary of a running server's `config` (Admin.GetStatus config_yaml, parsed) and `stats` (stats_json)."""
    return "\n".join([serving_line(stats), k_line(config, stats), *acceptance_lines(stats["pools"]),
                      *delivery_lines(config, stats), prefix_line(config, stats), "workers:", *worker_lines(stats),
                      FOOTER])


def serving_line(stats: dict) -> str:
    """Whether it serves (a target replica is ready and it is not shutting down, as health says) and the requests
    in it."""
    targets = stats["workers"]["target"]
    ready = sum(worker["state"] == "ready" for worker in targets)
    state = ("NOT_SERVING (shutting down: the requests in it drain, new ones are refused)" if stats.get("draining")
             else "SERVING" if ready else "NOT_SERVING (no target replica is ready)")
    return (f"{state}: {ready} of {len(targets)} target replica(s) ready; {stats['active_requests']} request(s) "
            f"generating, {stats['queued_requests']} queued")


def k_line(config: dict, stats: dict) -> str:
    """The K the policy last chose for greedy rounds (the `k` gauge), who chose it, and the speculation settings
    that shape it. A request that sets its own K keeps it, whatever this says."""
    speculation, method = config.get("speculation", {}), config.get("draft", {}).get("method", "model")
    overlap = "n/a (n-gram drafts)" if method == "ngram" else "on" if speculation.get("overlap") else "off"
    return (f"adaptive K {stats['k']}, last chosen by {stats['k_from']} (a request's own K stays its own); policy "
            f"{speculation.get('policy')}, draft.method {method}, draft_sampling {speculation.get('draft_sampling')}, "
            f"overlap {overlap}")


SOURCES = tuple(f"{source}/{regime}" for source in ("model", "ngram")     # the pool controllers, by source and
                for regime in ("greedy", "sampled", "greedy predicted", "sampled predicted"))   # regime


def acceptance_lines(pools: dict) -> list[str]:
    """Per proposal source and sampling regime with drafts verified, the pool controller's acceptance at each draft
    position, with the drafts verified there in its window (speculation.window: recent rounds, not a total), and
    the tokens/s its cost model expects at each K (the goodput policy's choice: why K is what it is)."""
    lines = []
    for name in SOURCES:
        pool = pools.get(name) or {}
        seen = [f"{rate:.2f} ({n})" for rate, n in zip(pool.get("acceptance", ()), pool.get("samples", ())) if n]
        if seen:
            source, regime = name.split("/")
            lines.append(f"acceptance by draft position (recent drafts), {source} drafts, {regime}: {' '.join(seen)}")
            lines += goodput_line(pool, f"{source} drafts, {regime}")
    return lines or ["acceptance: no drafts verified yet"]


def goodput_line(pool: dict, which: str) -> list[str]:
    """The modelled tokens/s by K once the controller has timed rounds (none before), the best marked."""
    curve = pool.get("goodput_tokens_per_s") or {}
    if not curve:
        return []
    best = max(curve, key=curve.get)
    shown = ", ".join(f"K={k} {tokens:.0f}{' (best)' if k == best else ''}" for k, tokens in curve.items())
    return [f"modelled tokens/s, {which}: {shown}"]


def delivery_lines(config: dict, stats: dict) -> list[str]:
    """Under draft.method model+ngram (and for requests with a prediction, which draft so on any pool), per regime
    with both kinds timed: what requests drafting from both sources and those on prompt lookup alone have delivered, and which way new requests run (random_probe aside; the less
    measured way while either has fewer than warmup_rounds behind it)."""
    lines, delivered = [], stats.get("delivered") or {}
    for name, seen in delivered.items():
        if config.get("draft", {}).get("method") != "model+ngram" and "predicted" not in name:
            continue                                   # (a request with a prediction runs model+ngram anyway)
        both, alone = seen.get("both_tokens_per_s"), seen.get("lookup_alone_tokens_per_s")
        if both and alone:
            lines.append(f"model+ngram, {name}: both sources delivered {both:.0f} tokens/s, lookup alone "
                         f"{alone:.0f}: new requests draft from {seen['new_requests']}")
    return lines


def prefix_line(config: dict, stats: dict) -> str:
    """How much of the contexts that sessions started on each pool found in its prefix caches, since the start."""
    pools = [pool for pool in ("target", "draft") if config.get(pool, {}).get("prefix_cache_tokens")]
    if config.get("draft", {}).get("method") == "ngram" and "draft" in pools:
        pools.remove("draft")                          # no draft pool runs
    if not pools:
        return "prefix cache: off"
    counts = stats.get("prefix_cache", {})
    parts = []
    for pool in pools:
        found, looked_up = counts.get(pool, {}).get("found", 0), counts.get(pool, {}).get("looked_up", 0)
        share = f" ({100 * found / looked_up:.0f} %)" if looked_up else ""
        parts.append(f"{pool} {found:,} of {looked_up:,}{share}")
    return "prefix cache, context tokens found of those looked up at session starts: " + ", ".join(parts)


def worker_lines(stats: dict) -> list[str]:
    """One line per replica: its state, address, CPUs and sessions; when it is down or did not load, why."""
    lines = []
    for pool in ("target", "draft"):
        for worker, sessions in zip(stats["workers"][pool], stats["outstanding_sessions"][pool]):
            lines.append(f"  {worker['name']}: {worker['state']}{worker_detail(worker, sessions)}")
    return lines


def worker_detail(worker: dict, sessions: int) -> str:
    if worker["state"] == "down":
        return f" for {worker['down_for_s']} s (since {worker['down_since']}): {worker.get('last_error', '')}"
    if worker["state"] == "failed":
        return f" to load, out of the pool until a restart: {worker.get('error', '')}"
    at = f" at {worker['address']}" if worker["address"] else ""
    at += f" on CPU(s) {format_cpus(worker['cpus'])}" if worker.get("cpus") else ""
    return f"{at}, {sessions} session(s)" if worker["state"] == "ready" else at
