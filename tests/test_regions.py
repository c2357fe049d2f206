"""Shared-memory regions: the registry (server/regions/) over real POSIX shared-memory objects
made by another process. The SharedMemory service and the client's helpers:
test_regions_service.py; regions on the request path: test_zero_copy*.py."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest
import torch

from logitserve.server import regions
from logitserve.server.errors import TooLarge
from logitserve.server.regions import RegionExists, RegionNotFound, RegionRegistry, owner_of
from logitserve.v1 import logitserve_pb2 as pb

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The other process: creates, writes, reads, shrinks POSIX shared-memory objects on command
# (one JSON line in, one out). Standard library only, so it starts fast.
OWNER_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from multiprocessing import shared_memory
    objs = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op, out = cmd["op"], None
        if op == "create":
            shm = shared_memory.SharedMemory(create=True, size=cmd["size"])
            objs[shm.name.lstrip("/")] = shm
            out = shm.name.lstrip("/")
        elif op == "write":
            data = bytes.fromhex(cmd["hex"])
            objs[cmd["key"]].buf[cmd["at"]:cmd["at"] + len(data)] = data
        elif op == "read":
            out = bytes(objs[cmd["key"]].buf[cmd["at"]:cmd["at"] + cmd["n"]]).hex()
        elif op == "truncate":
            os.ftruncate(objs[cmd["key"]]._fd, cmd["size"])
        elif op == "chmod":
            os.fchmod(objs[cmd["key"]]._fd, cmd["mode"])
        print(json.dumps(out), flush=True)
    for shm in objs.values():
        shm.close()
        shm.unlink()
""")


class ShmOwner:
    """A separate process owning shared-memory objects, as a client would."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def _do(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def create(self, size: int) -> str:
        return self._do(op="create", size=size)

    def write(self, key: str, at: int, data: bytes) -> None:
        self._do(op="write", key=key, at=at, hex=data.hex())

    def read(self, key: str, at: int, n: int) -> bytes:
        return bytes.fromhex(self._do(op="read", key=key, at=at, n=n))

    def truncate(self, key: str, size: int) -> None:
        self._do(op="truncate", key=key, size=size)

    def chmod(self, key: str, mode: int) -> None:
        self._do(op="chmod", key=key, mode=mode)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def owner():
    o = ShmOwner()
    yield o
    o.close()


def ref(region: str, offset: int, byte_size: int) -> pb.RegionRef:
    return pb.RegionRef(region=region, offset=offset, byte_size=byte_size)


def f32(*values) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


# ------------------------------------------------------------------------------------- names


@pytest.mark.parametrize("key", ["../etc/passwd", "a/b", "/etc/passwd", "//x", "..", ".", "", ".hidden", "a b",
                                 "a\nb", "x\n", "a\x00b", "k" * 256, "/" + "k" * 256, "é"])
def test_a_key_that_is_not_a_plain_name_is_refused_before_anything_is_opened(key, monkeypatch):
    def no_open(*args, **kwargs):
        raise AssertionError(f"os.open called for key {key!r}")
    monkeypatch.setattr(os, "open", no_open)
    with pytest.raises(ValueError, match=r"^key: .* is not a plain shared-memory name"):
        RegionRegistry().register_system("r", key, 0, 8)


@pytest.mark.parametrize("name", ["", "a/b", "-x", ".x", "a b", "n" * 129, "x\n"])
def test_a_region_name_that_is_not_a_plain_name_is_refused(name):
    with pytest.raises(ValueError, match=r"^name: .* is not a valid region name"):
        RegionRegistry().register_system(name, "psm_x", 0, 8)


def test_keys_in_the_namespace_that_are_not_objects_are_refused():
    registry = RegionRegistry()
    stem = f"logitserve-test-{uuid.uuid4().hex}"
    link, folder = f"/dev/shm/{stem}-link", f"/dev/shm/{stem}-dir"
    os.symlink("/etc/hostname", link)
    os.mkdir(folder)
    try:
        with pytest.raises(ValueError, match=r"key: shared-memory object .*-link' cannot be opened"):
            registry.register_system("r", f"{stem}-link", 0, 1)
        with pytest.raises(ValueError, match=r"key: .*-dir'"):
            registry.register_system("r", f"{stem}-dir", 0, 1)
        with pytest.raises(ValueError, match=r"key: no shared-memory object"):
            registry.register_system("r", f"{stem}-missing", 0, 1)
    finally:
        os.unlink(link)
        os.rmdir(folder)
    assert registry.mapped_count == 0 and registry.mapped_bytes == 0


def test_owner_of_digests_the_bearer_token():
    assert owner_of(None) is None and owner_of("") is None
    assert owner_of("Bearer alice") == owner_of("bearer  alice ") != owner_of("Bearer bob")
    assert "alice" not in owner_of("Bearer alice")


def test_message_helpers_for_the_request_path():
    assert regions.region_of(pb.Tensor(data=b"1234"), "logits") is None
    r = ref("r", 8, 16)
    assert regions.region_of(pb.Tensor(region=r), "logits") == r
    with pytest.raises(ValueError, match="^logits: both data and region are set"):
        regions.region_of(pb.Tensor(data=b"1234", region=r), "logits")
    with pytest.raises(ValueError, match="^logits: both"):  # data read apart from the message (wire.py)
        regions.region_of(pb.Tensor(region=r), "logits", data_bytes=4)
    request = pb.SampleRequest(output_regions={"token_ids": r, "valid": r})
    regions.check_outputs(request.output_regions, "Sample")
    request.output_regions["out"].CopyFrom(r)
    with pytest.raises(ValueError, match=r"^output_regions: 'out' is not an output of Sample \(token_ids, seeds, valid\)"):
        regions.check_outputs(request.output_regions, "Sample")
    with pytest.raises(ValueError, match=r"^output_regions\[out\].region: required"):
        regions.check_outputs(pb.SoftmaxRequest(output_regions={"out": pb.RegionRef()}).output_regions, "Softmax")
    for name, request in (("RouteExperts", pb.RouteExpertsRequest), ("Softmax", pb.SoftmaxRequest),
                          ("CausalSoftmax", pb.CausalSoftmaxRequest), ("Silu", pb.SiluRequest),
                          ("VerifyDraft", pb.VerifyDraftRequest)):
        response = getattr(pb, f"{name}Response")
        assert set(regions.OUTPUTS[name]) <= set(response.DESCRIPTOR.fields_by_name)
        assert "output_regions" in request.DESCRIPTOR.fields_by_name


# ---------------------------------------------------------------- register, status, unregister


def test_register_status_unregister(owner):
    key = owner.create(3 * 4096)
    registry = RegionRegistry()
    info = registry.register_system("in", "/" + key, 0, 4096)  # shm_open's "/name" is the same object
    assert (info.name, info.kind, info.key, info.offset, info.byte_size) == ("in", "system", key, 0, 4096)
    registry.register_system("out", key, 4096 + 8, 100)
    assert [i.name for i in registry.status()] == ["in", "out"]
    assert registry.status("out")[0].offset == 4104 and registry.status(kind="system") == registry.status()
    assert registry.status(kind="cuda") == []
    with pytest.raises(RegionNotFound, match="name: no region 'nope' registered"):
        registry.status("nope")
    with pytest.raises(RegionNotFound, match="no cuda region 'in'"):
        registry.status("in", kind="cuda")
    with pytest.raises(RegionExists, match="name: a region 'in' is already registered"):
        registry.register_system("in", key, 0, 8)
    assert registry.mapped_count == 2 and registry.mapped_bytes == 4096 + (8 + 100)  # from the page start
    assert registry.unregister("nope") == []  # Triton: unregistering an unknown name is no error
    assert registry.unregister("in", kind="cuda") == []
    assert registry.unregister("") == ["in", "out"]
    assert registry.status() == [] and registry.mapped_count == 0 and registry.mapped_bytes == 0
    # The server unmapped; the object is the client's and lives on.
    owner.write(key, 0, b"still")
    assert owner.read(key, 0, 5) == b"still" and os.path.exists(f"/dev/shm/{key}")


def test_registering_past_the_end_of_the_object_is_refused(owner):
    key = owner.create(1000)
    with pytest.raises(ValueError, match=r"offset \+ byte_size: 900 \+ 200 = 1100 bytes, past the end of .* \(1000 "):
        RegionRegistry().register_system("r", key, 900, 200)
    with pytest.raises(ValueError, match=r"byte_size: must be an integer > 0"):
        RegionRegistry().register_system("r", key, 0, 0)


def test_a_server_process_ending_leaves_the_clients_object(owner):
    """Mapping through the standard library's SharedMemory would hand the object to the server's
    resource tracker, which unlinks it when the server's process ends."""
    key = owner.create(64)
    owner.write(key, 0, b"kept")
    code = ("import sys; from logitserve.server.regions import RegionRegistry\n"
            "r = RegionRegistry(); r.register_system('r', sys.argv[1], 0, 64)\n"
            "print(bytes(r.resolve(type('R', (), dict(region='r', offset=0, byte_size=4))(), "
            "__import__('torch').uint8, (4,)).copy_out().numpy()).decode())\n"
            "r.close()\n")
    out = subprocess.run([sys.executable, "-c", code, key], check=True, capture_output=True, text=True, timeout=120,
                         env={**os.environ})
    assert out.stdout.strip() == "kept"
    assert os.path.exists(f"/dev/shm/{key}") and owner.read(key, 0, 4) == b"kept"


# ------------------------------------------------------------------------------------ resolve


def test_resolve_reads_and_writes_the_object_through_its_descriptor(owner):
    key = owner.create(4096)
    registry = RegionRegistry()
    registry.register_system("logits", key, 0, 4096)
    with registry.resolve(ref("logits", 16, 24), torch.float32, (2, 3), field="logits") as lease:
        assert len(lease.view) == 24
        owner.write(key, 16, f32(1, 2, 3, 4, 5, 6))  # after registration and resolution: no copy was made
        assert torch.equal(lease.copy_out(), torch.tensor([[1., 2, 3], [4, 5, 6]]))
        owner.write(key, 20, f32(-7))
        assert lease.copy_out()[0, 1].item() == -7.0
        lease.write_from(torch.full((2, 3), 0.5))  # the server writing an output: the client reads it
        assert owner.read(key, 16, 24) == f32(0.5, 0.5, 0.5, 0.5, 0.5, 0.5)
        with pytest.raises(RuntimeError, match="not mapped"):  # no CPU code touches it through a mapping
            lease.tensor()
    assert lease.released and lease.view is None
    with pytest.raises(RuntimeError, match="lease already released"):
        lease.copy_out()
    lease.release()  # idempotent
    assert registry.status("logits")[0].in_use == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64, torch.bool])
def test_resolve_keeps_the_dtype(owner, dtype):
    key = owner.create(64)
    values = torch.tensor([1, 0, 3, 2]).to(dtype)
    owner.write(key, 8, values.view(torch.uint8).numpy().tobytes())
    registry = RegionRegistry()
    registry.register_system("r", key, 0, 64)
    with registry.resolve(ref("r", 8, values.nbytes), dtype, (2, 2)) as lease:
        assert torch.equal(lease.copy_out(), values.view(2, 2))


def test_resolve_checks_every_rule_and_names_the_field(owner):
    key = owner.create(4096)
    registry = RegionRegistry()
    registry.register_system("r", key, 0, 1024)
    registry.register_system("odd", key, 2, 64)  # the region itself starts 2 bytes in
    with pytest.raises(RegionNotFound, match=r"^logits.region: no region 'nope' registered"):
        registry.resolve(ref("nope", 0, 8), torch.float32, (2,), field="logits")
    with pytest.raises(ValueError, match=r"^logits.region: offset 1020 \+ byte_size 8 = 1028, past the end of "
                                         r"region 'r' \(1024 bytes\)"):
        registry.resolve(ref("r", 1020, 8), torch.float32, (2,), field="logits")
    with pytest.raises(ValueError, match=r"^logits.region.offset: 2 is not a multiple of the itemsize 4 of float32"):
        registry.resolve(ref("r", 2, 8), torch.float32, (2,), field="logits")
    with pytest.raises(ValueError, match=r"^x.region.offset: 0 \(\+ the region's own offset 2\) is not a multiple "
                                         r"of the itemsize 8 of int64"):
        registry.resolve(ref("odd", 0, 8), torch.int64, (1,), field="x")
    with registry.resolve(ref("odd", 6, 8), torch.int64, (1,)):  # the region's 2 + 6: aligned
        pass
    with pytest.raises(ValueError, match=r"^x.region.byte_size: 12, but shape \[2, 2\] of float32 needs 16 bytes"):
        registry.resolve(ref("r", 0, 12), torch.float32, (2, 2), field="x")
    with pytest.raises(ValueError, match=r"^out.region.byte_size: 8, but shape \[4\] of float32 needs at least 16"):
        registry.resolve(ref("r", 0, 8), torch.float32, (4,), field="out", exact=False)
    with registry.resolve(ref("r", 0, 100), torch.float32, (4,), field="out", exact=False) as lease:
        assert len(lease.view) == 16  # Triton's rule for outputs: a larger slice, the tensor's bytes used
    with registry.resolve(ref("r", 8, 0), torch.float32, (0, 5)) as lease:  # empty tensors are fine
        assert lease.copy_out().shape == (0, 5)
    assert registry.status("r")[0].in_use == 0  # refused resolutions hold nothing


def test_an_object_shrunk_after_registration_is_refused_not_read(owner):
    key = owner.create(8192)
    registry = RegionRegistry()
    registry.register_system("r", key, 4096, 4096)
    owner.truncate(key, 4096)
    with pytest.raises(ValueError, match=r"logits.region: the shared-memory object .* shrank to 4096 bytes"):
        registry.resolve(ref("r", 0, 8), torch.float32, (2,), field="logits")
    assert registry.unregister("r") == ["r"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root opens a read-only object for writing anyway")
def test_a_read_only_object_is_an_input_only_region(owner):
    key = owner.create(64)
    owner.chmod(key, 0o444)
    registry = RegionRegistry()
    assert not registry.register_system("r", key, 0, 64).writable
    with registry.resolve(ref("r", 0, 8), torch.float32, (2,)):
        pass
    with pytest.raises(ValueError, match="out.region: region 'r' is read-only"):
        registry.resolve(ref("r", 0, 8), torch.float32, (2,), field="out", writable=True)


# ----------------------------------------------------------------------- owners, limits, leases


def test_a_region_is_visible_only_to_its_owner(owner):
    key = owner.create(4096)
    alice, bob = owner_of("Bearer alice"), owner_of("Bearer bob")
    registry = RegionRegistry()
    registry.register_system("r", key, 0, 64, owner=alice)
    assert registry.status(owner=bob) == [] and registry.status(owner=None) == []
    with pytest.raises(RegionNotFound):
        registry.status("r", owner=bob)
    with pytest.raises(RegionNotFound, match="no region 'r' registered"):
        registry.resolve(ref("r", 0, 8), torch.float32, (2,), owner=bob)
    assert registry.unregister("r", owner=bob) == [] and registry.unregister("", owner=bob) == []
    registry.register_system("r", key, 64, 64, owner=bob)  # names are per owner
    assert registry.status("r", owner=alice)[0].offset == 0 and registry.status("r", owner=bob)[0].offset == 64
    with registry.resolve(ref("r", 0, 8), torch.float32, (2,), owner=alice):
        pass
    assert registry.unregister(owner=alice) == ["r"] and [i.name for i in registry.status(owner=bob)] == ["r"]


def test_limits_on_regions_and_mapped_bytes(owner):
    key = owner.create(64 * 1024)
    registry = RegionRegistry(max_regions=2, max_mapped_bytes=10_000)
    registry.register_system("a", key, 0, 4000)
    with pytest.raises(ValueError):  # a failed registration holds nothing back
        registry.register_system("c", "no-such-object-" + uuid.uuid4().hex, 0, 1)
    assert registry.mapped_count == 1 and registry.mapped_bytes == 4000
    with pytest.raises(TooLarge, match=r"byte_size: registering 'b' would map 14000 bytes, over the server's limit "
                                       r"of 10000 \(4000 mapped now\)"):
        registry.register_system("b", key, 0, 10_000)
    registry.register_system("b", key, 0, 6000)
    with pytest.raises(TooLarge, match=r"name: registering 'c' would map 3 regions, over the server's limit of 2"):
        registry.register_system("c", key, 0, 1)
    assert registry.mapped_count == 2 and registry.mapped_bytes == 10_000
    registry.unregister("a")
    registry.register_system("c", key, 0, 4000)


def test_unregister_while_leased_keeps_the_mapping_until_the_last_lease(owner):
    key = owner.create(4096)
    registry = RegionRegistry(max_regions=2)
    registry.register_system("r", key, 0, 4096)
    first = registry.resolve(ref("r", 0, 8), torch.float32, (2,))
    second = registry.resolve(ref("r", 8, 8), torch.float32, (2,))
    assert registry.status("r")[0].in_use == 2
    assert registry.unregister("r") == ["r"]
    assert registry.status() == [] and registry.mapped_count == 1 and registry.mapped_bytes == 4096
    with pytest.raises(RegionNotFound):  # gone for new calls at once
        registry.resolve(ref("r", 0, 8), torch.float32, (2,))
    owner.write(key, 0, f32(3, 4))
    assert first.copy_out().tolist() == [3.0, 4.0]  # still open for the calls holding it
    registry.register_system("r", key, 0, 64)  # the name is free again: a new mapping
    assert registry.mapped_count == 2
    first.release()
    assert registry.mapped_count == 2
    second.release()
    assert registry.mapped_count == 1 and registry.mapped_bytes == 64
    registry.close()
    assert registry.mapped_count == 0


def test_leases_from_another_thread(owner):
    key = owner.create(4096)
    registry = RegionRegistry()
    registry.register_system("r", key, 0, 4096)
    leases = [registry.resolve(ref("r", 4 * i, 4), torch.float32, (1,)) for i in range(200)]
    registry.unregister("r")
    threads = [threading.Thread(target=lambda part=leases[i::4]: [lease.release() for lease in part]) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert registry.mapped_count == 0 and registry.mapped_bytes == 0
