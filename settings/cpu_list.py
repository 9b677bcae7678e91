"""CPU lists in a config (`draft.cpus`, `target.cpus`): a YAML list of ids or a Linux CPU list string, as taskset
takes them. Pinning itself is engine/pinning.py.

    parse_cpus("0-3,8")     # [0, 1, 2, 3, 8]
    format_cpus([0, 1, 2, 3, 8])   # "0-3,8"
"""
from __future__ import annotations


AUTO = "auto"      # the launcher gives each actor its own CPUs on a local instance (engine.pinning.auto_cpus)


def parse_cpus(spec) -> list[int]:
    """CPU ids from a YAML list of ints or a Linux CPU list string ("0-3,8"); [] for none (and for AUTO, which the
    launcher resolves per actor). ValueError if malformed."""
    if spec in (None, "", [], AUTO):
        return []
    if isinstance(spec, str):
        spec = [part.strip() for part in spec.split(",")]
        ids = [n for part in spec for n in _cpu_range(part)]
    elif isinstance(spec, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) for n in spec):
        ids = list(spec)
    else:
        raise ValueError("must be a list of CPU ids, a CPU list such as '0-3,8', or 'auto'")
    if any(n < 0 for n in ids) or len(set(ids)) != len(ids):
        raise ValueError("CPU ids must be >= 0 and each listed once")
    return ids


def _cpu_range(part: str) -> range:
    first, dash, last = part.partition("-")
    if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
        raise ValueError(f"{part!r} is not a CPU id or range such as '0-3'")
    return range(int(first), int(last if dash else first) + 1)


def format_cpus(ids) -> str:
    """A Linux CPU list string of `ids`, runs of consecutive ids as ranges: [0, 1, 2, 3, 8] -> "0-3,8"."""
    runs: list[list[int]] = []
    for n in sorted(ids):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
