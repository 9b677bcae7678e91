from protos.specpool.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_MODE_GREEDY: _ClassVar[DraftMode]
    DRAFT_MODE_SAMPLED: _ClassVar[DraftMode]
DRAFT_MODE_GREEDY: DraftMode
DRAFT_MODE_SAMPLED: DraftMode

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "position", "new_token_ids", "k", "sampling", "mode", "call_id", "cancel", "runner_ups", "branches", "hand_to", "handoff_id", "then", "prompt_length", "min_tokens", "grammar", "bad_words", "committed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UPS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    HAND_TO_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    THEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    position: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    k: int
    sampling: _generation_pb2.SamplingParams
    mode: DraftMode
    call_id: int
    cancel: bool
    runner_ups: bool
    branches: _containers.RepeatedCompositeFieldContainer[BranchPoint]
    hand_to: str
    handoff_id: int
    then: ChainedPredraft
    prompt_length: int
    min_tokens: MinTokens
    grammar: Grammar
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    committed: int
    def __init__(self, session_id: _Optional[int] = ..., position: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., mode: _Optional[_Union[DraftMode, str]] = ..., call_id: _Optional[int] = ..., cancel: _Optional[bool] = ..., runner_ups: _Optional[bool] = ..., branches: _Optional[_Iterable[_Union[BranchPoint, _Mapping]]] = ..., hand_to: _Optional[str] = ..., handoff_id: _Optional[int] = ..., then: _Optional[_Union[ChainedPredraft, _Mapping]] = ..., prompt_length: _Optional[int] = ..., min_tokens: _Optional[_Union[MinTokens, _Mapping]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., committed: _Optional[int] = ...) -> None: ...

class ChainedPredraft(_message.Message):
    __slots__ = ("k", "branch_at", "branch_rank")
    K_FIELD_NUMBER: _ClassVar[int]
    BRANCH_AT_FIELD_NUMBER: _ClassVar[int]
    BRANCH_RANK_FIELD_NUMBER: _ClassVar[int]
    k: int
    branch_at: _containers.RepeatedScalarFieldContainer[int]
    branch_rank: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, k: _Optional[int] = ..., branch_at: _Optional[_Iterable[int]] = ..., branch_rank: _Optional[_Iterable[int]] = ...) -> None: ...

class BranchPoint(_message.Message):
    __slots__ = ("at", "token_id")
    AT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    at: int
    token_id: int
    def __init__(self, at: _Optional[int] = ..., token_id: _Optional[int] = ...) -> None: ...

class BranchDrafts(_message.Message):
    __slots__ = ("token_ids", "hidden_states", "runner_up_token_ids", "third_choice_token_ids")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    THIRD_CHOICE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_states: bytes
    runner_up_token_ids: _containers.RepeatedScalarFieldContainer[int]
    third_choice_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., hidden_states: _Optional[bytes] = ..., runner_up_token_ids: _Optional[_Iterable[int]] = ..., third_choice_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("draft_token_ids", "draft_hidden_states", "compute_us", "batch_size", "handler_us", "call_id", "status", "runner_up_token_ids", "branch_drafts", "third_choice_token_ids", "prefix_cache", "more")
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    HANDLER_US_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    THIRD_CHOICE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_hidden_states: bytes
    compute_us: int
    batch_size: int
    handler_us: int
    call_id: int
    status: CallStatus
    runner_up_token_ids: _containers.RepeatedScalarFieldContainer[int]
    branch_drafts: _containers.RepeatedCompositeFieldContainer[BranchDrafts]
    third_choice_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_cache: _generation_pb2.PrefixCacheStats
    more: bool
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ..., draft_hidden_states: _Optional[bytes] = ..., compute_us: _Optional[int] = ..., batch_size: _Optional[int] = ..., handler_us: _Optional[int] = ..., call_id: _Optional[int] = ..., status: _Optional[_Union[CallStatus, _Mapping]] = ..., runner_up_token_ids: _Optional[_Iterable[int]] = ..., branch_drafts: _Optional[_Iterable[_Union[BranchDrafts, _Mapping]]] = ..., third_choice_token_ids: _Optional[_Iterable[int]] = ..., prefix_cache: _Optional[_Union[_generation_pb2.PrefixCacheStats, _Mapping]] = ..., more: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "position", "new_token_ids", "draft_token_ids", "draft_hidden_states", "sampling", "call_id", "cancel", "top_logprobs", "decode_steps", "stop_token_ids", "lookup", "answer_delay_us", "staged", "handoff_id", "prompt_length", "min_tokens", "grammar", "bad_words", "prompt_logprobs", "prediction_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    ANSWER_DELAY_US_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    position: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_hidden_states: bytes
    sampling: _generation_pb2.SamplingParams
    call_id: int
    cancel: bool
    top_logprobs: int
    decode_steps: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lookup: PromptLookup
    answer_delay_us: int
    staged: StagedRound
    handoff_id: int
    prompt_length: int
    min_tokens: MinTokens
    grammar: Grammar
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    prompt_logprobs: int
    prediction_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[int] = ..., position: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_hidden_states: _Optional[bytes] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., call_id: _Optional[int] = ..., cancel: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., decode_steps: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., lookup: _Optional[_Union[PromptLookup, _Mapping]] = ..., answer_delay_us: _Optional[int] = ..., staged: _Optional[_Union[StagedRound, _Mapping]] = ..., handoff_id: _Optional[int] = ..., prompt_length: _Optional[int] = ..., min_tokens: _Optional[_Union[MinTokens, _Mapping]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., prompt_logprobs: _Optional[int] = ..., prediction_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("llguidance", "eos_token_ids")
    LLGUIDANCE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    llguidance: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, llguidance: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MinTokens(_message.Message):
    __slots__ = ("count", "token_ids")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    count: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, count: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftHandoff(_message.Message):
    __slots__ = ("session_id", "handoff_id", "draft_token_ids", "draft_hidden_states", "from_router")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    FROM_ROUTER_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    handoff_id: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_hidden_states: bytes
    from_router: bool
    def __init__(self, session_id: _Optional[int] = ..., handoff_id: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_hidden_states: _Optional[bytes] = ..., from_router: _Optional[bool] = ...) -> None: ...

class HandoffAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StagedRound(_message.Message):
    __slots__ = ("candidates",)
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[StagedDrafts]
    def __init__(self, candidates: _Optional[_Iterable[_Union[StagedDrafts, _Mapping]]] = ...) -> None: ...

class StagedDrafts(_message.Message):
    __slots__ = ("num_accepted", "next_token_id", "draft_token_ids", "draft_hidden_states")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token_id: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_hidden_states: bytes
    def __init__(self, num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_hidden_states: _Optional[bytes] = ...) -> None: ...

class PromptLookup(_message.Message):
    __slots__ = ("min_n", "max_n", "max_tokens", "end_on_miss", "min_match", "max_tokens_by_match", "drop_prediction")
    MIN_N_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    END_ON_MISS_FIELD_NUMBER: _ClassVar[int]
    MIN_MATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_BY_MATCH_FIELD_NUMBER: _ClassVar[int]
    DROP_PREDICTION_FIELD_NUMBER: _ClassVar[int]
    min_n: int
    max_n: int
    max_tokens: int
    end_on_miss: bool
    min_match: int
    max_tokens_by_match: _containers.RepeatedScalarFieldContainer[int]
    drop_prediction: bool
    def __init__(self, min_n: _Optional[int] = ..., max_n: _Optional[int] = ..., max_tokens: _Optional[int] = ..., end_on_miss: _Optional[bool] = ..., min_match: _Optional[int] = ..., max_tokens_by_match: _Optional[_Iterable[int]] = ..., drop_prediction: _Optional[bool] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "next_token_id", "compute_us", "batch_size", "batch_tokens", "queue_depth", "handler_us", "call_id", "status", "logprobs", "more", "draft_token_ids", "missed", "earlier", "prefix_cache", "handoff_wait_us", "handoff_from_router", "prompt_logprobs")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    HANDLER_US_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MISSED_FIELD_NUMBER: _ClassVar[int]
    EARLIER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FROM_ROUTER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token_id: int
    compute_us: int
    batch_size: int
    batch_tokens: int
    queue_depth: int
    handler_us: int
    call_id: int
    status: CallStatus
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    more: bool
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    missed: bool
    earlier: _containers.RepeatedCompositeFieldContainer[VerifyResponse]
    prefix_cache: _generation_pb2.PrefixCacheStats
    handoff_wait_us: int
    handoff_from_router: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., compute_us: _Optional[int] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., queue_depth: _Optional[int] = ..., handler_us: _Optional[int] = ..., call_id: _Optional[int] = ..., status: _Optional[_Union[CallStatus, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., more: _Optional[bool] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., missed: _Optional[bool] = ..., earlier: _Optional[_Iterable[_Union[VerifyResponse, _Mapping]]] = ..., prefix_cache: _Optional[_Union[_generation_pb2.PrefixCacheStats, _Mapping]] = ..., handoff_wait_us: _Optional[int] = ..., handoff_from_router: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class VerifyBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
