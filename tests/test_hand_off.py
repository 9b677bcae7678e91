"""Handed-off rounds (speculation.hand_off, engine/handoff.py): the draft worker hands its drafts straight to the
target, whose verify call waits there for them. Real draft and target servicers over gRPC on 127.0.0.1, no Ray:
the output stays the target's own (greedy, and seeded sampled with the draft's hidden states), the draft's own
handoff is what the target verifies (the router's copy only stands in when it never arrives), a draft worker that
goes away withdraws the waiting call, a target that lost the session takes the handoff again when the call is
repeated from position 0, and the target's waiting room keeps the first copy of each handoff."""
import asyncio
import random
import time

import grpc

from engine.handoff import HandoffStream, WaitingRoom
from protos.specpool.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from router.controller import KController, RoundTimings
from router.request_state import Proposal
from router.round_timing import draft_parts, split_handed
from tests.test_controller import sequential
from tests.test_overlap import FixedK
from tests.test_staged_rounds import serve_loop, unary_verify

PROMPT = [5, 9, 14, 200, 3, 77]


def handoff(session_id: int, handoff_id: int, drafts: list[int]) -> worker_pb2.DraftHandoff:
    return worker_pb2.DraftHandoff(session_id=session_id, handoff_id=handoff_id, draft_token_ids=drafts)


def test_handed_off_rounds_give_the_targets_greedy_output(demo_engines):
    """Every model round drafted on the critical path is handed off (stats.handed_off_rounds), and the tokens are
    the target's own greedy tokens: the same as with the drafts going through the router, and as plain decoding."""
    draft_engine, target_engine = demo_engines
    policy = FixedK(4, False, hand_off=True)
    handed = asyncio.run(serve_loop(draft_engine, target_engine, policy, PROMPT, 40))
    through_router = asyncio.run(serve_loop(draft_engine, target_engine, FixedK(4, False), PROMPT, 40))
    plain = asyncio.run(serve_loop(draft_engine, target_engine, FixedK(0, False), PROMPT, 40))
    assert handed.tokens == through_router.tokens == plain.tokens
    drafted_now = sum(1 for r in policy.rounds if r.k)
    assert handed.stats.handed_off_rounds > 0
    assert handed.stats.handed_off_rounds + handed.stats.handoffs_from_router == drafted_now
    for r in (r for r in policy.rounds if r.handed):   # a handed-off round's time, part by part: the verify's compute
        assert r.parts["verify_compute"] == r.timings.verify_seconds > 0      # whole, the drafts' part what the
        assert r.parts["draft_compute"] <= r.timings.draft_seconds            # call waited for on the target
    assert through_router.stats.handed_off_rounds == 0


def test_overlapped_rounds_that_pre_draft_beside_their_verify_are_not_handed_off(demo_engines):
    """With overlap on, a round drafted on the critical path pre-drafts the next one beside its verify; the
    pre-draft goes out when the draft's answer reaches the router, so handing the drafts off would start the verify
    sooner and leave the pre-draft less time: such rounds go through the router, and the tokens are the target's."""
    draft_engine, target_engine = demo_engines
    policy = FixedK(4, True, 3, stage=True, hand_off=True)
    handed = asyncio.run(serve_loop(draft_engine, target_engine, policy, PROMPT, 40))
    plain = asyncio.run(serve_loop(draft_engine, target_engine, FixedK(0, False), PROMPT, 40))
    assert handed.tokens == plain.tokens
    assert any(r.k and not r.predrafted and r.predraft_sent for r in policy.rounds)
    assert handed.stats.handed_off_rounds == handed.stats.handoffs_from_router == 0


def test_a_seeded_sampled_request_draws_the_same_tokens_handed_off_or_not(demo_engines):
    """Sampled-draft mode: the handoff carries the draft's hidden states, from which the target recomputes q, so a
    seeded request's tokens are the same whether the drafts went through the router or straight to the target."""
    draft_engine, target_engine = demo_engines
    sampling = generation_pb2.SamplingParams(temperature=0.9, top_p=1.0, seed=5)
    runs = [asyncio.run(serve_loop(draft_engine, target_engine, FixedK(3, False, hand_off=hand), PROMPT, 32,
                                   sampling=sampling, mode=worker_pb2.DRAFT_MODE_SAMPLED))
            for hand in (True, False)]
    assert runs[0].tokens == runs[1].tokens and runs[0].stats.handed_off_rounds > 0
    assert runs[0].stats.draft_tokens > runs[0].stats.accepted_tokens          # some drafts were rejected


def test_the_target_verifies_the_drafts_the_draft_worker_handed_it_with_no_copy_from_the_router(demo_engines):
    """A handed-off call waits on the target; the draft worker's Propose with hand_to answers the router and hands
    its drafts to the target itself, and the waiting call verifies exactly those drafts (the same verdict as a
    call carrying them), with nothing sent by the router."""
    from draft_worker.server import DraftServicer
    from engine.worker_server import start_server
    from router.worker_client import DraftClient, TargetClient
    from target_worker.server import TargetServicer
    draft_engine, target_engine = demo_engines
    start = {"sampling": generation_pb2.SamplingParams(top_p=1.0)}     # the session start's fields

    async def scenario():
        draft_server, draft_address = await start_server(worker_pb2_grpc.add_DraftWorkerServicer_to_server,
                                                         DraftServicer(draft_engine), "127.0.0.1")
        target_server, target_address = await start_server(worker_pb2_grpc.add_TargetWorkerServicer_to_server,
                                                            TargetServicer(target_engine, 1), "127.0.0.1")
        draft, target = DraftClient(draft_address), TargetClient(target_address)
        try:
            waiting = asyncio.ensure_future(target.verify(31, PROMPT, 0, [], b"", start, 10.0, handoff_id=77))
            proposal, _ = await draft.propose(31, PROMPT, 0, 4, start, worker_pb2.DRAFT_MODE_GREEDY, 10.0,
                                              hand_to=(target_address, 77))
            handed, _ = await asyncio.wait_for(waiting, 10.0)
            carried, _ = await target.verify(32, PROMPT, 0, list(proposal.draft_token_ids), b"", start, 10.0)
        finally:
            for client in (draft, target):
                await client.close()
            for server in (draft_server, target_server):
                await server.stop(None)
        return proposal, handed, carried
    proposal, handed, carried = asyncio.run(scenario())
    assert len(proposal.draft_token_ids) == 4
    assert (handed.num_accepted, handed.next_token_id) == (carried.num_accepted, carried.next_token_id)


def test_the_routers_copy_stands_in_when_the_drafts_handoff_never_arrives(demo_engines):
    """A draft worker whose connection to the target fails (here: it dials a port nobody serves) cannot hand its
    drafts over; the router's copy, sent when the draft's answer reaches it, lets every round go on, and the tokens
    are still the target's."""
    draft_engine, target_engine = demo_engines
    policy = FixedK(4, False, hand_off=True)
    handed = asyncio.run(serve_loop(draft_engine, target_engine, policy, PROMPT, 24,
                                    draft_channel=lambda _: grpc.aio.insecure_channel("127.0.0.1:1")))
    plain = asyncio.run(serve_loop(draft_engine, target_engine, FixedK(0, False), PROMPT, 24))
    assert handed.tokens == plain.tokens
    assert handed.stats.handed_off_rounds == 0 and handed.stats.handoffs_from_router == sum(
        1 for r in policy.rounds if r.k)


def test_a_draft_worker_that_goes_away_withdraws_the_waiting_call_and_the_request_goes_on(demo_engines):
    """The draft server stops after a few rounds: the next handed-off round's draft call fails, its waiting verify
    call is withdrawn (the target is left with nothing waiting), and the request finishes by plain decoding with
    the target's tokens."""
    draft_engine, target_engine = demo_engines
    policy = FixedK(4, False, hand_off=True)
    handed = asyncio.run(serve_loop(draft_engine, target_engine, policy, PROMPT, 40, stop_draft_after=3))
    plain = asyncio.run(serve_loop(draft_engine, target_engine, FixedK(0, False), PROMPT, 40))
    assert handed.tokens == plain.tokens
    assert 0 < handed.stats.handed_off_rounds <= 3 and policy.rounds[-1].k == 0
    assert handed.waiting_on_target == 0


def test_a_call_repeated_from_position_zero_takes_its_handoff_again(demo_engines):
    """The target does not hold the session the router thinks it holds (NOT_FOUND): the router repeats the call
    from position 0 with the same handoff id, and the handoff, already in, is verified then."""
    from engine.worker_server import start_server
    from router.worker_client import TargetClient
    from target_worker.server import TargetServicer
    _, target_engine = demo_engines
    start = {"sampling": generation_pb2.SamplingParams(top_p=1.0)}     # the session start's fields

    async def scenario():
        server, address = await start_server(worker_pb2_grpc.add_TargetWorkerServicer_to_server,
                                             TargetServicer(target_engine, 1), "127.0.0.1")
        target = TargetClient(address)
        try:
            target.handoffs.send(handoff(41, 5, [14, 200]))
            handed, _ = await target.verify(41, PROMPT, 3, [], b"", start, 10.0, handoff_id=5)   # "holds 3"
            carried, _ = await target.verify(42, PROMPT, 0, [14, 200], b"", start, 10.0)
        finally:
            await target.close()
            await server.stop(None)
        return handed, carried
    handed, carried = asyncio.run(scenario())
    assert (handed.num_accepted, handed.next_token_id) == (carried.num_accepted, carried.next_token_id)


def test_a_handed_off_call_on_unary_verify_is_refused_naming_the_field(demo_engines):
    """It waits for drafts that come on another call, which only a stream's call can: INVALID_ARGUMENT naming
    `handoff_id`, and the target keeps serving."""
    _, target_engine = demo_engines
    request = worker_pb2.VerifyRequest(session_id=51, new_token_ids=PROMPT, handoff_id=3,
                                       sampling=generation_pb2.SamplingParams(top_p=1.0))
    plain = worker_pb2.VerifyRequest()
    plain.CopyFrom(request)
    plain.handoff_id = 0
    refused, served = asyncio.run(unary_verify(target_engine, request, plain))
    assert refused is not None
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.details().startswith("handoff_id:")
    assert served.compute_us > 0


def test_the_waiting_room_keeps_the_first_copy_and_drops_late_ones():
    async def scenario():
        room = WaitingRoom(capacity=2)
        waiting = asyncio.ensure_future(room.take((1, 1)))
        await asyncio.sleep(0)
        room.put(handoff(1, 1, [4]))
        room.put(handoff(1, 1, [9]))                      # a second copy: dropped
        first = await waiting
        again = await room.take((1, 1))                   # taken again (a call repeated from position 0)
        room.done((1, 1))
        room.put(handoff(1, 1, [7]))                      # a copy after the call is over: dropped, not kept
        for i in range(2, 6):                             # handoffs nobody takes: only `capacity` are kept
            room.put(handoff(1, i, [i]))
        return first, again, room
    first, again, room = asyncio.run(scenario())
    assert list(first.draft_token_ids) == [4] and again is first
    assert (1, 1) not in room._handoffs and sorted(room._handoffs) == [(1, 4), (1, 5)]


def test_the_waiting_room_forgets_an_unclaimed_handoff_once_it_is_old_but_never_one_a_call_waits_for():
    now = [0.0]

    async def scenario():
        room = WaitingRoom(capacity=8, max_age_s=60.0, clock=lambda: now[0])
        waiting = asyncio.ensure_future(room.take((2, 1)))     # a call waiting since t = 0
        await asyncio.sleep(0)
        room.put(handoff(2, 2, [1]))                            # a copy nobody will take (its call was withdrawn)
        now[0] = 61.0
        room.put(handoff(2, 3, [2]))                            # the next arrival: the old unclaimed one goes
        kept = sorted(room._handoffs)
        room.put(handoff(2, 1, [3]))
        return kept, await waiting
    kept, taken = asyncio.run(scenario())
    assert kept == [(2, 1), (2, 3)] and list(taken.draft_token_ids) == [3]


def test_a_handoff_stream_opens_again_after_its_call_ends_and_loses_nothing_queued_after():
    """The call under a HandoffStream ends (here the target aborts it at handoff 2, as a restarting target would):
    the next send opens a new call, and every handoff sent after the end arrives. grpc.aio leaves the ended
    call's request iterator waiting; it must not take the next handoff and drop it."""
    class Target(worker_pb2_grpc.TargetWorkerServicer):
        def __init__(self):
            self.got = []

        async def HandDrafts(self, handoffs, context):
            async for h in handoffs:
                self.got.append(h.handoff_id)
                if h.handoff_id == 2:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
            return worker_pb2.HandoffAck()

    async def scenario():
        target, server = Target(), grpc.aio.server()
        worker_pb2_grpc.add_TargetWorkerServicer_to_server(target, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stream = HandoffStream(worker_pb2_grpc.TargetWorkerStub(channel).HandDrafts)
        try:
            for i in (1, 2):
                stream.send(handoff(1, i, []))
            for _ in range(100):
                await asyncio.sleep(0.01)
                if stream._task.done():
                    break
            for i in (3, 4, 5):
                stream.send(handoff(1, i, []))
                await asyncio.sleep(0.05)
        finally:
            stream.close()
            await channel.close()
            await server.stop(None)
        return target.got
    assert asyncio.run(scenario()) == [1, 2, 3, 4, 5]


def test_drafting_hidden_behind_the_verify_calls_way_is_counted_once_in_the_k_controllers_draft_path():
    """A handed-off call that reached the target 4 ms after the 6 ms of drafting began waited 2 ms there for the
    drafts: the round's critical path paid 2 ms for drafting, not 6, and so does the controller's draft path."""
    loop = asyncio.new_event_loop()
    proposal = Proposal([7, 8, 9], seconds=0.006, worker_seconds=0.0005,
                        handed_at=time.perf_counter() - 0.020, staged=loop.create_future())    # the waiting call
    loop.close()
    verdict = worker_pb2.VerifyResponse(compute_us=10_000, handler_us=13_000, handoff_wait_us=2_000)
    compute, _, _ = split_handed(proposal, verdict)
    assert compute == 0.010 and proposal.handoff_wait == 0.002
    assert sum(draft_parts(proposal, ready=False)) == 0.002
    controller = KController(sequential(k=3, k_max=8), random.Random(0))
    for _ in range(40):
        controller.observe(3, 0, RoundTimings(draft_seconds=proposal.seconds, draft_rtt_seconds=proposal.rtt_seconds,
                                              verify_seconds=compute, rtt_seconds=0.001))
    costs = controller.costs()
    draft_path = costs["draft_fixed"] + 3 * costs["t_draft"] + costs["rtt_draft"]
    assert abs(draft_path - 0.002) < 1e-9, draft_path
