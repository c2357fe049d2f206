"""The same-host channel (OpenChannel): a caller's unary calls through shared memory (iceoryx2)
instead of gRPC, served by the same guarded handlers, batcher and device. docs/SERVICE.md,
"Same-host channel", gives the format; :mod:`.service` the server's half."""

from .service import ChannelService

__all__ = ["ChannelService"]
