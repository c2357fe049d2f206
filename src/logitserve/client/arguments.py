"""The arguments a client is made with that are checked before anything opens (beside
``retries``, :mod:`.retrying`, and ``load_balancing``, :mod:`.balancing`): ``wait_for_ready``, and
``channel``, whose same-host channel needs iceoryx2 of the server's release in this process.

A client that cannot run its same-host channel is refused when it is made (ImportError naming
``channel=``, what is missing and the command that installs it), not at its first call.
"""

from __future__ import annotations

import importlib.metadata

from . import same_host

# The iceoryx2 release the same-host channel runs: pyproject.toml's ``channel`` extra pins it, and
# the server (server/api/channel/transport.py) runs the same one; the shared-memory layout
# changes between releases (tests/test_client_options.py checks the three agree).
ICEORYX2_VERSION = "0.10.0"
CHANNEL_INSTALL = "pip install 'logitserve[channel]'"


def wait_for_ready(value) -> bool:
    """``value``, checked: a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"wait_for_ready: must be True or False, got {value!r}")
    return value


def channel(value) -> same_host.SameHost | None:
    """The channel asked for (``"grpc"``, ``"shm"`` or a :class:`~.same_host.SameHost`): None
    for gRPC, else the same-host channel's settings, once this process can run it."""
    settings = same_host.options(value)
    if settings is not None:
        missing = _iceoryx2_missing()
        if missing is not None:
            raise ImportError(f"channel={value!r}: the same-host channel needs iceoryx2 {ICEORYX2_VERSION} (the "
                              f"server's release) in this Python, which has {missing}: {CHANNEL_INSTALL}")
    return settings


def _iceoryx2_missing() -> str | None:
    """What this Python lacks of iceoryx2 :data:`ICEORYX2_VERSION`, or None."""
    try:
        import iceoryx2  # noqa: F401
    except ImportError as exc:
        return f"none that imports ({exc})"
    try:
        installed = importlib.metadata.version("iceoryx2")
    except importlib.metadata.PackageNotFoundError:
        return "an iceoryx2 without package metadata, of no known release"
    return None if installed == ICEORYX2_VERSION else f"iceoryx2 {installed}"
