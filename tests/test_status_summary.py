"""`specpool status`'s summary (router/status_summary.py) from Admin.GetStatus's config and statistics: serving or
not, K and who chose it, acceptance per position, and one line per replica saying why one is out."""
from router.status_summary import FOOTER, summary

CONFIG = {"draft": {"method": "model+ngram", "prefix_cache_tokens": 8192}, "target": {"prefix_cache_tokens": 8192},
          "speculation": {"policy": "goodput", "draft_sampling": "greedy", "overlap": True}}


def stats(targets: list[dict], drafts: list[dict], samples=(12, 7, 0, 0)) -> dict:
    return {"k": 2, "k_from": "request 7", "active_requests": 3, "queued_requests": 1,
            "pools": {"model/greedy": {"acceptance": [0.75, 0.5, 0.5, 0.5], "samples": list(samples),
                                       "goodput_tokens_per_s": {"0": 338.2, "1": 301.0, "2": 350.4}},
                      "ngram/greedy": {"acceptance": [0.9, 0.5], "samples": [4, 0]},
                      "ngram/greedy/match 2": {"acceptance": [0.2], "samples": [9]}},
            "outstanding_sessions": {"target": [3] * len(targets), "draft": [2] * len(drafts)},
            "workers": {"target": targets, "draft": drafts},
            "prefix_cache": {"target": {"looked_up": 12345, "found": 4096}, "draft": {"looked_up": 0, "found": 0}},
            "delivered": {"greedy": {"both_tokens_per_s": 187.4, "both_rounds": 240.0,
                                     "lookup_alone_tokens_per_s": 234.9, "lookup_alone_rounds": 255.1,
                                     "new_requests": "lookup alone"},
                          "sampled": {"both_tokens_per_s": 90.0, "both_rounds": 12.0,
                                      "lookup_alone_tokens_per_s": None, "lookup_alone_rounds": 0.0,
                                      "new_requests": "lookup alone"}}}


READY = {"name": "target 0", "state": "ready", "address": "10.0.0.5:40001", "cpus": [0, 1, 2, 3]}


def test_a_serving_router_in_a_dozen_lines():
    text = summary(CONFIG, stats([READY], [{"name": "draft 0", "state": "loading", "address": ""}]))
    assert text.splitlines() == [
        "SERVING: 1 of 1 target replica(s) ready; 3 request(s) generating, 1 queued",
        "adaptive K 2, last chosen by request 7 (a request's own K stays its own); policy goodput, draft.method "
        "model+ngram, draft_sampling greedy, overlap on",
        "acceptance by draft position (recent drafts), model drafts, greedy: 0.75 (12) 0.50 (7)",
        "modelled tokens/s, model drafts, greedy: K=0 338, K=1 301, K=2 350 (best)",
        "acceptance by draft position (recent drafts), ngram drafts, greedy: 0.90 (4)",
        "model+ngram, greedy: both sources delivered 187 tokens/s, lookup alone 235: new requests draft from lookup "
        "alone",
        "prefix cache, context tokens found of those looked up at session starts: target 4,096 of 12,345 (33 %), "
        "draft 0 of 0",
        "workers:",
        "  target 0: ready at 10.0.0.5:40001 on CPU(s) 0-3, 3 session(s)",
        "  draft 0: loading",
        FOOTER]


def test_no_ready_target_reads_not_serving_and_says_why_each_worker_is_out():
    down = {"name": "target 0", "state": "down", "address": "10.0.0.5:40001", "down_since": "2026-11-25 16:00:00",
            "down_for_s": 12.5, "last_error": "UNAVAILABLE: Socket closed"}
    failed = {"name": "draft 0", "state": "failed", "address": "", "error": "OSError: no model folder"}
    verified_nothing = stats([down], [failed], samples=(0, 0, 0, 0))
    verified_nothing["pools"]["ngram/greedy"]["samples"] = [0, 0]
    lines = summary(CONFIG, verified_nothing).splitlines()
    assert lines[0] == "NOT_SERVING (no target replica is ready): 0 of 1 target replica(s) ready; 3 request(s) " \
                       "generating, 1 queued"
    assert lines[2] == "acceptance: no drafts verified yet"
    assert lines[6] == "  target 0: down for 12.5 s (since 2026-11-25 16:00:00): UNAVAILABLE: Socket closed"
    assert lines[7] == "  draft 0: failed to load, out of the pool until a restart: OSError: no model folder"


def test_a_draining_router_reads_not_serving_as_health_does():
    draining = {**stats([READY], []), "draining": True}
    assert summary(CONFIG, draining).splitlines()[0] == (
        "NOT_SERVING (shutting down: the requests in it drain, new ones are refused): 1 of 1 target replica(s) "
        "ready; 3 request(s) generating, 1 queued")


def test_the_prefix_cache_line_names_only_the_pools_that_keep_one():
    only_target = {**CONFIG, "draft": {"method": "ngram", "prefix_cache_tokens": 8192}}
    assert "prefix cache, context tokens found of those looked up at session starts: target 4,096 of 12,345 (33 %)" \
        in summary(only_target, stats([READY], [])).splitlines()
    off = {**CONFIG, "draft": {"method": "model", "prefix_cache_tokens": 0}, "target": {"prefix_cache_tokens": 0}}
    assert "prefix cache: off" in summary(off, stats([READY], [])).splitlines()
