"""The installed package's version (``logitserve version``, GetServerInfo, the image label)."""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("logitserve")
except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH (scripts/device_env.sh)
    __version__ = "0.0.0+checkout"
