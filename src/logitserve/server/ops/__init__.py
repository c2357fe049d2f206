"""The operators as domain objects: validated calls, batched launches, results.

Each ``*Call`` is made from its request message by ``from_pb`` (all validation happens there,
raising ``ValueError`` / ``TypeError`` naming the field, or :class:`~..errors.TooLarge`; but
for the element-wise checks of Sample's processor fields, which ``await call.checked()`` runs
off the event loop and the batcher awaits before it queues the call), knows
its batching ``key`` (calls with equal keys may share a launch; ``None`` never shares) and its
``rows``, and launches a list of compatible calls at once with ``await run_batch(calls,
handle)``, which returns one result per call: Sample and RouteExperts through the device's
graph replays (:meth:`..device.DeviceHandle.launch`), the others with torch on its launch
thread. How a launch waits for the device is not theirs to say: the batcher says it
(:meth:`..device.DeviceHandle.run_batch`). Results turn back into messages with ``to_pb``.
Protobuf stops here: the kernels only see torch tensors.

Modules, one concept each: limits (request size limits), sample, route_experts, tensor_ops
(softmax, causal softmax, SiLU / SwiGLU), verify_draft (chain speculative sampling), step (several ops in one request), warmup (the
calls that compile every kernel before SERVING), info (GetServerInfo), batching (what the
launches share), resident (calls whose tensors live in shared-memory regions: inputs read in
place, outputs written there, how batches of them launch).
"""

from .info import ServerInfo
from .limits import MAX_RANK, Limits
from .route_experts import ROUTE_DTYPES, RouteExpertsCall, RouteExpertsResult
from .sample import WIRE_FILTER_ORDERS, SampleCall, SampleResult
from .step import STEP_OPS, StepCall, StepResult
from .tensor_ops import CausalSoftmaxCall, SiluCall, SoftmaxCall, TensorResult
from .verify_draft import VerifyDraftCall, VerifyDraftResult
from .warmup import WARMUP_BATCH_ROWS, warmup_calls

__all__ = [
    "MAX_RANK",
    "ROUTE_DTYPES",
    "STEP_OPS",
    "WARMUP_BATCH_ROWS",
    "WIRE_FILTER_ORDERS",
    "CausalSoftmaxCall",
    "Limits",
    "RouteExpertsCall",
    "RouteExpertsResult",
    "SampleCall",
    "SampleResult",
    "ServerInfo",
    "SiluCall",
    "SoftmaxCall",
    "StepCall",
    "StepResult",
    "TensorResult",
    "VerifyDraftCall",
    "VerifyDraftResult",
    "warmup_calls",
]
