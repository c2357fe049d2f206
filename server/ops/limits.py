"""Per-request size limits (--max-rows, --max-vocab, --max-message-bytes)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import TooLarge

# Highest tensor rank the row-wise ops accept.
MAX_RANK = 8


@dataclass(frozen=True)
class Limits:
    """Per-request size limits (--max-rows, --max-vocab): beyond them, RESOURCE_EXHAUSTED.

    ``max_output_bytes`` (the server's --max-message-bytes) bounds what a request makes the
    server allocate for its answer: a broadcasting SwiGLU of a ``[4096, 1]`` and a ``[1, 262144]``
    tensor, a few MB on the wire, would otherwise compute gigabytes it could never send.
    """

    max_rows: int
    max_vocab: int
    max_output_bytes: int | None = None

    def check_output(self, name: str, shape: tuple[int, ...], itemsize: int) -> None:
        if self.max_output_bytes is None:
            return
        size = math.prod(shape) * itemsize
        if size > self.max_output_bytes:
            raise TooLarge(f"{name}: the answer would hold {size} bytes (shape {list(shape)}), over this "
                           f"server's message limit of {self.max_output_bytes} (--max-message-bytes)")

    def check(self, name: str, rows: int, width: int) -> None:
        if rows > self.max_rows:
            raise TooLarge(f"{name}: {rows} rows, over this server's limit of {self.max_rows} (--max-rows)")
        if width > self.max_vocab:
            raise TooLarge(f"{name}: rows of {width} elements, over this server's limit of "
                           f"{self.max_vocab} (--max-vocab)")
