"""The router's loop in miniature, over a draft and a target engine in this process (no gRPC, no Ray): for tests
of the engines on a device or in a dtype of their own, and for distribution tests, which run many seeds at once."""
from protos.specpool.v1 import worker_pb2

AT_ONCE = 128        # sessions in flight together (the engines hold 256)


def run_rounds(draft, target, prompt, k, max_new, sampling, mode, **session_start):
    """The router's loop in miniature: sync positions, propose (not at K = 0, plain decoding), verify, commit. The
    session start's fields (RequestState.session_start: sampling, prompt_length and any of `session_start`,
    min_tokens, grammar, bad_words) go with each engine's first call."""
    return runs_of_rounds(draft, target, prompt, k, max_new, [sampling], mode, **session_start)[0]


def runs_of_rounds(draft, target, prompt, k, max_new, samplings: list, mode, **session_start) -> list[list[int]]:
    """run_rounds for each of `samplings` (e.g. one per seed), AT_ONCE sessions in lockstep: each round's calls go to
    the engines as one batch (rows' draws depend on their seed and position only, not on the batch)."""
    outputs = []
    for first in range(0, len(samplings), AT_ONCE):
        outputs += _lockstep(draft, target, prompt, k, max_new, samplings[first:first + AT_ONCE], mode, session_start)
    return outputs


def _lockstep(draft, target, prompt, k, max_new, samplings: list, mode, session_start: dict) -> list[list[int]]:
    tokens = [list(prompt) for _ in samplings]
    draft_synced, target_synced = [0] * len(samplings), [0] * len(samplings)

    def start(i: int, synced: list) -> dict:
        return dict(sampling=samplings[i], prompt_length=len(prompt), **session_start) if synced[i] == 0 else {}
    while live := [i for i in range(len(samplings)) if len(tokens[i]) - len(prompt) < max_new]:
        proposals = _answers(draft.propose_batch([worker_pb2.ProposeRequest(
            session_id=i + 1, position=draft_synced[i], new_token_ids=tokens[i][draft_synced[i]:], k=k, mode=mode,
            **start(i, draft_synced)) for i in live])) if k else [worker_pb2.ProposeResponse()] * len(live)
        verdicts = _answers(target.verify_batch([worker_pb2.VerifyRequest(
            session_id=i + 1, position=target_synced[i], new_token_ids=tokens[i][target_synced[i]:],
            draft_token_ids=proposal.draft_token_ids, draft_hidden_states=proposal.draft_hidden_states,
            **start(i, target_synced)) for i, proposal in zip(live, proposals)]))
        for i, proposal, verdict in zip(live, proposals, verdicts):
            before, n = len(tokens[i]), verdict.num_accepted
            tokens[i] += list(proposal.draft_token_ids[:n]) + [verdict.next_token_id]
            draft_synced[i], target_synced[i] = before + min(n, k - 1), before + n
    return [row[len(prompt):len(prompt) + max_new] for row in tokens]


def _answers(results: list) -> list:
    """A batch's answers, raising the first error a row got."""
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def accepted_drafts(draft, target, prompt, start: dict, rounds: int, k: int) -> int:
    """Drafts the target accepts over `rounds` greedy rounds of K = k from `prompt`, each call a session start
    carrying `start` (sampling, prompt_length, ...): every one of them when the draft follows the target's rules."""
    tokens, accepted = list(prompt), 0
    for _ in range(rounds):
        drafts = list(draft.propose(worker_pb2.ProposeRequest(
            session_id=1, position=0, new_token_ids=tokens, k=k, mode=worker_pb2.DRAFT_MODE_GREEDY,
            **start)).draft_token_ids)
        verdict = target.verify(worker_pb2.VerifyRequest(session_id=1, position=0, new_token_ids=tokens,
                                                         draft_token_ids=drafts, **start))
        accepted += verdict.num_accepted
        tokens += drafts[:verdict.num_accepted] + [verdict.next_token_id]
    return accepted
