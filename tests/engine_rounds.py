"""The router's loop in miniature, over a draft and a target engine in this process (no gRPC, no Ray): for tests
of the engines on a device or in a dtype of their own."""
from protos.specpool.v1 import worker_pb2


def run_rounds(draft, target, prompt, k, max_new, sampling, mode, **session_start):
    """The router's loop in miniature: sync positions, propose (not at K = 0, plain decoding), verify, commit. The
    session start's fields (RequestState.session_start: sampling, prompt_length and any of `session_start`,
    min_tokens, grammar, bad_words) go with each engine's first call."""
    tokens, draft_synced, target_synced = list(prompt), 0, 0
    start = dict(sampling=sampling, prompt_length=len(prompt), **session_start)
    while len(tokens) - len(prompt) < max_new:
        before = len(tokens)
        proposal = draft.propose(worker_pb2.ProposeRequest(
            session_id=1, position=draft_synced, new_token_ids=tokens[draft_synced:], k=k, mode=mode,
            **(start if draft_synced == 0 else {}))) if k else worker_pb2.ProposeResponse()
        drafts = list(proposal.draft_token_ids)
        verdict = target.verify(worker_pb2.VerifyRequest(
            session_id=1, position=target_synced, new_token_ids=tokens[target_synced:], draft_token_ids=drafts,
            draft_hidden_states=proposal.draft_hidden_states, **(start if target_synced == 0 else {})))
        n = verdict.num_accepted
        tokens += drafts[:n] + [verdict.next_token_id]
        draft_synced, target_synced = before + min(n, k - 1), before + n
    return tokens[len(prompt):len(prompt) + max_new]


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
