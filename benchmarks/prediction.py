"""Predicted Outputs (GenerateRequest.prediction, OpenAI's `prediction`): the same requests with and without a
prediction, and transformers beside them, greedy, one request at a time, side by side in one service.

The workload stands in for editing a file: each prompt is a Python seed P (benchmarks/lookup.py's seeds), and the
file is the target's own greedy continuation F of P (max_new_tokens tokens), so the output of every request is F.
The rows differ only in what the request predicts:
- "exact": F itself (the part of a file an edit leaves alone);
- "edited": F with a span of EDIT_TOKENS tokens in its middle replaced, as a file predicted before an edit that
  the output then makes (the output leaves the prediction there and must find its way back into it);
- "renamed": F with RENAMED single tokens replaced, spread evenly, as a name changed in a few places (each a token
  the output changes alone, which the lookup steps over);
- "shuffled": F's tokens in a random order (a prediction with nothing to copy but chance n-grams: the cost of
  a useless one; another seed's file would help, the tiny pair writing much alike);
- "shuffled, never dropped": the same with draft.prediction_trial_rounds 0 (hot-reloaded for the row), so that
  the trial that drops a useless prediction (router/prediction.py, PredictionTrial) is measured against none;
- "none": no prediction (the adaptive policy as usual);
"predictions dropped" is the share of a row's requests whose prediction its trial dropped;
and transformers generate() and its prompt lookup (which has no prediction to copy from) run on the same prompts.
Repeats are interleaved, the specpool rows in reverse order every other repeat; tokens/s is the median over
repeats and a ratio the median of the two rows' ratios repeat by repeat (with their range).

    python -m benchmarks.prediction --config deploy/local.yaml --out benchmarks/results
    python -m benchmarks.prediction --heavy-layers 40     # the heavy pair too (tools/heavy_pair.py)
"""
from __future__ import annotations

import random
import statistics

from benchmarks.hf_baseline import hf_run, load_hf
from benchmarks.lookup import SEEDS, HF_LOOKUP, HF_PLAIN
from benchmarks.overlap import heavy_config
from benchmarks.plan import BenchConfig
from benchmarks.repeats import paired
from benchmarks.sections import pair_arguments, ratio_lines, write_sections
from benchmarks.service import load_service_config, log, reload_section, running_data, stream_one

EDIT_TOKENS = 8
RENAMED = 4
NEVER_DROPPED = "shuffled, never dropped"
PREDICTIONS = ("none", "exact", "edited", "renamed", "shuffled", NEVER_DROPPED)


def files(target, tokenizer, seeds: list[str], tokens: int) -> list[list[int]]:
    """Per seed, the target's greedy continuation of it (token IDs)."""
    out = []
    for seed in seeds:
        ids = tokenizer(seed, return_tensors="pt").input_ids
        out.append(target.generate(ids, max_new_tokens=tokens, do_sample=False)[0, ids.shape[1]:].tolist())
    return out


def predictions(tokenizer, continuations: list[list[int]]) -> dict[str, list[str]]:
    """Each row's prediction text per prompt ("" for none)."""
    def edited(ids: list[int]) -> list[int]:
        middle = len(ids) // 2
        return ids[:middle] + [(t + 7) % tokenizer.vocab_size for t in ids[middle:middle + EDIT_TOKENS]] + \
            ids[middle + EDIT_TOKENS:]
    def renamed(ids: list[int]) -> list[int]:
        places = {len(ids) * (i + 1) // (RENAMED + 1) for i in range(RENAMED)}
        return [(t + 7) % tokenizer.vocab_size if i in places else t for i, t in enumerate(ids)]
    texts = {"none": [""] * len(continuations), "exact": [tokenizer.decode(ids) for ids in continuations],
             "edited": [tokenizer.decode(edited(ids)) for ids in continuations],
             "renamed": [tokenizer.decode(renamed(ids)) for ids in continuations]}
    texts["shuffled"] = texts[NEVER_DROPPED] = [tokenizer.decode(random.Random(0).sample(ids, len(ids)))
                                                for ids in continuations]
    return texts


def predicted_run(stub, prompts: list[str], max_new: int, predicted: list[str]) -> dict:
    """One pass over the prompts at the adaptive policy, each streamed with its prediction."""
    runs = [stream_one(stub, p, max_new, None, 0.0, text) for p, text in zip(prompts, predicted)]
    return {"requests": len(runs), **{key: sum(r[key] for r in runs) for key in ("tokens", "seconds", "rounds",
                                                                                "accepted_prediction",
                                                                                "prediction_dropped")}}


def predicted_row(service, name: str, prompts: list[str], max_new: int, predicted: list[str]) -> dict:
    """predicted_run for the row `name`; the never-dropped row with draft.prediction_trial_rounds 0 for its
    duration."""
    if name != NEVER_DROPPED:
        return service.client(predicted_run, prompts, max_new, predicted)
    trial = service.service.config.draft.prediction_trial_rounds
    reload_section(service, "draft", prediction_trial_rounds=0)
    try:
        return service.client(predicted_run, prompts, max_new, predicted)
    finally:
        reload_section(service, "draft", prediction_trial_rounds=trial)


def summary(runs: list[dict]) -> dict:
    rates = [r["tokens"] / r["seconds"] for r in runs]
    out = {"tokens_per_s": statistics.median(rates), "rates": rates}
    if "rounds" in runs[0]:
        total = {key: sum(r[key] for r in runs) for key in runs[0]}
        out.update(tokens_per_pass=total["tokens"] / total["rounds"],
                   accepted_prediction_share=total["accepted_prediction"] / total["tokens"],
                   dropped_share=total["prediction_dropped"] / total["requests"])
    return out


def section(service, cfg: BenchConfig, seeds: list[str]) -> dict:
    """Every row, repeats interleaved, and the ratios."""
    target, tokenizer = load_hf(service.service.pools.target_info["model_path"])
    texts = predictions(tokenizer, files(target, tokenizer, seeds, cfg.max_new_tokens))
    draft = service.service.config.draft
    lookup = {"prompt_lookup_num_tokens": draft.ngram_max_tokens, "max_matching_ngram_size": draft.ngram_max}
    runs = {name: [] for name in (HF_PLAIN, HF_LOOKUP, *PREDICTIONS)}
    for repeat in range(cfg.repeats):
        for name, extra in ((HF_PLAIN, {}), (HF_LOOKUP, {"generate_kwargs": lookup})):
            seconds, tokens = hf_run(target, tokenizer, [[s] for s in seeds], cfg.max_new_tokens, **extra)
            runs[name].append({"tokens": tokens, "seconds": seconds})
        for name in PREDICTIONS if repeat % 2 == 0 else PREDICTIONS[::-1]:
            runs[name].append(predicted_row(service, name, seeds, cfg.max_new_tokens, texts[name]))
        log(f"repeat {repeat + 1}: " + ", ".join(f"{n} {r[-1]['tokens'] / r[-1]['seconds']:.0f}"
                                                   for n, r in runs.items()))
    rows = {name: summary(r) for name, r in runs.items()}
    baseline = max((HF_PLAIN, HF_LOOKUP), key=lambda name: rows[name]["tokens_per_s"])
    ratios = {f"{name} / none": paired(rows[name], rows["none"]) for name in PREDICTIONS[1:]}
    ratios.update({f"{name} / {baseline}": paired(rows[name], rows[baseline]) for name in ("exact", "edited",
                                                                                             "renamed")})
    ratios[f"shuffled / {NEVER_DROPPED}"] = paired(rows["shuffled"], rows[NEVER_DROPPED])
    return {"rows": rows, "ratios": ratios}


def markdown(section: dict) -> str:
    lines = ["| row | tokens/s | tokens per target pass | output tokens from the prediction | predictions dropped |",
             "|---|---|---|---|---|"]
    for name, row in section["rows"].items():
        extra = (f"{row['tokens_per_pass']:.2f} | {100 * row['accepted_prediction_share']:.0f} % | "
                 f"{100 * row['dropped_share']:.0f} %" if "tokens_per_pass" in row else " | | ")
        lines.append(f"| {'specpool, prediction ' + name if name in PREDICTIONS else name} | "
                     f"{row['tokens_per_s']:.1f} | {extra} |")
    lines += ratio_lines(section["ratios"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = pair_arguments(__doc__.splitlines()[0], max_new_tokens=192, repeats=5).parse_args(argv)
    import torch
    torch.set_num_threads(1)
    cfg = BenchConfig(config=args.config, out=args.out, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    data, sections = load_service_config(cfg.config), {}
    pairs = [("demo pair", data)] + ([("heavy pair", heavy_config(data, args.heavy_layers))] if args.heavy_layers
                                     else [])
    try:
        for name, pair in pairs:
            with running_data(pair, label=name) as service:
                sections[name] = section(service, cfg, SEEDS)
    finally:
        import ray
        ray.shutdown()
    write_sections(cfg, "prediction", sections, markdown)


if __name__ == "__main__":
    main()
