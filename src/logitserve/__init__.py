"""logitserve: Triton kernels and a gRPC service that turn LLM logits into decisions.

The packages: ``logitserve.kernels`` (the kernels and their plans), ``logitserve.server`` (the
service), ``logitserve.client`` (the client, no torch), and the wire contracts ``logitserve.v1``,
``logitserve.kserve`` and ``logitserve.reflection_v1``.
"""
