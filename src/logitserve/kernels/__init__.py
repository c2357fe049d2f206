"""logitserve's operators: Triton kernels behind descriptors (plans), with a torch reference.

Every function takes ``backend=`` (``"auto"``, ``"triton"``, ``"interpret"``, ``"torch"``);
``"auto"`` runs Triton on CUDA tensors and the torch reference on CPU tensors. Each op's plan
class validates a layout once and then launches with no further checks; the functions find
plans through a bounded cache.
"""

from ._backend import BACKENDS, resolve_backend
from ._plan import FLOAT_DTYPES, TensorSpec, clear_plan_caches, plan_cache_size
from .activation import SiluPlan, SwigluPlan, silu, swiglu
from .causal_softmax import CausalSoftmaxPlan, causal_softmax
from .copy import copy_by_kernel
from .sampling.api import Logprobs, sample
from .sampling.plan import SamplePlan
from .route_experts import RouteExpertsPlan, route_experts
from .softmax import SoftmaxPlan, softmax
from .topk_softmax import TopkSoftmaxPlan, topk_softmax
from .verify import VerifyPlan, VerifyResult, verify

__all__ = [
    "BACKENDS",
    "FLOAT_DTYPES",
    "CausalSoftmaxPlan",
    "Logprobs",
    "RouteExpertsPlan",
    "SamplePlan",
    "SiluPlan",
    "SoftmaxPlan",
    "SwigluPlan",
    "TensorSpec",
    "TopkSoftmaxPlan",
    "VerifyPlan",
    "VerifyResult",
    "causal_softmax",
    "clear_plan_caches",
    "copy_by_kernel",
    "plan_cache_size",
    "resolve_backend",
    "route_experts",
    "sample",
    "silu",
    "softmax",
    "swiglu",
    "topk_softmax",
    "verify",
]
