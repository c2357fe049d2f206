"""The KServe v2 gRPC front (``inference.GRPCInferenceService``, Triton's protocol): every
operator of ``logitserve.v1`` as a model, for clients such as ``tritonclient``.

Modules: models (the model table: inputs, outputs, parameters, metadata, configuration),
translate (KServe requests into logitserve.v1 requests and answers back; raw input bytes read in
place), sequence_params and sequences (Triton's sequence parameters on ``sample``: sampling by a
sequence the server holds, through logitserve.v1's sequence table), servicer (the handlers, over
the same batcher, limits, guard, region registry and sequences as logitserve.v1).
"""

from .models import MODELS
from .servicer import SERVICE_NAME, InferenceServicer, add_to_server, request_parsers

__all__ = ["MODELS", "SERVICE_NAME", "InferenceServicer", "add_to_server", "request_parsers"]
