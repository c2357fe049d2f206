"""A same-host channel's message that does not fit /dev/shm (issue 43 item 1).

iceoryx2's segments are sparse files whose pages a write takes: on a full tmpfs that write was a
SIGBUS. A 16 MiB answer in a 2 MiB /dev/shm killed the server (exit -7), an 8 MiB request its
client, and in 1 MiB the first client died making its ports. Now a message is written only into
reserved pages (logitserve.v1.channel_memory): an answer that does not fit is RESOURCE_EXHAUSTED
naming /dev/shm, a request goes by gRPC, a channel whose ports do not fit is refused at
OpenChannel and its client calls over gRPC; neither process dies.

Each test runs its server and client processes in a private mount namespace whose /dev/shm is a
small tmpfs (and whose /tmp/iceoryx2, iceoryx2's own state, is private too): root and ``unshare``
are needed, and the tests are skipped, saying why, where they are missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _why_no_namespace() -> str | None:
    if os.geteuid() != 0:
        return "needs root for a private mount namespace with a small tmpfs on /dev/shm (unshare -m)"
    try:
        probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "unshare (util-linux) is not installed"
    if probe.returncode != 0:
        return f"a private mount namespace cannot be made here: {probe.stderr.strip()}"
    return None


WHY_NOT = _why_no_namespace()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def _with_small_shm(size: str, script: str) -> dict:
    """Run the Python ``script`` in a private mount namespace whose /dev/shm is a tmpfs of
    ``size``; what it prints last, read as JSON."""
    shell = (f"mount -t tmpfs -o size={size} tmpfs /dev/shm && mkdir -p /tmp/iceoryx2 && "
             f"mount -t tmpfs tmpfs /tmp/iceoryx2 && exec {sys.executable} -")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell], input=script,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# A server process and a client process; what each call gave, and whether both lived.
SCENARIO = r'''
import json, subprocess, sys
from logitserve.server.process import ServerProcess

CLIENT = """
import json, logging, sys
import numpy as np
from logitserve.client import Client, LogitServeError
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
said = {}
with Client(sys.argv[1], channel="shm", retries=0, timeout=60) as client, Client(sys.argv[1], timeout=60) as over_grpc:
    def call(name, make):
        try:
            said[name] = bool(np.array_equal(make(client), make(over_grpc)))
        except LogitServeError as exc:
            said[name] = [exc.code.name, exc.details]
    call("small", lambda c: c.softmax(x))
    said["small by the channel"] = client._same_host.is_open
    gate, up = np.ones((2048, 1), np.float32), np.ones((1, 2048), np.float32)
    call("16 MiB answer", lambda c: c.swiglu(gate, up))
    big = np.random.default_rng(1).standard_normal((2048, 1024)).astype(np.float32)
    call("8 MiB request", lambda c: c.softmax(big))
    call("small again", lambda c: c.softmax(x))
    said["small again by the channel"] = client._same_host.is_open
print(json.dumps(said))
"""

with ServerProcess("--warmup-dtypes", "none", *sys.argv[1:]) as server:
    client = subprocess.run([sys.executable, "-c", CLIENT, server.target], capture_output=True, text=True, timeout=300)
    lines = client.stdout.strip().splitlines()
    print(json.dumps({"client exit": client.returncode, "calls": json.loads(lines[-1]) if lines else None,
                      "client log": client.stderr[-3000:], "server exit": server.proc.poll(),
                      "server log": "".join(server.lines[-5:])}))
'''


def _scenario(size: str, *server_args: str) -> dict:
    return _with_small_shm(size, f"import sys; sys.argv[1:] = {list(server_args)!r}\n{SCENARIO}")


def test_messages_that_do_not_fit_dev_shm_go_by_grpc_or_are_refused():
    """2 MiB of /dev/shm, --max-channels 4 (a channel's ports take about 280 KB)."""
    said = _scenario("2m", "--max-channels", "4")
    assert (said["client exit"], said["server exit"]) == (0, None), said
    calls = said["calls"]
    assert calls["small"] is True and calls["small by the channel"] is True, said
    code, details = calls["16 MiB answer"]
    assert code == "RESOURCE_EXHAUSTED", said
    assert details.startswith("channel: the answer: 16777266 bytes do not fit /dev/shm ("), details
    assert details.endswith("; call over gRPC, or give the server's host more /dev/shm (e.g. docker run --shm-size)")
    assert calls["8 MiB request"] is True, said  # sent by gRPC: the same answer as gRPC's
    assert said["client log"].count("logitserve.client: channel='shm': channel: the request: 8388669 bytes do not "
                                    "fit /dev/shm (") == 1, said["client log"]
    assert calls["small again"] is True and calls["small again by the channel"] is True, said


def test_a_channel_whose_ports_do_not_fit_dev_shm_is_refused():
    """1 MiB of /dev/shm, --max-channels 32: a channel's ports would take about 1.6 MB."""
    said = _scenario("1m")
    assert (said["client exit"], said["server exit"]) == (0, None), said
    calls = said["calls"]
    assert all(calls[name] is True for name in ("small", "8 MiB request", "small again")), said
    assert not calls["small by the channel"] and not calls["small again by the channel"]
    assert calls["16 MiB answer"] is True, said  # over gRPC, all of it
    [line] = [line for line in said["client log"].splitlines() if line.startswith("logitserve.client:")]
    assert line.startswith("logitserve.client: channel='shm': no same-host channel, calling over gRPC (OpenChannel: "
                           "RESOURCE_EXHAUSTED: channels: a channel's ports: 1654784 bytes do not fit /dev/shm ("), line


RESERVE = r'''
import ctypes, json, mmap, os
from logitserve.v1 import channel_memory

SIZE = 4 << 20  # a sparse segment twice the tmpfs
fd = os.open("/dev/shm/reserve-probe", os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, SIZE)
segment = mmap.mmap(fd, SIZE)
base = ctypes.addressof(ctypes.c_char.from_buffer(segment))
said = {"free": channel_memory.free_bytes()}
for name, reserve in (("madvise", lambda at, size: channel_memory.reserve("probe", at, size)),
                      ("fallocate", lambda at, size: channel_memory.fallocate_mapped("probe", at, size))):
    try:
        reserve(base, 3 << 20)
        said[name] = "reserved"
    except channel_memory.NoRoom as exc:
        said[name] = str(exc)
    said[name + " free after"] = channel_memory.free_bytes()
channel_memory.reserve("probe", base + 100, 256 << 10)
segment[100:100 + (256 << 10)] = b"x" * (256 << 10)  # into reserved pages: no SIGBUS
said["written"] = True
print(json.dumps(said))
'''


def test_a_reservation_that_does_not_fit_is_no_room_and_gives_its_pages_back():
    """Both ways of reserving, on a 3 MiB slice of a sparse segment in 2 MiB of /dev/shm:
    NoRoom naming /dev/shm, and the tmpfs as free as before (a failed reservation must not
    leave it full for every other process)."""
    said = _with_small_shm("2m", RESERVE)
    for name in ("madvise", "fallocate"):
        assert said[name].startswith("probe: 3145728 bytes do not fit /dev/shm ("), said
        assert said[name + " free after"] >= said["free"] - 2 * 4096, said  # only a page at either end kept
    assert said["written"] is True
