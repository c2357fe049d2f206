"""logitserve's Python client: numpy or torch in, numpy out.

    from logitserve.client import Client
    with Client("127.0.0.1:50051") as client:
        result = client.sample(logits, temperature=0.7, top_p=0.9)   # logits: (batch, vocab)
        result.token_ids, result.seeds, result.valid

A script that starts its server and calls it at once: ``Client(target, wait_for_ready=True,
timeout=60)``, whose calls wait for the server to listen (by default a call to a server that
cannot be reached fails UNAVAILABLE once its retries are spent, in about 0.35 s).

``AsyncClient`` takes the same arguments for asyncio. Shared-memory regions (tensors that cross
without being copied into messages): ``client.register`` / ``register_system`` / ``register_cuda``
/ ``shared_memory_status`` / ``unregister`` / ``reconcile_regions``, with the helpers of
:mod:`logitserve.client.regions` (``shared_array``, ``shared_tensor``, ``shared_copy``,
``cuda_ipc_handle``); a tensor inside a region registered through the client is then sent by
reference, every call takes ``out=`` (outputs written in place) and ``stream=`` (the CUDA stream
synchronized first), and the regions are unregistered when the client closes. The server knows
each region by a name scoped to the client (:mod:`.region_names`), and ``unregister()`` touches
only the client's own. Other tensors go as bytes copied once into the request
(:mod:`logitserve.client.wire`). Failed calls raise
:class:`LogitServeError` (``.code``, a ``grpc.StatusCode``, and ``.details``). Needs grpcio,
protobuf and numpy; torch is optional (torch tensors are accepted when it is installed, and
:func:`~logitserve.client.codec.decode_torch` keeps bfloat16 results as bfloat16).

``channel="shm"`` sends the operator calls through a same-host channel (shared memory,
iceoryx2: ``pip install 'logitserve[channel]'``) instead of gRPC; against a server started with
``--devices``, each call goes to the process of its tensors' GPU.

Modules, from the top: :mod:`.client` (``Client``: how a call is made, the stream of steps,
closing) and :mod:`.async_client` (``AsyncClient``, the same for asyncio), both made of
:mod:`.operators` (the operator methods), :mod:`.region_methods` (the SharedMemory service's
methods), :mod:`.sequences` (the sequences' methods) and :mod:`.construction` (the arguments, the
channel and the call path); :mod:`.arguments` (the arguments checked when a client is made: the
same-host channel's iceoryx2), :mod:`.retrying` (who retries which call: gRPC's retry policy, or
the client), :mod:`.devices` (each call to its GPU's process; :mod:`.device_routes`, what it
reads), :mod:`.same_host` (the same-host channel), :mod:`.transport` (channel, method paths,
timeout, CUDA synchronization), :mod:`.messages` (requests built from tensors), :mod:`.results`
(answers read), :mod:`.region_table` (the regions a client registered, found by address),
:mod:`.region_names` (the caller's names and the server's), :mod:`.regions` (shared memory to
register and the SharedMemory messages), :mod:`.wire` (serialization with tensor bytes copied
once, answers read in place), :mod:`.codec` (tensors to and from Tensor messages), :mod:`.errors`.
"""

from .async_client import AsyncClient
from .client import Client
from .errors import LogitServeError
from .results import SampleResult, ServerInfo, StepResult, VerifyDraftResult

__all__ = ["AsyncClient", "Client", "LogitServeError", "SampleResult", "ServerInfo", "StepResult",
           "VerifyDraftResult"]
