from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]

class ProposalSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSAL_SOURCE_NONE: _ClassVar[ProposalSource]
    PROPOSAL_SOURCE_MODEL: _ClassVar[ProposalSource]
    PROPOSAL_SOURCE_NGRAM: _ClassVar[ProposalSource]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
PROPOSAL_SOURCE_NONE: ProposalSource
PROPOSAL_SOURCE_MODEL: ProposalSource
PROPOSAL_SOURCE_NGRAM: ProposalSource

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_p", "allowed_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("k", "disable")
    K_FIELD_NUMBER: _ClassVar[int]
    DISABLE_FIELD_NUMBER: _ClassVar[int]
    k: int
    disable: bool
    def __init__(self, k: _Optional[int] = ..., disable: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_new_tokens", "sampling", "speculation", "stop_token_ids", "request_id", "stop", "logprobs", "ignore_eos", "min_new_tokens", "structured_output", "include_stop_str_in_output", "bad_words", "prompt_logprobs", "keep_special_tokens", "prediction", "prediction_token_ids")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: SamplingParams
    speculation: SpeculationParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    ignore_eos: bool
    min_new_tokens: int
    structured_output: StructuredOutput
    include_stop_str_in_output: bool
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    prompt_logprobs: int
    keep_special_tokens: bool
    prediction: str
    prediction_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., include_stop_str_in_output: _Optional[bool] = ..., bad_words: _Optional[_Iterable[str]] = ..., prompt_logprobs: _Optional[int] = ..., keep_special_tokens: _Optional[bool] = ..., prediction: _Optional[str] = ..., prediction_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "reasoning_end", "reasoning_start", "harmony_final")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    REASONING_END_FIELD_NUMBER: _ClassVar[int]
    REASONING_START_FIELD_NUMBER: _ClassVar[int]
    HARMONY_FINAL_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    reasoning_end: str
    reasoning_start: str
    harmony_final: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., reasoning_end: _Optional[str] = ..., reasoning_start: _Optional[str] = ..., harmony_final: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("target_passes", "draft_tokens", "accepted_tokens", "k_per_round", "wire_bytes", "predrafts", "predraft_hits", "source_per_round", "sources", "target_calls", "predraft_branch_hits", "target_answers", "staged_rounds", "cached_prompt_tokens", "target_prefix_cache", "draft_prefix_cache", "handed_off_rounds", "handoffs_from_router", "accepted_prediction_tokens", "rejected_prediction_tokens", "prediction_dropped_at")
    TARGET_PASSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_HITS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    TARGET_CALLS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_BRANCH_HITS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ANSWERS_FIELD_NUMBER: _ClassVar[int]
    STAGED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    HANDED_OFF_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FROM_ROUTER_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_DROPPED_AT_FIELD_NUMBER: _ClassVar[int]
    target_passes: int
    draft_tokens: int
    accepted_tokens: int
    k_per_round: _containers.RepeatedScalarFieldContainer[int]
    wire_bytes: int
    predrafts: int
    predraft_hits: int
    source_per_round: _containers.RepeatedScalarFieldContainer[ProposalSource]
    sources: _containers.RepeatedCompositeFieldContainer[SourceStats]
    target_calls: int
    predraft_branch_hits: int
    target_answers: int
    staged_rounds: int
    cached_prompt_tokens: int
    target_prefix_cache: PrefixCacheStats
    draft_prefix_cache: PrefixCacheStats
    handed_off_rounds: int
    handoffs_from_router: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    prediction_dropped_at: int
    def __init__(self, target_passes: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., k_per_round: _Optional[_Iterable[int]] = ..., wire_bytes: _Optional[int] = ..., predrafts: _Optional[int] = ..., predraft_hits: _Optional[int] = ..., source_per_round: _Optional[_Iterable[_Union[ProposalSource, str]]] = ..., sources: _Optional[_Iterable[_Union[SourceStats, _Mapping]]] = ..., target_calls: _Optional[int] = ..., predraft_branch_hits: _Optional[int] = ..., target_answers: _Optional[int] = ..., staged_rounds: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., target_prefix_cache: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., draft_prefix_cache: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., handed_off_rounds: _Optional[int] = ..., handoffs_from_router: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ..., prediction_dropped_at: _Optional[int] = ...) -> None: ...

class PrefixCacheStats(_message.Message):
    __slots__ = ("looked_up", "found")
    LOOKED_UP_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    looked_up: int
    found: int
    def __init__(self, looked_up: _Optional[int] = ..., found: _Optional[int] = ...) -> None: ...

class SourceStats(_message.Message):
    __slots__ = ("source", "rounds", "draft_tokens", "accepted_tokens", "proposed_per_position", "accepted_per_position")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    source: ProposalSource
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    proposed_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, source: _Optional[_Union[ProposalSource, str]] = ..., rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., proposed_per_position: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats", "request_id", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stats: GenerationStats
    request_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., request_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...
