"""The front door of stream-ordered sessions: the OrderedSession call, which is the session's
lifetime, and a Sample naming one (SampleRequest.ordered).

The session lives while its call does. gRPC ends the call as soon as its client cancels it or
its connection closes (a client process that dies closes it), so the session's end, which
releases its GPU waits and frees its marks (server/ordered/), follows a caller's death within
milliseconds, without a heartbeat: the reason a session is a call, not an id with a lease.
"""

from __future__ import annotations

import asyncio

from logitserve.v1 import logitserve_pb2 as pb

from ..errors import Unsupported
from ..ordered import SessionTable, check_orderable, enqueue_sample, ordered_answer


async def session_events(table: SessionTable, registry, request: pb.OrderedSessionRequest, owner):
    """The OrderedSession call's answers: ``opened``, then the session's events until it ends
    (the call then ends OK) or the caller leaves. The regions it owns (``owned_regions``) are
    unregistered when it ends: a leased one stays mapped until the steps holding it are done."""
    why = table.unavailable()
    if why is not None:
        raise Unsupported(f"OrderedSession: {why}")
    if len(request.owned_regions) > registry.max_regions:
        raise ValueError(f"owned_regions: {len(request.owned_regions)} names, more than the regions this server "
                         f"maps ({registry.max_regions}, --max-regions)")
    owned = registry.regions_of(owner, request.owned_regions, "owned_regions")
    session = await table.open(owner, request.wait_timeout_s, request.max_steps_ahead)
    try:
        yield session.opened_event()
        while True:
            event = await session.events.get()
            yield event
            if event.HasField("ended"):
                return
    finally:
        registry.unregister_these(owner, owned)
        # Not awaited here: a cancelled call's handler must not wait for the stream to drain.
        asyncio.ensure_future(table.close(session, "its OrderedSession call ended"))


async def ordered_sample(service, call, mark: pb.OrderedMark, owner, timeout: float | None) -> pb.SampleResponse:
    """Enqueue a validated SampleCall as step ``mark.mark`` of the caller's session; its answer."""
    table = service.ordered
    check_orderable(call, service.handle.device)
    session = table.get(owner, mark.session_id, "ordered.session_id")
    await asyncio.wait_for(enqueue_sample(table, session, call, mark.mark, mark.repeat), timeout)
    return ordered_answer(call)
