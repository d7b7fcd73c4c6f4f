from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ...) -> None: ...

class TokenMasks(_message.Message):
    __slots__ = ("words_per_position", "words")
    WORDS_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    words_per_position: int
    words: bytes
    def __init__(self, words_per_position: _Optional[int] = ..., words: _Optional[bytes] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "value", "strict", "compact", "output_start")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    COMPACT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: str
    strict: bool
    compact: bool
    output_start: int
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[str] = ..., strict: _Optional[bool] = ..., compact: _Optional[bool] = ..., output_start: _Optional[int] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("items",)
    class Item(_message.Message):
        __slots__ = ("seq_id", "prompt_token_ids", "cache_salt")
        SEQ_ID_FIELD_NUMBER: _ClassVar[int]
        PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
        seq_id: str
        prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
        cache_salt: str
        def __init__(self, seq_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StartRequest.Item]
    def __init__(self, items: _Optional[_Iterable[_Union[StartRequest.Item, _Mapping]]] = ...) -> None: ...

class StartResponse(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cached_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("items",)
    class Item(_message.Message):
        __slots__ = ("seq_id", "new_token_ids", "num_committed", "num_tokens", "sampling", "uniform", "return_probs", "grammar", "assumed_token_ids", "num_alternatives")
        SEQ_ID_FIELD_NUMBER: _ClassVar[int]
        NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
        NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
        SAMPLING_FIELD_NUMBER: _ClassVar[int]
        UNIFORM_FIELD_NUMBER: _ClassVar[int]
        RETURN_PROBS_FIELD_NUMBER: _ClassVar[int]
        GRAMMAR_FIELD_NUMBER: _ClassVar[int]
        ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        NUM_ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
        seq_id: str
        new_token_ids: _containers.RepeatedScalarFieldContainer[int]
        num_committed: int
        num_tokens: int
        sampling: TokenSampling
        uniform: _containers.RepeatedScalarFieldContainer[float]
        return_probs: bool
        grammar: Grammar
        assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
        num_alternatives: int
        def __init__(self, seq_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_committed: _Optional[int] = ..., num_tokens: _Optional[int] = ..., sampling: _Optional[_Union[TokenSampling, _Mapping]] = ..., uniform: _Optional[_Iterable[float]] = ..., return_probs: _Optional[bool] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., num_alternatives: _Optional[int] = ...) -> None: ...
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeRequest.Item]
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeRequest.Item, _Mapping]]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("token_ids", "q", "draft_probs", "label", "alternatives")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    draft_probs: _containers.RepeatedScalarFieldContainer[float]
    label: str
    alternatives: _containers.RepeatedCompositeFieldContainer[Alternative]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., draft_probs: _Optional[_Iterable[float]] = ..., label: _Optional[str] = ..., alternatives: _Optional[_Iterable[_Union[Alternative, _Mapping]]] = ...) -> None: ...

class Alternative(_message.Message):
    __slots__ = ("position", "token_id", "proposal")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    position: int
    token_id: int
    proposal: Proposal
    def __init__(self, position: _Optional[int] = ..., token_id: _Optional[int] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("proposals",)
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("items",)
    class Item(_message.Message):
        __slots__ = ("seq_id", "prompt_token_ids", "sampling", "uniform", "cache_salt", "allowed")
        SEQ_ID_FIELD_NUMBER: _ClassVar[int]
        PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        SAMPLING_FIELD_NUMBER: _ClassVar[int]
        UNIFORM_FIELD_NUMBER: _ClassVar[int]
        CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
        ALLOWED_FIELD_NUMBER: _ClassVar[int]
        seq_id: str
        prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
        sampling: TokenSampling
        uniform: float
        cache_salt: str
        allowed: TokenMasks
        def __init__(self, seq_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[TokenSampling, _Mapping]] = ..., uniform: _Optional[float] = ..., cache_salt: _Optional[str] = ..., allowed: _Optional[_Union[TokenMasks, _Mapping]] = ...) -> None: ...
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PrefillRequest.Item]
    def __init__(self, items: _Optional[_Iterable[_Union[PrefillRequest.Item, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_ids", "cached_tokens", "free_slots")
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    free_slots: int
    def __init__(self, first_token_ids: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[_Iterable[int]] = ..., free_slots: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("items",)
    class Item(_message.Message):
        __slots__ = ("seq_id", "last_token_id", "draft_token_ids", "q", "sampling", "uniform_accept", "uniform_sample", "return_probs", "allowed")
        SEQ_ID_FIELD_NUMBER: _ClassVar[int]
        LAST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
        DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        Q_FIELD_NUMBER: _ClassVar[int]
        SAMPLING_FIELD_NUMBER: _ClassVar[int]
        UNIFORM_ACCEPT_FIELD_NUMBER: _ClassVar[int]
        UNIFORM_SAMPLE_FIELD_NUMBER: _ClassVar[int]
        RETURN_PROBS_FIELD_NUMBER: _ClassVar[int]
        ALLOWED_FIELD_NUMBER: _ClassVar[int]
        seq_id: str
        last_token_id: int
        draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
        q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
        sampling: TokenSampling
        uniform_accept: _containers.RepeatedScalarFieldContainer[float]
        uniform_sample: float
        return_probs: bool
        allowed: TokenMasks
        def __init__(self, seq_id: _Optional[str] = ..., last_token_id: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., sampling: _Optional[_Union[TokenSampling, _Mapping]] = ..., uniform_accept: _Optional[_Iterable[float]] = ..., uniform_sample: _Optional[float] = ..., return_probs: _Optional[bool] = ..., allowed: _Optional[_Union[TokenMasks, _Mapping]] = ...) -> None: ...
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyRequest.Item]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyRequest.Item, _Mapping]]] = ...) -> None: ...

class VerifyOutcome(_message.Message):
    __slots__ = ("token_ids", "num_accepted", "target_probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TARGET_PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    target_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., target_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("outcomes", "free_slots")
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[VerifyOutcome]
    free_slots: int
    def __init__(self, outcomes: _Optional[_Iterable[_Union[VerifyOutcome, _Mapping]]] = ..., free_slots: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("run_id", "items")
    class Item(_message.Message):
        __slots__ = ("seq_id", "last_token_id", "sampling", "uniforms", "max_steps", "stop_token_ids")
        SEQ_ID_FIELD_NUMBER: _ClassVar[int]
        LAST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
        SAMPLING_FIELD_NUMBER: _ClassVar[int]
        UNIFORMS_FIELD_NUMBER: _ClassVar[int]
        MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
        STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        seq_id: str
        last_token_id: int
        sampling: TokenSampling
        uniforms: _containers.RepeatedScalarFieldContainer[float]
        max_steps: int
        stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, seq_id: _Optional[str] = ..., last_token_id: _Optional[int] = ..., sampling: _Optional[_Union[TokenSampling, _Mapping]] = ..., uniforms: _Optional[_Iterable[float]] = ..., max_steps: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    items: _containers.RepeatedCompositeFieldContainer[DecodeRequest.Item]
    def __init__(self, run_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[DecodeRequest.Item, _Mapping]]] = ...) -> None: ...

class DecodeStep(_message.Message):
    __slots__ = ("token_ids", "free_slots")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    free_slots: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., free_slots: _Optional[int] = ...) -> None: ...

class StopDecodeRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StopDecodeResponse(_message.Message):
    __slots__ = ("stopped",)
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    stopped: bool
    def __init__(self, stopped: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("model", "active_sessions", "free_slots", "num_slots", "vocab_size", "max_seq_len", "calls", "sessions_started", "sessions_expired", "busy_seconds", "bytes_received", "bytes_sent", "computed_tokens", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "prefix_cache_evictions", "prefix_cache_entries", "prefix_cache_positions", "prefix_cache_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_STARTED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    active_sessions: int
    free_slots: int
    num_slots: int
    vocab_size: int
    max_seq_len: int
    calls: int
    sessions_started: int
    sessions_expired: int
    busy_seconds: float
    bytes_received: int
    bytes_sent: int
    computed_tokens: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_evictions: int
    prefix_cache_entries: int
    prefix_cache_positions: int
    prefix_cache_bytes: int
    def __init__(self, model: _Optional[str] = ..., active_sessions: _Optional[int] = ..., free_slots: _Optional[int] = ..., num_slots: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., calls: _Optional[int] = ..., sessions_started: _Optional[int] = ..., sessions_expired: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_evictions: _Optional[int] = ..., prefix_cache_entries: _Optional[int] = ..., prefix_cache_positions: _Optional[int] = ..., prefix_cache_bytes: _Optional[int] = ...) -> None: ...
