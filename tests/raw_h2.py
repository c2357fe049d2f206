"""A raw HTTP/2 gRPC client that sends calls and never reads their answers (nor opens its
receive window): what a hostile or stuck client does to make the server hold answers."""

from __future__ import annotations

import socket
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS = 0, 1, 4
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _int(value: int, prefix_bits: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out, value = [limit], value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes(out + [value])


def _header(name: str, value: str) -> bytes:
    """A literal header field without indexing, no Huffman coding (HPACK)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _int(len(n), 7) + n + _int(len(v), 7) + v


class StuckClient:
    """One connection; :meth:`call` sends one gRPC request on a new stream; nothing is read
    after the server's settings, so the server can send at most 64 KiB of answers."""

    def __init__(self, host: str, port: int, metadata: dict | None = None):
        self.sock = socket.create_connection((host, port), timeout=10)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.sendall(PREFACE + _frame(SETTINGS, 0, 0, b""))
        self.first = self.sock.recv(4096)  # the server's settings, or b"" if it closed the connection
        self.sock.sendall(_frame(SETTINGS, ACK, 0, b""))
        self.metadata = metadata or {}
        self.next_stream = 1

    def call(self, path: str, message: bytes, authority: str = "localhost") -> int:
        stream, self.next_stream = self.next_stream, self.next_stream + 2
        block = b"".join(_header(k, v) for k, v in (
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
            ("content-type", "application/grpc"), ("te", "trailers"), *self.metadata.items()))
        body = b"\x00" + struct.pack(">I", len(message)) + message
        frames = [_frame(HEADERS, END_HEADERS, stream, block)]
        for i in range(0, len(body), 16384):  # the default SETTINGS_MAX_FRAME_SIZE
            last = i + 16384 >= len(body)
            frames.append(_frame(DATA, END_STREAM if last else 0, stream, body[i:i + 16384]))
        self.sock.sendall(b"".join(frames))
        return stream

    def settings(self) -> dict[int, int]:
        """The server's first SETTINGS frame: identifier -> value."""
        data = self.first
        length, kind = int.from_bytes(data[:3], "big"), data[3]
        assert kind == SETTINGS, kind
        payload = data[9:9 + length]
        return {int.from_bytes(payload[i:i + 2], "big"): int.from_bytes(payload[i + 2:i + 6], "big")
                for i in range(0, len(payload), 6)}

    def close(self) -> None:
        self.sock.close()
