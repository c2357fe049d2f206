"""The same-host channel's message format, version 1 (docs/SERVICE.md, "Same-host channel").

A channel carries LogitServe's unary calls through an iceoryx2 request-response service whose
requests and answers are slices of bytes. Each is a fixed header, then variable parts:

- request: :data:`REQUEST_HEADER` (``key`` 16 bytes: OpenChannelResponse.key; ``method``: a
  number of :data:`METHODS`; ``request_id_bytes``: the length of the caller's x-request-id,
  0 for none; ``timeout_us``: the call's deadline from its sending, 0 for none), then the
  request id (ASCII), then the method's request message, serialized exactly as for gRPC;
- answer: :data:`ANSWER_HEADER` (``code``: a gRPC status code, 0 OK; ``request_id_bytes``;
  ``details_bytes``: the status message's length), then the request id (the caller's, or the
  one the server gave the call), then the status message (UTF-8, empty when OK), then, when OK,
  the method's response message.

Integers are little-endian. The module is the format's one definition in Python, imported by the
server (server/api/channel/) and the client (client/channel.py); a C++ or Rust frontend implements
the same layout.
"""

from __future__ import annotations

import struct

FORMAT_VERSION = 1
KEY_BYTES = 16
# key, method, request_id_bytes, timeout_us
REQUEST_HEADER = struct.Struct("<16sIIQ")
# code, request_id_bytes, details_bytes, reserved (0)
ANSWER_HEADER = struct.Struct("<IIII")

# The LogitServe methods a channel carries, by number: its unary calls, less those that open and
# close channels. Numbers are fixed for format 1; new methods get new numbers.
METHODS = {
    1: "Sample",
    2: "RouteExperts",
    3: "Softmax",
    4: "CausalSoftmax",
    5: "Silu",
    6: "VerifyDraft",
    7: "Step",
    8: "GetServerInfo",
    9: "OpenSequences",
    10: "CloseSequences",
    11: "UpdateSequences",
}
METHOD_NUMBERS = {name: number for number, name in METHODS.items()}

# The longest request id a call may carry, over gRPC (its x-request-id) or a channel (a longer one
# is INVALID_ARGUMENT): a channel request's message may be max_request_bytes -
# REQUEST_HEADER.size - MAX_REQUEST_ID bytes long, whatever its id.
MAX_REQUEST_ID = 128

# How an UNAUTHENTICATED answer to a key the server does not know (any more) begins: a caller
# opens a new channel on it (OpenChannel) and sends the call again.
UNKNOWN_KEY = "channel: no open channel has this key"


def request(key: bytes, method: int, request_id: bytes, timeout_us: int, message: bytes) -> bytes:
    """A request's bytes (a client's half; the server reads them with :data:`REQUEST_HEADER`)."""
    return REQUEST_HEADER.pack(key, method, len(request_id), timeout_us) + request_id + message


def answer(code: int, request_id: bytes, details: bytes, message: bytes = b"") -> tuple[bytes, ...]:
    """An answer's parts, in order (the server's half): joined, they are its bytes."""
    return ANSWER_HEADER.pack(code, len(request_id), len(details), 0), request_id, details, message


def read_answer(data) -> tuple[int, str, str, memoryview]:
    """``(code, request id, status message, response message)`` of an answer's bytes."""
    view = memoryview(data)
    code, id_bytes, details_bytes, _ = ANSWER_HEADER.unpack_from(view)
    start = ANSWER_HEADER.size
    request_id = bytes(view[start:start + id_bytes]).decode("ascii", "replace")
    start += id_bytes
    details = bytes(view[start:start + details_bytes]).decode("utf-8", "replace")
    return code, request_id, details, view[start + details_bytes:]
