from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class FilterOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILTER_ORDER_UNSPECIFIED: _ClassVar[FilterOrder]
    FILTER_ORDER_TOP_K_FIRST: _ClassVar[FilterOrder]
    FILTER_ORDER_JOINT: _ClassVar[FilterOrder]

class RegionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_KIND_UNSPECIFIED: _ClassVar[RegionKind]
    REGION_KIND_SYSTEM: _ClassVar[RegionKind]
    REGION_KIND_CUDA: _ClassVar[RegionKind]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_BOOL: DType
FILTER_ORDER_UNSPECIFIED: FilterOrder
FILTER_ORDER_TOP_K_FIRST: FilterOrder
FILTER_ORDER_JOINT: FilterOrder
REGION_KIND_UNSPECIFIED: RegionKind
REGION_KIND_SYSTEM: RegionKind
REGION_KIND_CUDA: RegionKind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "region")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    region: RegionRef
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., region: _Optional[_Union[RegionRef, _Mapping]] = ...) -> None: ...

class RegionRef(_message.Message):
    __slots__ = ("region", "offset", "byte_size")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    byte_size: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("logits", "temperature", "temperature_rows", "top_k", "top_k_rows", "top_p", "top_p_rows", "min_p", "min_p_rows", "seed", "seed_rows", "step", "step_rows", "filter_order", "random_val", "random_val_rows", "output_regions", "prompt_token_ids", "prompt_offsets", "output_token_ids", "output_offsets", "repetition_penalty", "repetition_penalty_rows", "frequency_penalty", "frequency_penalty_rows", "presence_penalty", "presence_penalty_rows", "logit_bias_ids", "logit_bias_values", "logit_bias_offsets", "allowed_token_ids", "allowed_offsets", "banned_token_ids", "banned_offsets", "min_tokens", "min_tokens_rows", "stop_token_ids", "stop_offsets", "grammar_bitmask", "logprobs", "logprobs_mode", "return_kept", "sequence_ids", "sequence_steps", "ordered")
    class OutputRegionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RegionRef
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RegionRef, _Mapping]] = ...) -> None: ...
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_K_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_P_ROWS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_ROWS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_ROWS_FIELD_NUMBER: _ClassVar[int]
    FILTER_ORDER_FIELD_NUMBER: _ClassVar[int]
    RANDOM_VAL_FIELD_NUMBER: _ClassVar[int]
    RANDOM_VAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_REGIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_ROWS_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_ROWS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    BANNED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BANNED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_ROWS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_BITMASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    RETURN_KEPT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    ORDERED_FIELD_NUMBER: _ClassVar[int]
    logits: Tensor
    temperature: float
    temperature_rows: Tensor
    top_k: int
    top_k_rows: Tensor
    top_p: float
    top_p_rows: Tensor
    min_p: float
    min_p_rows: Tensor
    seed: int
    seed_rows: Tensor
    step: int
    step_rows: Tensor
    filter_order: FilterOrder
    random_val: float
    random_val_rows: Tensor
    output_regions: _containers.MessageMap[str, RegionRef]
    prompt_token_ids: Tensor
    prompt_offsets: Tensor
    output_token_ids: Tensor
    output_offsets: Tensor
    repetition_penalty: float
    repetition_penalty_rows: Tensor
    frequency_penalty: float
    frequency_penalty_rows: Tensor
    presence_penalty: float
    presence_penalty_rows: Tensor
    logit_bias_ids: Tensor
    logit_bias_values: Tensor
    logit_bias_offsets: Tensor
    allowed_token_ids: Tensor
    allowed_offsets: Tensor
    banned_token_ids: Tensor
    banned_offsets: Tensor
    min_tokens: int
    min_tokens_rows: Tensor
    stop_token_ids: Tensor
    stop_offsets: Tensor
    grammar_bitmask: Tensor
    logprobs: int
    logprobs_mode: str
    return_kept: bool
    sequence_ids: _containers.RepeatedScalarFieldContainer[int]
    sequence_steps: _containers.RepeatedScalarFieldContainer[int]
    ordered: OrderedMark
    def __init__(self, logits: _Optional[_Union[Tensor, _Mapping]] = ..., temperature: _Optional[float] = ..., temperature_rows: _Optional[_Union[Tensor, _Mapping]] = ..., top_k: _Optional[int] = ..., top_k_rows: _Optional[_Union[Tensor, _Mapping]] = ..., top_p: _Optional[float] = ..., top_p_rows: _Optional[_Union[Tensor, _Mapping]] = ..., min_p: _Optional[float] = ..., min_p_rows: _Optional[_Union[Tensor, _Mapping]] = ..., seed: _Optional[int] = ..., seed_rows: _Optional[_Union[Tensor, _Mapping]] = ..., step: _Optional[int] = ..., step_rows: _Optional[_Union[Tensor, _Mapping]] = ..., filter_order: _Optional[_Union[FilterOrder, str]] = ..., random_val: _Optional[float] = ..., random_val_rows: _Optional[_Union[Tensor, _Mapping]] = ..., output_regions: _Optional[_Mapping[str, RegionRef]] = ..., prompt_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., prompt_offsets: _Optional[_Union[Tensor, _Mapping]] = ..., output_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., output_offsets: _Optional[_Union[Tensor, _Mapping]] = ..., repetition_penalty: _Optional[float] = ..., repetition_penalty_rows: _Optional[_Union[Tensor, _Mapping]] = ..., frequency_penalty: _Optional[float] = ..., frequency_penalty_rows: _Optional[_Union[Tensor, _Mapping]] = ..., presence_penalty: _Optional[float] = ..., presence_penalty_rows: _Optional[_Union[Tensor, _Mapping]] = ..., logit_bias_ids: _Optional[_Union[Tensor, _Mapping]] = ..., logit_bias_values: _Optional[_Union[Tensor, _Mapping]] = ..., logit_bias_offsets: _Optional[_Union[Tensor, _Mapping]] = ..., allowed_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., allowed_offsets: _Optional[_Union[Tensor, _Mapping]] = ..., banned_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., banned_offsets: _Optional[_Union[Tensor, _Mapping]] = ..., min_tokens: _Optional[int] = ..., min_tokens_rows: _Optional[_Union[Tensor, _Mapping]] = ..., stop_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., stop_offsets: _Optional[_Union[Tensor, _Mapping]] = ..., grammar_bitmask: _Optional[_Union[Tensor, _Mapping]] = ..., logprobs: _Optional[int] = ..., logprobs_mode: _Optional[str] = ..., return_kept: bool = ..., sequence_ids: _Optional[_Iterable[int]] = ..., sequence_steps: _Optional[_Iterable[int]] = ..., ordered: _Optional[_Union[OrderedMark, _Mapping]] = ...) -> None: ...

class OrderedMark(_message.Message):
    __slots__ = ("session_id", "mark", "repeat")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MARK_FIELD_NUMBER: _ClassVar[int]
    REPEAT_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    mark: int
    repeat: int
    def __init__(self, session_id: _Optional[int] = ..., mark: _Optional[int] = ..., repeat: _Optional[int] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("token_ids", "seeds", "valid", "token_logprobs", "token_ranks", "top_token_ids", "top_logprobs", "kept_bitmask")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KEPT_BITMASK_FIELD_NUMBER: _ClassVar[int]
    token_ids: Tensor
    seeds: Tensor
    valid: Tensor
    token_logprobs: Tensor
    token_ranks: Tensor
    top_token_ids: Tensor
    top_logprobs: Tensor
    kept_bitmask: Tensor
    def __init__(self, token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., seeds: _Optional[_Union[Tensor, _Mapping]] = ..., valid: _Optional[_Union[Tensor, _Mapping]] = ..., token_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., token_ranks: _Optional[_Union[Tensor, _Mapping]] = ..., top_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., kept_bitmask: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RouteExpertsRequest(_message.Message):
    __slots__ = ("gate_logits", "k", "renormalize", "output_regions", "scoring", "correction_bias", "n_group", "topk_group", "group_score", "routed_scaling_factor")
    class Scoring(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SCORING_UNSPECIFIED: _ClassVar[RouteExpertsRequest.Scoring]
        SCORING_SIGMOID: _ClassVar[RouteExpertsRequest.Scoring]
    SCORING_UNSPECIFIED: RouteExpertsRequest.Scoring
    SCORING_SIGMOID: RouteExpertsRequest.Scoring
    class GroupScore(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        GROUP_SCORE_UNSPECIFIED: _ClassVar[RouteExpertsRequest.GroupScore]
        GROUP_SCORE_MAX: _ClassVar[RouteExpertsRequest.GroupScore]
    GROUP_SCORE_UNSPECIFIED: RouteExpertsRequest.GroupScore
    GROUP_SCORE_MAX: RouteExpertsRequest.GroupScore
    class OutputRegionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RegionRef
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RegionRef, _Mapping]] = ...) -> None: ...
    GATE_LOGITS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    RENORMALIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_REGIONS_FIELD_NUMBER: _ClassVar[int]
    SCORING_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_BIAS_FIELD_NUMBER: _ClassVar[int]
    N_GROUP_FIELD_NUMBER: _ClassVar[int]
    TOPK_GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SCORE_FIELD_NUMBER: _ClassVar[int]
    ROUTED_SCALING_FACTOR_FIELD_NUMBER: _ClassVar[int]
    gate_logits: Tensor
    k: int
    renormalize: bool
    output_regions: _containers.MessageMap[str, RegionRef]
    scoring: RouteExpertsRequest.Scoring
    correction_bias: Tensor
    n_group: int
    topk_group: int
    group_score: RouteExpertsRequest.GroupScore
    routed_scaling_factor: float
    def __init__(self, gate_logits: _Optional[_Union[Tensor, _Mapping]] = ..., k: _Optional[int] = ..., renormalize: bool = ..., output_regions: _Optional[_Mapping[str, RegionRef]] = ..., scoring: _Optional[_Union[RouteExpertsRequest.Scoring, str]] = ..., correction_bias: _Optional[_Union[Tensor, _Mapping]] = ..., n_group: _Optional[int] = ..., topk_group: _Optional[int] = ..., group_score: _Optional[_Union[RouteExpertsRequest.GroupScore, str]] = ..., routed_scaling_factor: _Optional[float] = ...) -> None: ...

class RouteExpertsResponse(_message.Message):
    __slots__ = ("weights", "indices")
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    weights: Tensor
    indices: Tensor
    def __init__(self, weights: _Optional[_Union[Tensor, _Mapping]] = ..., indices: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SoftmaxRequest(_message.Message):
    __slots__ = ("x", "dim", "output_regions")
    class OutputRegionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RegionRef
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RegionRef, _Mapping]] = ...) -> None: ...
    X_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_REGIONS_FIELD_NUMBER: _ClassVar[int]
    x: Tensor
    dim: int
    output_regions: _containers.MessageMap[str, RegionRef]
    def __init__(self, x: _Optional[_Union[Tensor, _Mapping]] = ..., dim: _Optional[int] = ..., output_regions: _Optional[_Mapping[str, RegionRef]] = ...) -> None: ...

class SoftmaxResponse(_message.Message):
    __slots__ = ("out",)
    OUT_FIELD_NUMBER: _ClassVar[int]
    out: Tensor
    def __init__(self, out: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class CausalSoftmaxRequest(_message.Message):
    __slots__ = ("x", "output_regions")
    class OutputRegionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RegionRef
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RegionRef, _Mapping]] = ...) -> None: ...
    X_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_REGIONS_FIELD_NUMBER: _ClassVar[int]
    x: Tensor
    output_regions: _containers.MessageMap[str, RegionRef]
    def __init__(self, x: _Optional[_Union[Tensor, _Mapping]] = ..., output_regions: _Optional[_Mapping[str, RegionRef]] = ...) -> None: ...

class CausalSoftmaxResponse(_message.Message):
    __slots__ = ("out",)
    OUT_FIELD_NUMBER: _ClassVar[int]
    out: Tensor
    def __init__(self, out: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SiluRequest(_message.Message):
    __slots__ = ("x", "up", "output_regions")
    class OutputRegionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RegionRef
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RegionRef, _Mapping]] = ...) -> None: ...
    X_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_REGIONS_FIELD_NUMBER: _ClassVar[int]
    x: Tensor
    up: Tensor
    output_regions: _containers.MessageMap[str, RegionRef]
    def __init__(self, x: _Optional[_Union[Tensor, _Mapping]] = ..., up: _Optional[_Union[Tensor, _Mapping]] = ..., output_regions: _Optional[_Mapping[str, RegionRef]] = ...) -> None: ...

class SiluResponse(_message.Message):
    __slots__ = ("out",)
    OUT_FIELD_NUMBER: _ClassVar[int]
    out: Tensor
    def __init__(self, out: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class VerifyDraftRequest(_message.Message):
    __slots__ = ("draft_token_ids", "draft_probs", "draft_logits", "draft_temperature", "draft_temperature_rows", "target_logits", "temperature", "temperature_rows", "top_k", "top_k_rows", "top_p", "top_p_rows", "min_p", "min_p_rows", "seed", "seed_rows", "step", "step_rows", "filter_order", "output_regions")
    class OutputRegionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RegionRef
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RegionRef, _Mapping]] = ...) -> None: ...
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TEMPERATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    TARGET_LOGITS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_K_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_P_ROWS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_ROWS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_ROWS_FIELD_NUMBER: _ClassVar[int]
    FILTER_ORDER_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_REGIONS_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: Tensor
    draft_probs: Tensor
    draft_logits: Tensor
    draft_temperature: float
    draft_temperature_rows: Tensor
    target_logits: Tensor
    temperature: float
    temperature_rows: Tensor
    top_k: int
    top_k_rows: Tensor
    top_p: float
    top_p_rows: Tensor
    min_p: float
    min_p_rows: Tensor
    seed: int
    seed_rows: Tensor
    step: int
    step_rows: Tensor
    filter_order: FilterOrder
    output_regions: _containers.MessageMap[str, RegionRef]
    def __init__(self, draft_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., draft_probs: _Optional[_Union[Tensor, _Mapping]] = ..., draft_logits: _Optional[_Union[Tensor, _Mapping]] = ..., draft_temperature: _Optional[float] = ..., draft_temperature_rows: _Optional[_Union[Tensor, _Mapping]] = ..., target_logits: _Optional[_Union[Tensor, _Mapping]] = ..., temperature: _Optional[float] = ..., temperature_rows: _Optional[_Union[Tensor, _Mapping]] = ..., top_k: _Optional[int] = ..., top_k_rows: _Optional[_Union[Tensor, _Mapping]] = ..., top_p: _Optional[float] = ..., top_p_rows: _Optional[_Union[Tensor, _Mapping]] = ..., min_p: _Optional[float] = ..., min_p_rows: _Optional[_Union[Tensor, _Mapping]] = ..., seed: _Optional[int] = ..., seed_rows: _Optional[_Union[Tensor, _Mapping]] = ..., step: _Optional[int] = ..., step_rows: _Optional[_Union[Tensor, _Mapping]] = ..., filter_order: _Optional[_Union[FilterOrder, str]] = ..., output_regions: _Optional[_Mapping[str, RegionRef]] = ...) -> None: ...

class VerifyDraftResponse(_message.Message):
    __slots__ = ("token_ids", "num_accepted", "valid", "seeds")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: Tensor
    num_accepted: Tensor
    valid: Tensor
    seeds: Tensor
    def __init__(self, token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., num_accepted: _Optional[_Union[Tensor, _Mapping]] = ..., valid: _Optional[_Union[Tensor, _Mapping]] = ..., seeds: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("id", "sample", "route_experts", "softmax", "causal_softmax", "silu")
    ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    SOFTMAX_FIELD_NUMBER: _ClassVar[int]
    CAUSAL_SOFTMAX_FIELD_NUMBER: _ClassVar[int]
    SILU_FIELD_NUMBER: _ClassVar[int]
    id: str
    sample: SampleRequest
    route_experts: RouteExpertsRequest
    softmax: SoftmaxRequest
    causal_softmax: CausalSoftmaxRequest
    silu: SiluRequest
    def __init__(self, id: _Optional[str] = ..., sample: _Optional[_Union[SampleRequest, _Mapping]] = ..., route_experts: _Optional[_Union[RouteExpertsRequest, _Mapping]] = ..., softmax: _Optional[_Union[SoftmaxRequest, _Mapping]] = ..., causal_softmax: _Optional[_Union[CausalSoftmaxRequest, _Mapping]] = ..., silu: _Optional[_Union[SiluRequest, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("id", "sample", "route_experts", "softmax", "causal_softmax", "silu")
    ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    SOFTMAX_FIELD_NUMBER: _ClassVar[int]
    CAUSAL_SOFTMAX_FIELD_NUMBER: _ClassVar[int]
    SILU_FIELD_NUMBER: _ClassVar[int]
    id: str
    sample: SampleResponse
    route_experts: RouteExpertsResponse
    softmax: SoftmaxResponse
    causal_softmax: CausalSoftmaxResponse
    silu: SiluResponse
    def __init__(self, id: _Optional[str] = ..., sample: _Optional[_Union[SampleResponse, _Mapping]] = ..., route_experts: _Optional[_Union[RouteExpertsResponse, _Mapping]] = ..., softmax: _Optional[_Union[SoftmaxResponse, _Mapping]] = ..., causal_softmax: _Optional[_Union[CausalSoftmaxResponse, _Mapping]] = ..., silu: _Optional[_Union[SiluResponse, _Mapping]] = ...) -> None: ...

class SequenceSpec(_message.Message):
    __slots__ = ("id", "temperature", "top_k", "top_p", "min_p", "seed", "step", "repetition_penalty", "frequency_penalty", "presence_penalty", "prompt_token_ids", "output_token_ids", "logit_bias_ids", "logit_bias_values", "banned_token_ids", "min_tokens", "stop_token_ids")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    BANNED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    id: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    step: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    banned_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., step: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., banned_token_ids: _Optional[_Iterable[int]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenSequencesRequest(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceSpec]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceSpec, _Mapping]]] = ...) -> None: ...

class OpenSequencesResponse(_message.Message):
    __slots__ = ("seeds",)
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    seeds: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seeds: _Optional[_Iterable[int]] = ...) -> None: ...

class CloseSequencesRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CloseSequencesResponse(_message.Message):
    __slots__ = ("closed_ids",)
    CLOSED_IDS_FIELD_NUMBER: _ClassVar[int]
    closed_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, closed_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("ids", "values")
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class SequenceUpdate(_message.Message):
    __slots__ = ("id", "temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "prompt_token_ids", "logit_bias", "banned_token_ids", "min_tokens", "stop_token_ids")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    BANNED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    id: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    prompt_token_ids: TokenIds
    logit_bias: LogitBias
    banned_token_ids: TokenIds
    min_tokens: int
    stop_token_ids: TokenIds
    def __init__(self, id: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., logit_bias: _Optional[_Union[LogitBias, _Mapping]] = ..., banned_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class UpdateSequencesRequest(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[SequenceUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[SequenceUpdate, _Mapping]]] = ...) -> None: ...

class UpdateSequencesResponse(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, steps: _Optional[_Iterable[int]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_message_bytes", "max_rows", "max_vocab", "max_batch_rows", "max_delay_us", "max_queue", "max_sequences", "sequence_idle_s")
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_VOCAB_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_DELAY_US_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    max_message_bytes: int
    max_rows: int
    max_vocab: int
    max_batch_rows: int
    max_delay_us: int
    max_queue: int
    max_sequences: int
    sequence_idle_s: float
    def __init__(self, max_message_bytes: _Optional[int] = ..., max_rows: _Optional[int] = ..., max_vocab: _Optional[int] = ..., max_batch_rows: _Optional[int] = ..., max_delay_us: _Optional[int] = ..., max_queue: _Optional[int] = ..., max_sequences: _Optional[int] = ..., sequence_idle_s: _Optional[float] = ...) -> None: ...

class ServerStats(_message.Message):
    __slots__ = ("launches", "batched_requests", "queue_depth", "plan_cache_size", "open_sequences", "sequence_bytes")
    LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PLAN_CACHE_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPEN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_BYTES_FIELD_NUMBER: _ClassVar[int]
    launches: int
    batched_requests: int
    queue_depth: int
    plan_cache_size: int
    open_sequences: int
    sequence_bytes: int
    def __init__(self, launches: _Optional[int] = ..., batched_requests: _Optional[int] = ..., queue_depth: _Optional[int] = ..., plan_cache_size: _Optional[int] = ..., open_sequences: _Optional[int] = ..., sequence_bytes: _Optional[int] = ...) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("version", "device", "device_name", "backend", "dtypes", "warmed_dtypes", "limits", "stats", "device_endpoints")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    WARMED_DTYPES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    version: str
    device: str
    device_name: str
    backend: str
    dtypes: _containers.RepeatedScalarFieldContainer[DType]
    warmed_dtypes: _containers.RepeatedScalarFieldContainer[DType]
    limits: Limits
    stats: ServerStats
    device_endpoints: _containers.RepeatedCompositeFieldContainer[DeviceEndpoint]
    def __init__(self, version: _Optional[str] = ..., device: _Optional[str] = ..., device_name: _Optional[str] = ..., backend: _Optional[str] = ..., dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., warmed_dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., stats: _Optional[_Union[ServerStats, _Mapping]] = ..., device_endpoints: _Optional[_Iterable[_Union[DeviceEndpoint, _Mapping]]] = ...) -> None: ...

class DeviceEndpoint(_message.Message):
    __slots__ = ("device", "address")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    device: str
    address: str
    def __init__(self, device: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class OpenChannelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenChannelResponse(_message.Message):
    __slots__ = ("service_name", "server_event", "client_event", "key", "format_version", "max_request_bytes", "max_answer_bytes", "iceoryx2_version", "idle_timeout_s")
    SERVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    SERVER_EVENT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_EVENT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ANSWER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ICEORYX2_VERSION_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    service_name: str
    server_event: str
    client_event: str
    key: bytes
    format_version: int
    max_request_bytes: int
    max_answer_bytes: int
    iceoryx2_version: str
    idle_timeout_s: float
    def __init__(self, service_name: _Optional[str] = ..., server_event: _Optional[str] = ..., client_event: _Optional[str] = ..., key: _Optional[bytes] = ..., format_version: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., max_answer_bytes: _Optional[int] = ..., iceoryx2_version: _Optional[str] = ..., idle_timeout_s: _Optional[float] = ...) -> None: ...

class CloseChannelRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class CloseChannelResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: bool = ...) -> None: ...

class OrderedSessionRequest(_message.Message):
    __slots__ = ("wait_timeout_s", "max_steps_ahead", "owned_regions")
    WAIT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    OWNED_REGIONS_FIELD_NUMBER: _ClassVar[int]
    wait_timeout_s: float
    max_steps_ahead: int
    owned_regions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, wait_timeout_s: _Optional[float] = ..., max_steps_ahead: _Optional[int] = ..., owned_regions: _Optional[_Iterable[str]] = ...) -> None: ...

class OrderedSessionOpened(_message.Message):
    __slots__ = ("session_id", "device_id", "marks_handle", "marks_offset", "wait_timeout_s", "max_steps_ahead")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MARKS_HANDLE_FIELD_NUMBER: _ClassVar[int]
    MARKS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    device_id: int
    marks_handle: bytes
    marks_offset: int
    wait_timeout_s: float
    max_steps_ahead: int
    def __init__(self, session_id: _Optional[int] = ..., device_id: _Optional[int] = ..., marks_handle: _Optional[bytes] = ..., marks_offset: _Optional[int] = ..., wait_timeout_s: _Optional[float] = ..., max_steps_ahead: _Optional[int] = ...) -> None: ...

class OrderedStepFailed(_message.Message):
    __slots__ = ("mark", "code", "message")
    MARK_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    mark: int
    code: int
    message: str
    def __init__(self, mark: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class OrderedSessionEnded(_message.Message):
    __slots__ = ("first_broken_mark", "reason")
    FIRST_BROKEN_MARK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    first_broken_mark: int
    reason: str
    def __init__(self, first_broken_mark: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class OrderedSessionEvent(_message.Message):
    __slots__ = ("opened", "failed", "ended")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    opened: OrderedSessionOpened
    failed: OrderedStepFailed
    ended: OrderedSessionEnded
    def __init__(self, opened: _Optional[_Union[OrderedSessionOpened, _Mapping]] = ..., failed: _Optional[_Union[OrderedStepFailed, _Mapping]] = ..., ended: _Optional[_Union[OrderedSessionEnded, _Mapping]] = ...) -> None: ...

class RegisterSystemSharedMemoryRequest(_message.Message):
    __slots__ = ("name", "key", "offset", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: str
    offset: int
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class RegisterCudaSharedMemoryRequest(_message.Message):
    __slots__ = ("name", "raw_handle", "device_id", "byte_size", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RAW_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    raw_handle: bytes
    device_id: int
    byte_size: int
    offset: int
    def __init__(self, name: _Optional[str] = ..., raw_handle: _Optional[bytes] = ..., device_id: _Optional[int] = ..., byte_size: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class RegisterSharedMemoryResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SharedMemoryStatusRequest(_message.Message):
    __slots__ = ("name", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: RegionKind
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[RegionKind, str]] = ...) -> None: ...

class SharedMemoryRegion(_message.Message):
    __slots__ = ("name", "kind", "key", "offset", "byte_size", "device_id", "in_use")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: RegionKind
    key: str
    offset: int
    byte_size: int
    device_id: int
    in_use: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[RegionKind, str]] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ..., device_id: _Optional[int] = ..., in_use: _Optional[int] = ...) -> None: ...

class SharedMemoryStatusResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[SharedMemoryRegion]
    def __init__(self, regions: _Optional[_Iterable[_Union[SharedMemoryRegion, _Mapping]]] = ...) -> None: ...

class UnregisterSharedMemoryRequest(_message.Message):
    __slots__ = ("name", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: RegionKind
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[RegionKind, str]] = ...) -> None: ...

class UnregisterSharedMemoryResponse(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...
