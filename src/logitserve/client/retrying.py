"""Which calls are sent again after UNAVAILABLE, and by whom: gRPC's retry policy where it can
decide, the client's own loop where it cannot.

gRPC retries a call on its own when the channel's service config gives its method a
``retryPolicy`` (:func:`with_retry_policy` writes one from the client's ``retries``): at most
``retries`` more attempts, UNAVAILABLE only, backoff 50 ms doubling to at most 2 s (jittered by
gRPC), all inside the call's one deadline; a deadline that passes during a backoff ends the call
DEADLINE_EXCEEDED. With round_robin (:mod:`.balancing`) each attempt is picked like any call,
onto a server still ready. gRPC also retries by itself, whatever the policy, a call that never
reached the server (transparent retries): always safe.

The policy is chosen by method name, so the client keeps its own loop (:func:`after_failure`, with
the same backoff and the same deadline rule) for the calls a name cannot judge:

- ``Sample``: one naming ``sequence_ids`` advances each sequence's step and output on the
  server. After UNAVAILABLE the client cannot know whether the server drew (a connection lost
  after the draw). With ``sequence_steps`` (the step each row expects; ``Sequences.sample``
  sends them) a repeat is answered with the first draw, so the client retries it like any call;
  without them sending it again would draw twice, the caller never seeing the first token, so
  such a call raises the UNAVAILABLE (``update_sequences`` answers each sequence's step, to
  learn where it is).
- A client with ``channel="shm"``: the calls its same-host channel carries (:mod:`.same_host`)
  never go through gRPC's retrying machinery, so all of them, and the OpenChannel each may make
  first, are retried by the client (not by gRPC too, which would multiply the attempts).

Streams (``stream_steps``) are never retried: their requests are read as the stream goes.
"""

from __future__ import annotations

import json
import random
import time

import grpc

from .errors import LogitServeError
from .transport import METHOD_PATHS

# gRPC caps a retry policy's maxAttempts at 5 (the first attempt and four retries).
MAX_RETRIES = 4
# Exponential backoff of UNAVAILABLE retries: 50 ms, 100 ms, 200 ms, ... capped at 2 s. gRPC
# jitters each by +-20%, and so does the client's own loop, so clients retrying together spread out.
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 2.0
BACKOFF_MULTIPLIER = 2
BACKOFF_JITTER = 0.2
RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE,)
# How much of a call's request gRPC keeps to send it again; past it the call is never retried.
# gRPC's default, 256 KiB, is smaller than most logits: a (2, 32000) float32 Sample is 250 KiB.
# The kept bytes are the request's own slices, referenced, not copied (a 256 MiB request sent
# three times, the server in the same process: peak RSS 1.45 GiB at 256 KiB, 1.49 GiB with this),
# so the limit is the largest a message may be.
RETRY_BUFFER_BYTES = 2**31 - 1
RETRY_BUFFER_OPTION = "grpc.per_rpc_retry_buffer_size"
# What gRPC's retries are configured by, which the client sets from ``retries``.
POLICY_KEYS = ("retryPolicy", "hedgingPolicy")


def checked(retries) -> int:
    """``retries``, checked: an int in [0, :data:`MAX_RETRIES`]."""
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        raise ValueError(f"retries: must be an int in [0, {MAX_RETRIES}] (gRPC's retry policy makes at most "
                         f"{MAX_RETRIES + 1} attempts), got {retries!r}")
    return retries


def retry_policy(retries: int) -> dict:
    """The ``retryPolicy`` of a service config's method config for ``retries`` retries (> 0);
    deploy/client/service-config.json gives other languages' clients the default's (3)."""
    return {"maxAttempts": retries + 1, "initialBackoff": f"{BACKOFF_INITIAL_S}s", "maxBackoff": f"{BACKOFF_MAX_S:g}s",
            "backoffMultiplier": BACKOFF_MULTIPLIER, "retryableStatusCodes": [code.name for code in RETRIED_CODES]}


def retried_by_hand(carried) -> frozenset[str]:
    """The RPCs whose retries are the client's, not gRPC's (see the module's docstring);
    ``carried``: the RPCs a same-host channel carries (none without one), whose OpenChannel is
    made inside their calls."""
    if not carried:
        return frozenset({"Sample"})
    return frozenset(carried) | {"Sample", "OpenChannel"}


def _name(rpc: str) -> dict:
    service, method = METHOD_PATHS[rpc][0].lstrip("/").split("/")
    return {"service": service, "method": method}


def _applying(given: list[dict], name: dict) -> dict:
    """The fields (all but ``name``) of the given method config gRPC applies to ``name``: the
    one naming the method, else its service, else the default (an empty name); {} for none."""
    for wanted in (name, {"service": name["service"]}, {}):
        for entry in given:
            if any({k: v for k, v in n.items() if v} == wanted for n in entry.get("name", ())):
                return {k: v for k, v in entry.items() if k != "name"}
    return {}


def with_retry_policy(service_config: str, retries: int, by_hand: frozenset[str]) -> str:
    """``service_config`` (JSON) with gRPC's retry policy for ``retries`` on every unary RPC
    the client makes that is not retried ``by_hand``. Method configs given in it are kept, and
    the fields one gives a retried method (a timeout, say) come along into that method's
    config; they may not set retries themselves (``retries=`` does)."""
    config = json.loads(service_config)
    given = config.get("methodConfig", [])
    for i, entry in enumerate(given):
        for key in POLICY_KEYS:
            if key in entry:
                raise ValueError(f"options: grpc.service_config: methodConfig[{i}].{key}: set retries with "
                                 f"retries=, not in the service config")
    if retries == 0:
        return service_config
    retried = [rpc for rpc, (_, streaming) in METHOD_PATHS.items() if not streaming and rpc not in by_hand]
    names = [_name(rpc) for rpc in retried]
    # Each retried method gets a config naming it alone (gRPC refuses two configs of one name):
    # the given one's fields and the policy. The given configs keep every other name.
    kept = [{**entry, "name": [n for n in entry.get("name", ()) if n not in names]} for entry in given]
    configs: list[dict] = [entry for entry in kept if entry["name"]]
    grouped: list[tuple[dict, list[dict]]] = []
    for name in names:
        fields = {**_applying(given, name), "retryPolicy": retry_policy(retries)}
        for same, group in grouped:
            if same == fields:
                group.append(name)
                break
        else:
            grouped.append((fields, [name]))
    configs += [{"name": group, **fields} for fields, group in grouped]
    return json.dumps({**config, "methodConfig": configs})


def after_failure(exc: grpc.RpcError, attempt: int, retries: int, deadline: float | None) -> float | LogitServeError:
    """The client's own loop (the RPCs :func:`retried_by_hand`), after failed attempt ``attempt``
    (from 0) of a call given ``retries`` retries: the seconds to wait before the next, or the
    error to raise: the attempt's own (a code not retried, or no retries left), or
    DEADLINE_EXCEEDED when the call's ``deadline`` passes before the next attempt would start
    (as gRPC's retries end such a call, without waiting for it)."""
    error = LogitServeError.from_rpc_error(exc)
    if error.code not in RETRIED_CODES or attempt >= retries:
        return error
    delay = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * BACKOFF_MULTIPLIER**attempt)
    delay *= random.uniform(1 - BACKOFF_JITTER, 1 + BACKOFF_JITTER)
    if deadline is not None and time.monotonic() + delay >= deadline:
        return LogitServeError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"Deadline Exceeded before attempt {attempt + 2}; attempt {attempt + 1}: {error}")
    return delay
