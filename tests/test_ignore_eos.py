"""ignore_eos (gRPC's GenerateRequest.ignore_eos, HTTP's vLLM-style `ignore_eos`, `specpool generate --ignore-eos`):
generation goes on past the model's EOS token to max_new_tokens or a stop token, in the target's decode runs too.
A real router and public server over a fake target (tests/fake_workers.py) whose every step answers EOS."""
from protos.specpool.v1 import generation_pb2
from tests.fake_workers import plain, run

EOS = 0                     # the fake model's


def test_eos_ends_a_request_unless_it_ignores_eos_and_a_stop_token_still_stops_it():
    async def body(service):
        service.target.token = EOS
        answers = []
        for ignore_eos, stop_ids in ((False, []), (True, []), (True, [EOS])):
            request = plain(max_new_tokens=6)
            request.ignore_eos = ignore_eos
            request.stop_token_ids.extend(stop_ids)
            service.target.stop_token_ids.clear()
            answer = await service.stub.Generate(request, timeout=30)
            answers.append((list(answer.token_ids), answer.finish_reason, service.target.stop_token_ids[:]))
        return answers
    (ended, ended_reason, ended_sent), (ignored, ignored_reason, ignored_sent), (stopped, stopped_reason, _) = \
        run(body)
    assert (ended, ended_reason) == ([EOS], generation_pb2.FINISH_REASON_EOS)
    assert (ignored, ignored_reason) == ([EOS] * 6, generation_pb2.FINISH_REASON_LENGTH)
    assert (stopped, stopped_reason) == ([EOS], generation_pb2.FINISH_REASON_STOP)
    assert all(EOS in ids for ids in ended_sent) and not any(EOS in ids for ids in ignored_sent)   # decode runs
