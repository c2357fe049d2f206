"""The server's front doors: every way a call comes in, each guarded alike.

``servicer.py`` (the LogitServe gRPC service), ``kserve/`` (the KServe v2 / Triton protocol on
the same port), ``channel/`` (same-host channels through shared memory), ``reflection.py``;
``guard.py`` wraps every handler of each (request id, drain, token, decoding, status codes,
metrics), with ``auth.py`` (bearer tokens) and ``held.py`` (bytes of answers held). Calls go
from here to the operators (``server/ops/``), regions and sequences; nothing below imports this.
"""
