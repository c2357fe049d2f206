"""Stream-ordered sessions (OrderedSession, SampleRequest.ordered): calls ordered on the GPU.

A caller's Sample naming its session and a mark waits on the GPU, on the session's own stream,
for the caller's ``ready`` mark, runs, writes its outputs into the caller's CUDA regions and then
``done``; the call answers once that is enqueued. docs/DESIGN.md ("Calls ordered on the GPU")
gives the contract; ``marks.py`` the GPU side, ``session.py`` a session's steps and end,
``table.py`` the sessions of this process and their watcher, ``sample.py`` the ordered Sample.
"""

from .sample import check_orderable, enqueue_sample, ordered_answer
from .session import MarkEnqueued, OrderedSession, SessionEnded
from .table import SessionTable

__all__ = ["MarkEnqueued", "OrderedSession", "SessionEnded", "SessionTable", "check_orderable", "enqueue_sample", "ordered_answer"]
