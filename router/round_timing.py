"""Where a round's wall time went: each worker call split into its compute, its worker side (queue, thread hop) and
its transport, from the workers' compute_us and handler_us stamps; the parts the benchmarks print (PARTS)."""
from __future__ import annotations

import time

from protos.specpool.v1 import worker_pb2
from router.controller import RoundTimings
from router.request_state import Proposal


def split_time(started: float, response, staged: bool = False) -> tuple[float, float, float]:
    """split_wall of a call sent at `started` and answered now; a `staged` call was sent before that, and the
    target started it by itself: its compute is kept whole (it may outlast the round's wall time), the rest of
    the round is transport, and its handler's time (mostly the wait for the verdict it followed) is nobody's."""
    if staged:
        compute = response.compute_us / 1e6
        return compute, max(time.perf_counter() - started - compute, 0.0), 0.0
    return split_wall(time.perf_counter() - started, response)


def split_wall(wall: float, response) -> tuple[float, float, float]:
    """(worker compute, the rest of `wall`, the part of that rest spent inside the worker's handler: queue and
    thread hop) in seconds, from the worker's compute_us and handler_us stamps."""
    compute = min(response.compute_us / 1e6, wall)
    handler = min(max(response.handler_us / 1e6, compute), wall)
    return compute, wall - compute, handler - compute


PARTS = ("draft_compute", "draft_worker", "draft_transport", "verify_compute", "verify_worker", "verify_transport",
         "predraft_wait", "router")


def round_parts(wall: float, proposal: Proposal, ready: bool, timings: RoundTimings, verify_worker: float,
                predraft_wait: float) -> dict:
    """Where a round's wall time went: each call on the critical path split into compute, worker-side
    overhead (queue, thread hop) and transport (serialisation, network, both gRPC stacks); the wait for a
    matching pre-draft; and the router's own work (the rest)."""
    draft = draft_parts(proposal, ready)
    waited = max(wall - sum(draft) - timings.rtt_seconds - predraft_wait, 0.0)   # a staged verify began earlier
    verify = (min(timings.verify_seconds, waited), verify_worker, timings.rtt_seconds - verify_worker)
    known = dict(zip(PARTS, (*draft, *verify, predraft_wait)))
    return {**known, "router": max(wall - sum(known.values()), 0.0)}


def split_handed(proposal: Proposal, verdict: worker_pb2.VerifyResponse) -> tuple[float, float, float]:
    """split_time of a handed-off call: its compute; the rest of its own round trip (transport, and its worker side
    less the wait for the handoff); that worker side. Also sets the proposal's handoff_wait, the drafts' part of the
    round (router -> draft, drafting, draft -> target, less router -> target), and its rtt_seconds, that wait less
    the draft's compute. Where the call reached the target after the draft began (this machine's contention), the
    drafting before it is hidden behind the call's way there, and rtt_seconds is negative: the K controller's
    draft path (draft compute + rtt_seconds) is then the wait, as the round's critical path paid it, and never counts
    the hidden drafting twice."""
    compute = verdict.compute_us / 1e6
    handler = max(verdict.handler_us / 1e6, compute)
    wait = proposal.handoff_wait = min(verdict.handoff_wait_us / 1e6, handler - compute)
    worker = handler - wait - compute
    proposal.rtt_seconds = wait - proposal.seconds
    return compute, max(time.perf_counter() - proposal.handed_at - handler, 0.0) + worker, worker


def draft_parts(proposal: Proposal, ready: bool) -> tuple[float, float, float]:
    """(compute, worker side, transport) of the round's draft call on its critical path: none for drafts that were
    ready; of a handed-off call, what its wait on the target for the drafts covered (drafting while the call was on
    its way to the target was off the critical path)."""
    if ready:
        return 0.0, 0.0, 0.0
    if proposal.handoff_wait is not None:
        compute = min(proposal.seconds, proposal.handoff_wait)
        worker = min(proposal.worker_seconds, proposal.handoff_wait - compute)
        return compute, worker, proposal.handoff_wait - compute - worker
    return proposal.seconds, proposal.worker_seconds, proposal.rtt_seconds - proposal.worker_seconds
