"""The benchmark's outputs under --out: results.json (everything measured), results.md (the single-stream
table, the concurrency table and the goal verdicts), concurrency.png, and without --sweep-only speedup.png
(measured and analytic speedup against K) and adaptive.png (adaptive K and rolling acceptance per round).

    python -m benchmarks.speedup --quick --out /tmp/bench   # writes them all under /tmp/bench
"""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.concurrency import HF_BATCHED, OFF_ADAPTIVE, ON_ADAPTIVE, ON_K0
from benchmarks.lookup import markdown as lookup_markdown
from benchmarks.prefix import markdown as prefix_markdown
from router.round_timing import PARTS

SINGLE_HEADER = ("| row | tokens/s | TTFT ms | ITL p50 / p99 ms | α | tokens/round | analytic | efficiency "
                 "| wire B/round (greedy) | full q B/round |\n|---|---|---|---|---|---|---|---|---|---|\n")
SWEEP_NAMES = (ON_ADAPTIVE, OFF_ADAPTIVE, ON_K0, HF_BATCHED)
SWEEP_RATIOS = ("batching on / off", "adaptive / K=0", "adaptive / transformers batched")
TRACE_WINDOW = 8      # drafting rounds of adaptive.png's rolling acceptance


# ---- results.md -------------------------------------------------------------------------------
def single_line(name: str, r: dict) -> str:
    head = f"| {name} | {r['tokens_per_s']:.1f} | {r['ttft_ms']:.1f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} |"
    if "alpha" not in r:
        return head + " | | | | | |"
    return head + (f" {r['alpha']:.2f} | {r['mean_accepted_len']:.2f} | {r['analytic']:.2f} | {r['efficiency']:.2f} "
                   f"| {r['wire_bytes_per_round']:.0f} | {r['full_probs_bytes_per_round']} |")


def single_markdown(single: dict) -> str:
    lines = [single_line(name, r) for name, r in single["rows"].items()]
    return (SINGLE_HEADER + "\n".join(lines) + f"\n\nc = t_draft / t_target = {single['c']:.3f}; sampled-draft wire "
            f"bytes per round at K={single['sampled_k']}: {single['wire_sampled']:.0f}\n\n")


def sweep_line(sweep: dict, ratios: dict, n: int) -> str:
    return (f"| {n} | " + " | ".join(f"{sweep[name][n]['tokens_per_s']:.1f}" for name in SWEEP_NAMES) + " | "
            + " | ".join(f"{ratios[key][n]:.2f}" for key in SWEEP_RATIOS) + " | "
            + " / ".join(f"{sweep[name][n]['target_passes_per_token']:.3f}" for name in SWEEP_NAMES[:3]) + " | "
            + " / ".join(f"{sweep[name][n]['target_mean_batch']:.2f}" for name in SWEEP_NAMES[:3]) + " | "
            + " / ".join(f"{sweep[name][n]['target_busy']:.2f}" if "target_busy" in sweep[name][n] else "-"
                         for name in SWEEP_NAMES[:3]) + " |")


def sweep_markdown(results: dict) -> str:
    sweep, ratios = results["sweep"], results["ratios"]
    lines = ["| streams | " + " | ".join(f"{name} tokens/s" for name in SWEEP_NAMES) + " | " + " | ".join(SWEEP_RATIOS)
             + " | target passes/token (adaptive on / off / K=0) | mean target batch (adaptive on / off / K=0)"
             + " | target busy (adaptive on / off / K=0) |",
             "|---" * (len(SWEEP_NAMES) + len(SWEEP_RATIOS) + 4) + "|"]
    lines += [sweep_line(sweep, ratios, n) for n in sweep[ON_ADAPTIVE]]
    return ("\n".join(lines) + "\n\n" + "\n".join(f"- {line}" for line in results["goals"])
            + f"\n\nbatching config: {json.dumps(results['batching'])}\n")


OVERLAP_HEADER = ("| row | tokens/s | α | tokens/round | pre-draft hits/round | staged/round | efficiency "
                  "| client's wait p99 ms | ms per round: " + " / ".join(PARTS) + " |\n|---|---|---|---|---|---|---|---|---|\n")


def overlap_line(name: str, r: dict) -> str:
    parts = " / ".join(f"{r['parts_ms'][part]:.2f}" for part in PARTS)
    return (f"| {name} | {r['tokens_per_s']:.1f} | {r['alpha']:.2f} | {r['mean_accepted_len']:.2f} | {r['hits']:.2f} "
            f"| {r['staged']:.2f} | {r['efficiency']:.2f} | {r['wait_p99_ms']:.1f} | {parts} |")


def overlap_markdown(title: str, section: dict) -> str:
    """One pair's transformers rows, overlap rows with their round breakdown, and the goal ratios."""
    hf = "\n".join(f"| {name} | {r['tokens_per_s']:.1f} | | | | | | {r['wait_p99_ms']:.1f} | |"
                   for name, r in section["transformers"].items())
    rows = "\n".join(overlap_line(name, r) for name, r in section["rows"].items())
    ranges = section.get("ratio_ranges", {})
    ratios = "\n".join(f"- {key}: {value:.2f}" + (f" ({ranges[key][0]:.2f}-{ranges[key][1]:.2f} over the repeats)"
                                                   if key in ranges else "")
                        for key, value in section["ratios"].items())
    return f"### {title} (c = {section['c']:.3f})\n\n{OVERLAP_HEADER}{hf}\n{rows}\n\n{ratios}\n\n"


def markdown(results: dict) -> str:
    overlap = "".join(overlap_markdown(title, results[key]) for key, title in
                      (("overlap", "Overlap and hop: demo pair"), ("heavy", "Overlap and hop: heavy pair"))
                      if key in results)
    lookup = f"\n## Prompt lookup (draft.method)\n\n{lookup_markdown(results['lookup'])}\n" if "lookup" in results else ""
    prefix = "".join(f"\n## Prefix caching: {pair}\n\n{prefix_markdown(section)}\n"
                     for pair, section in results.get("prefix", {}).items())
    return (single_markdown(results["single"]) if "single" in results else "") + overlap + lookup + prefix \
        + sweep_markdown(results)


# ---- plots ------------------------------------------------------------------------------------
def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def concurrency_plot(sweep: dict, out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, variant in sweep.items():
        ax.plot(list(variant), [level["tokens_per_s"] for level in variant.values()], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sweep[ON_ADAPTIVE]), [str(n) for n in sweep[ON_ADAPTIVE]])
    ax.set(xlabel="concurrent streams", ylabel="aggregate tokens/s", title="specpool throughput vs concurrency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=120)


def speedup_plot(single: dict, out: Path) -> None:
    plt = pyplot()
    rows = {n: r for n, r in single["rows"].items() if n.startswith("specpool K=")}
    ks = [r["k"] for r in rows.values()]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ks, [r["speedup"] for r in rows.values()], "o-", label="measured")
    ax.plot(ks, [r["analytic"] for r in rows.values()], "s--", label="analytic (measured α, c)")
    ax.set(xlabel="K", ylabel="speedup over transformers generate()", title="specpool speedup vs K")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)


def adaptive_plot(trace: dict, out: Path) -> None:
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.step(range(len(trace["k"])), trace["k"], where="post")
    top.set(ylabel="K")
    drafting = [(i, k, accepted) for i, (k, accepted) in enumerate(zip(trace["k"], trace["accepted"])) if k]
    windows = [drafting[max(0, j - TRACE_WINDOW + 1):j + 1] for j in range(len(drafting))]
    rolling = [sum(a for _, _, a in w) / sum(k for _, k, _ in w) for w in windows]
    bottom.plot([i for i, _, _ in drafting], rolling, marker=".")
    bottom.set(xlabel="round", ylabel=f"acceptance (last {TRACE_WINDOW} drafting rounds)", ylim=(0, 1.05))
    top.set_title("adaptive K over predictable → unpredictable → predictable prompts")
    fig.tight_layout()
    fig.savefig(out / "adaptive.png", dpi=120)


def write_outputs(results: dict, trace: dict | None, out: Path) -> None:
    """Everything under `out` (created if missing); the markdown also goes to stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown(results))
    concurrency_plot(results["sweep"], out)
    if trace is not None:
        speedup_plot(results["single"], out)
        adaptive_plot(trace, out)
    print(markdown(results))
