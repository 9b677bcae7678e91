"""The request log (router.log_requests, router/request_log.py): its line for a request that finished, for one that
failed mid-way and for one refused before it was admitted; and a reload may turn it on or off, unlike the rest of
the router section. The lines a served router writes are checked in tests/test_openai_http.py."""
import dataclasses
import types

import pytest

from protos.specpool.v1 import generation_pb2
from router.reload import RestartRequired, check_reloadable
from router.request_log import ClientRequest, request_line
from settings.schema import SpecpoolConfig


def state(prompt: int, new: int, finish=generation_pb2.FINISH_REASON_LENGTH, **stats) -> types.SimpleNamespace:
    return types.SimpleNamespace(tokens=[1] * (prompt + new), prompt_len=prompt, finish_reason=finish,
                                 stats=generation_pb2.GenerationStats(**stats))


def test_a_finished_request_says_its_tokens_rate_rounds_and_acceptance():
    request = ClientRequest("GenerateStream", "ipv4:127.0.0.1:5000", started=10.0, request_id="abc",
                            states=[state(7, 64, target_passes=21, k_per_round=[0, 4, 4, 4], draft_tokens=63,
                                          accepted_tokens=45)])
    assert request_line(request, "OK", now=10.5) == (
        "request abc GenerateStream from ipv4:127.0.0.1:5000: OK in 0.500 s, 7 prompt + 64 new tokens (length), "
        "128.0 tokens/s; 21 target passes, K 3.0 on average, 45 of 63 drafts accepted (0.71)")


def test_choices_are_summed_and_each_ones_end_is_named():
    request = ClientRequest("/v1/completions", started=0.0, request_id="r",
                            states=[state(5, 8), state(5, 3, generation_pb2.FINISH_REASON_EOS)])
    line = request_line(request, "OK", now=1.0)
    assert "2 choices, 5 prompt + 11 new tokens (length, eos), 11.0 tokens/s" in line
    assert "target pass" not in line                  # no round was run (the stats say none)


def test_a_batch_counts_each_prompt_once():
    """A batch of 2 prompts, n = 2: each prompt's tokens once, every choice's new tokens."""
    request = ClientRequest("/v1/completions", started=0.0, request_id="r", per_prompt=2,
                            states=[state(5, 1), state(5, 2), state(7, 3), state(7, 4)])
    assert "4 choices, 2 prompts, 12 prompt + 10 new tokens" in request_line(request, "OK", now=1.0)


def test_a_request_that_failed_mid_way_says_how_far_it_got_and_what_its_client_was_told():
    request = ClientRequest("Generate", started=0.0, request_id="r",
                            states=[state(5, 12, generation_pb2.FINISH_REASON_UNSPECIFIED, target_passes=1)])
    line = request_line(request, "UNAVAILABLE", "a worker failed: UNAVAILABLE: gone", now=2.0)
    assert line == ("request r Generate: UNAVAILABLE in 2.000 s, 5 prompt + 12 new tokens (unfinished); "
                    "1 target pass: a worker failed: UNAVAILABLE: gone")
    assert "tokens/s" not in line


def test_a_refused_request_has_no_id_and_says_why():
    line = request_line(ClientRequest("/v1/completions", "127.0.0.1:4000", started=0.0), "INVALID_ARGUMENT",
                        "max_tokens: must be >= 1", now=0.001)
    assert line == ("request - /v1/completions from 127.0.0.1:4000: INVALID_ARGUMENT in 0.001 s: "
                    "max_tokens: must be >= 1")


def test_a_reload_may_turn_the_request_log_on_but_no_other_router_key():
    old = SpecpoolConfig()
    on = dataclasses.replace(old, router=dataclasses.replace(old.router, log_requests=True))
    check_reloadable(old, on)
    check_reloadable(on, old)
    moved = dataclasses.replace(on, router=dataclasses.replace(on.router, max_active_requests=3))
    with pytest.raises(RestartRequired, match="router.max_active_requests"):
        check_reloadable(old, moved)


def test_a_clients_line_breaks_and_control_characters_are_escaped_so_the_line_stays_one():
    request = ClientRequest("Generate", started=0.0, request_id="evil\n2026-11-26 [specpool] stopped\x1b[2J")
    line = request_line(request, "INVALID_ARGUMENT", "model: 'a\u2028b' is not served", now=0.0)
    assert "\n" not in line and "\x1b" not in line and "\u2028" not in line
    assert line == ("request evil\\n2026-11-26 [specpool] stopped\\x1b[2J Generate: INVALID_ARGUMENT in 0.000 s: "
                    "model: 'a\\u2028b' is not served")
