"""Zero-copy tensors on the request path, on a GPU: a `logitserve serve` process on cuda:0 (triton)
and this test process as the client, sharing CUDA memory through IPC handles (cuda-python).
Inputs are read where the client put them, inside a larger allocation and at an offset in it;
outputs are written into the client's device memory. Tokens equal ``kernels.sample`` run here
for the same seeds; the other ops equal their kernels."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch

from logitserve import kernels
from logitserve.client import regions as client_regions
from logitserve.v1 import logitserve_pb2 as pb
from test_zero_copy import Arena, Caller, in_region, start_server, value

pytestmark = pytest.mark.cuda

DEVICE = "cuda:0"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("cuda.bindings")
    with start_server(tmp_path_factory.mktemp("zc-cuda"), "--max-delay-us", "20000", "--max-region-bytes",
                      str(256 << 20), device=DEVICE, backend="triton", start_timeout=900) as s:
        yield s


class DeviceArena:
    """Device memory this process allocated, registered as one CUDA region: the region starts
    ``lead`` bytes into a larger allocation, and tensors and output slices are carved out of it."""

    def __init__(self, caller: Caller, name: str, nbytes: int = 4 << 20, lead: int = 4096 + 256):
        self.allocation = torch.zeros(lead + nbytes + 4096, dtype=torch.uint8, device=DEVICE)
        self.mem = self.allocation[lead:lead + nbytes]
        handle = client_regions.cuda_ipc_handle(self.mem)
        assert handle.offset >= lead  # inside the allocation, not at its base
        caller.client.register_cuda(name, self.mem)
        self.name, self.used = name, 0

    def alloc(self, nbytes: int, align: int = 256) -> int:
        offset = -(-self.used // align) * align
        self.used = offset + nbytes
        assert self.used <= self.mem.numel()
        return offset

    def put(self, t: torch.Tensor, align: int = 256) -> pb.Tensor:
        t = t.to(DEVICE).contiguous()
        offset = self.alloc(t.nbytes, align)
        self.mem[offset:offset + t.nbytes].view(t.dtype).copy_(t.reshape(-1))
        torch.cuda.synchronize()  # the client's writes are complete before the call
        return client_regions.region_tensor(self.name, t.dtype, t.shape, offset)

    def out(self, dtype: torch.dtype, shape) -> pb.RegionRef:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return pb.RegionRef(region=self.name, offset=self.alloc(nbytes), byte_size=nbytes)

    def read(self, answer: pb.Tensor, ref: pb.RegionRef, dtype: torch.dtype) -> torch.Tensor:
        """An output the server wrote into ``ref`` (the answer names it, with no data)."""
        assert answer.region == ref and not answer.data and list(answer.shape)
        return self.mem[ref.offset:ref.offset + ref.byte_size].view(dtype).view(tuple(answer.shape)).clone()


@pytest.fixture
def alice(server):
    c = Caller(server.target, "alice")
    c.arena = DeviceArena(c, "dev")
    yield c
    assert c.in_use() == {"dev": 0}
    c.client.unregister()
    c.close()


def logits_of(rows: int, vocab: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 3).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_reads_device_memory_and_writes_its_outputs_there(alice, dtype):
    arena = alice.arena
    logits = logits_of(5, 4099, 1, dtype)
    seeds = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64)
    temps = torch.tensor([0.8, 1.0, 0.0, 1.3, 0.6], dtype=torch.float32)
    refs = {"token_ids": arena.out(torch.int64, (5,)), "seeds": arena.out(torch.int64, (5,)),
            "valid": arena.out(torch.bool, (5,))}
    request = pb.SampleRequest(logits=arena.put(logits), seed_rows=arena.put(seeds), temperature_rows=arena.put(temps),
                               top_k=50, top_p=0.9, step=2, output_regions=refs)
    answer = alice.Sample(request)
    expect = kernels.sample(logits, temperature=temps.to(DEVICE), top_k=50, top_p=0.9, seed=seeds.to(DEVICE), step=2,
                            backend="triton")
    assert torch.equal(arena.read(answer.token_ids, refs["token_ids"], torch.int64), expect)
    assert torch.equal(arena.read(answer.seeds, refs["seeds"], torch.int64).cpu(), seeds)
    assert arena.read(answer.valid, refs["valid"], torch.bool).all()
    # Outputs as bytes, the logits at an offset aligned to their itemsize only.
    odd = alice.Sample(pb.SampleRequest(logits=arena.put(logits, align=dtype.itemsize), seed_rows=arena.put(seeds),
                                        temperature_rows=arena.put(temps), top_k=50, top_p=0.9, step=2))
    np.testing.assert_array_equal(value(odd.token_ids), expect.cpu().numpy())


def test_every_other_rpc_in_device_memory(alice):
    arena = alice.arena
    gate = logits_of(7, 64, 2, torch.bfloat16)
    refs = {"weights": arena.out(torch.float32, (7, 4)), "indices": arena.out(torch.int32, (7, 4))}
    answer = alice.RouteExperts(pb.RouteExpertsRequest(gate_logits=arena.put(gate), k=4, renormalize=True,
                                                       output_regions=refs))
    weights, indices = kernels.topk_softmax(gate, 4, renormalize=True, backend="triton")
    assert torch.equal(arena.read(answer.weights, refs["weights"], torch.float32), weights)
    assert torch.equal(arena.read(answer.indices, refs["indices"], torch.int32), indices)

    x = logits_of(3, 2 * 1000, 3).view(3, 2, 1000)
    up = logits_of(3, 2 * 1000, 4).view(3, 2, 1000)
    scores = logits_of(2, 4 * 9, 5).view(2, 4, 9)
    cases = [
        ("Softmax", dict(x=arena.put(x)), kernels.softmax(x, backend="triton"), x),
        ("Softmax", dict(x=arena.put(x), dim=1), kernels.softmax(x, dim=1, backend="triton"), x),
        ("CausalSoftmax", dict(x=arena.put(scores)), kernels.causal_softmax(scores, backend="triton"), scores),
        ("Silu", dict(x=arena.put(x)), kernels.silu(x, backend="triton"), x),
        ("Silu", dict(x=arena.put(x), up=arena.put(up)), kernels.swiglu(x, up, backend="triton"), x),
        ("Silu", dict(x=arena.put(x), up=arena.put(up[:1])), kernels.swiglu(x, up[:1], backend="triton"), x),
    ]
    for rpc, fields, expect, like in cases:
        ref = arena.out(like.dtype, like.shape)
        request = getattr(pb, f"{rpc}Request")(**fields, output_regions={"out": ref})
        got = arena.read(getattr(alice, rpc)(request).out, ref, like.dtype)
        torch.testing.assert_close(got, expect, rtol=0, atol=0, msg=lambda m: f"{rpc} {list(fields)}: {m}")
        # The output as bytes.
        back = value(getattr(alice, rpc)(getattr(pb, f"{rpc}Request")(**fields)).out)
        np.testing.assert_array_equal(back, expect.cpu().numpy())


def test_step_and_stream_steps_in_device_memory(alice):
    arena = alice.arena
    logits = logits_of(2, 1000, 6)
    x = logits_of(2, 128, 7)
    expect_tokens = kernels.sample(logits, seed=9, backend="triton")
    refs = {"token_ids": arena.out(torch.int64, (2,))}
    out = arena.out(torch.float32, (2, 128))
    step = pb.StepRequest(id="a", sample=pb.SampleRequest(logits=arena.put(logits), seed=9, output_regions=refs),
                          softmax=pb.SoftmaxRequest(x=arena.put(x), output_regions={"out": out}))
    answer = alice.Step(step)
    assert torch.equal(arena.read(answer.sample.token_ids, refs["token_ids"], torch.int64), expect_tokens)
    torch.testing.assert_close(arena.read(answer.softmax.out, out, torch.float32), kernels.softmax(x, backend="triton"),
                               rtol=0, atol=0)
    answers = list(alice.StreamSteps(iter([step, step])))
    assert [a.id for a in answers] == ["a", "a"]
    assert torch.equal(arena.read(answers[1].sample.token_ids, refs["token_ids"], torch.int64), expect_tokens)


def test_the_server_reads_device_memory_in_place(alice):
    arena = alice.arena
    x = torch.zeros(2, 3000, device=DEVICE)
    x[:, 17] = 10
    tensor = arena.put(x)
    ref = arena.out(torch.int64, (2,))
    request = pb.SampleRequest(logits=tensor, temperature=0.0, output_regions={"token_ids": ref})
    assert arena.read(alice.Sample(request).token_ids, ref, torch.int64).tolist() == [17, 17]
    x[0, 17], x[0, 2999], x[1, 17], x[1, 0] = 0, 10, 0, 10
    at = tensor.region.offset
    arena.mem[at:at + x.nbytes].view(torch.float32).copy_(x.reshape(-1))
    torch.cuda.synchronize()
    assert arena.read(alice.Sample(request).token_ids, ref, torch.int64).tolist() == [2999, 0]


def test_system_shared_memory_on_a_gpu_server(alice):
    """Host regions on a CUDA server: staged with one host-to-device copy, outputs written back."""
    arena = Arena(alice, "host", 1 << 20)
    try:
        logits = logits_of(3, 32000, 8).cpu().numpy()
        refs = {"token_ids": arena.out(np.int64, (3,))}
        answer = alice.Sample(pb.SampleRequest(logits=arena.put(logits), seed=11, output_regions=refs))
        expect = kernels.sample(torch.from_numpy(logits).to(DEVICE), seed=11, backend="triton")
        np.testing.assert_array_equal(in_region(answer.token_ids, refs["token_ids"], arena), expect.cpu().numpy())
        x = logits_of(2, 64, 9).cpu().numpy()
        ref = arena.out(np.float32, (2, 64))
        got = alice.Softmax(pb.SoftmaxRequest(x=arena.put(x), output_regions={"out": ref}))
        expect = kernels.softmax(torch.from_numpy(x).to(DEVICE), backend="triton").cpu().numpy()
        np.testing.assert_array_equal(in_region(got.out, ref, arena), expect)
        assert alice.in_use() == {"dev": 0, "host": 0}
    finally:
        alice.client.unregister("host")
        arena.close()


def test_concurrent_clients_batch_their_device_memory(server):
    """Four clients, each with its own CUDA region, calling Sample at once: their calls batch
    (gathered into one launch), and each gets exactly the
    tokens the kernel gives its rows alone."""
    errors = []

    def client(token: str, seed: int) -> None:
        caller = Caller(server.target, token)
        try:
            arena = DeviceArena(caller, "logits", 2 << 20, lead=512 * (seed + 1))
            logits = logits_of(4, 32000, seed)
            expect = kernels.sample(logits, seed=seed, top_k=20, backend="triton")
            tensor = arena.put(logits)
            ref = arena.out(torch.int64, (4,))
            for _ in range(8):
                answer = caller.Sample(pb.SampleRequest(logits=tensor, seed=seed, top_k=20,
                                                        output_regions={"token_ids": ref}))
                got = arena.read(answer.token_ids, ref, torch.int64)
                if not torch.equal(got, expect):
                    errors.append((token, got.tolist(), expect.tolist()))
            assert caller.in_use() == {"logits": 0}
            caller.client.unregister()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append((token, repr(exc)))
        finally:
            caller.close()

    threads = [threading.Thread(target=client, args=(token, i)) for i, token in enumerate(("alice", "bob", "carol",
                                                                                            "dave"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert errors == []


def test_cuda_handles_that_do_not_open(alice):
    client = alice.client
    with pytest.raises(Exception) as info:
        client.register_cuda("bad", b"\x01" * 64, device_id=0, byte_size=64)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details.startswith("raw_handle: cudaIpcOpenMemHandle failed: cudaError")
    with pytest.raises(Exception) as info:
        client.register_cuda("bad", b"\x01" * 64, device_id=torch.cuda.device_count(), byte_size=64)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.details.startswith("device_id:")
    # A reference past the end of a CUDA region, and misaligned.
    got = alice.arena.mem.numel()
    for ref, message in ((pb.RegionRef(region="dev", offset=got - 8, byte_size=16), "logits.region: offset"),
                         (pb.RegionRef(region="dev", offset=2, byte_size=16), "logits.region.offset: 2 ")):
        with pytest.raises(grpc.RpcError) as info:
            alice.Sample(pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 4], region=ref)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(message)


def test_a_reused_device_buffer_replays_a_graph_that_follows_each_call(alice):
    """A lone call on the same device buffer and output slots: the first launches eagerly, the
    second captures a CUDA graph keyed by those addresses, later ones replay it. Each answer
    follows its own call's contents and parameters, whichever way it ran."""
    arena = alice.arena
    rows, vocab = 3, 5003
    tensor = arena.put(logits_of(rows, vocab, 20))
    at = tensor.region.offset
    refs = {"token_ids": arena.out(torch.int64, (rows,)), "seeds": arena.out(torch.int64, (rows,)),
            "valid": arena.out(torch.bool, (rows,))}
    for i in range(5):
        logits = logits_of(rows, vocab, 30 + i)
        arena.mem[at:at + logits.nbytes].view(torch.float32).copy_(logits.reshape(-1))
        torch.cuda.synchronize()
        seeds = torch.tensor([7 * i + 1, 7 * i + 2, 7 * i + 3], dtype=torch.int64)
        temperature, top_k = 0.5 + 0.2 * i, 20 + i
        outputs = refs if i != 3 else {"token_ids": refs["token_ids"]}  # another key: eager again
        answer = alice.Sample(pb.SampleRequest(logits=tensor, seed_rows=pb.Tensor(
            dtype=pb.DTYPE_INT64, shape=[rows], data=seeds.numpy().tobytes()), temperature=temperature, top_k=top_k,
            step=i, output_regions=outputs))
        expect = kernels.sample(logits, temperature=temperature, top_k=top_k, seed=seeds.to(DEVICE), step=i,
                                backend="triton")
        assert torch.equal(arena.read(answer.token_ids, refs["token_ids"], torch.int64), expect), f"call {i}"
        if i != 3:
            assert torch.equal(arena.read(answer.seeds, refs["seeds"], torch.int64).cpu(), seeds), f"call {i}"
            assert arena.read(answer.valid, refs["valid"], torch.bool).all(), f"call {i}"
        else:
            np.testing.assert_array_equal(value(answer.seeds), seeds.numpy())


def test_processor_lists_in_device_memory_are_checked_in_the_launch(alice):
    # Penalty lists, a logit bias and a grammar bitmask read where the client put them; their
    # checks run in the launch (server/ops/processor_checks.py): a broken list answers
    # INVALID_ARGUMENT naming the field, the row and the rule, and the next call is served.
    arena, rows, vocab = alice.arena, 3, 1000
    logits = logits_of(rows, vocab, 4)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, vocab, (rows * 7,), generator=g)
    prompt_off = torch.arange(0, rows * 7 + 1, 7)
    bias_ids, bias_off = torch.tensor([1, 2, 3, 500]), torch.tensor([0, 2, 3, 4])
    bias_values = torch.tensor([5.0, -1.0, 2.0, 9.0])
    bitmask = torch.randint(-2**31, 2**31, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    seeds = torch.tensor([7, 8, 9])
    kw = dict(repetition_penalty=1.3, temperature=0.9, top_k=40)

    def request(**lists):
        fields = {**dict(prompt_token_ids=prompt, prompt_offsets=prompt_off, logit_bias_ids=bias_ids,
                         logit_bias_offsets=bias_off, logit_bias_values=bias_values, grammar_bitmask=bitmask), **lists}
        return pb.SampleRequest(logits=arena.put(logits), seed_rows=arena.put(seeds),
                                **{k: arena.put(v) for k, v in fields.items()}, **kw)

    answer = alice.Sample(request())
    expect = kernels.sample(logits, **kw, seed=seeds.to(DEVICE), prompt_token_ids=prompt.to(DEVICE),
                            prompt_offsets=prompt_off.to(DEVICE), logit_bias_ids=bias_ids.to(DEVICE),
                            logit_bias_offsets=bias_off.to(DEVICE), logit_bias_values=bias_values.to(DEVICE),
                            grammar_bitmask=bitmask.to(DEVICE), backend="triton")
    np.testing.assert_array_equal(value(answer.token_ids), expect.cpu().numpy())
    broken_ids = prompt.clone()
    broken_ids[9] = vocab
    for lists, words in ((dict(prompt_token_ids=broken_ids), f"prompt_token_ids: must be in [0, {vocab})"),
                         (dict(prompt_offsets=torch.tensor([0, 9, 8, 21])), "prompt_offsets: must not decrease"),
                         (dict(logit_bias_values=torch.tensor([1.0, float("nan"), 0.0, 0.0])),
                          "logit_bias_values[1]: must be finite")):
        with pytest.raises(grpc.RpcError) as info:
            alice.Sample(request(**lists))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details(), \
            info.value.details()
    assert "row 1" in _details(alice, request(prompt_token_ids=broken_ids))
    np.testing.assert_array_equal(value(alice.Sample(request()).token_ids), expect.cpu().numpy())


def _details(caller, request) -> str:
    with pytest.raises(grpc.RpcError) as info:
        caller.Sample(request)
    return info.value.details()


def test_verify_draft_in_device_memory_replays_a_graph_and_checks_the_draft(alice, server):
    # Every tensor and output in device memory: a lone call replays a graph from its key's second
    # use, and answers what the kernel gives; a draft token outside [0, V) is refused in the
    # launch (its check reads the ids where they lie).
    arena, b, n, vocab = alice.arena, 3, 2, 500
    target = logits_of(b * (n + 1), vocab, 11).reshape(b, n + 1, vocab)
    probs = torch.softmax(logits_of(b * n, vocab, 12).reshape(b, n, vocab), -1)
    ids = probs.argmax(-1)
    seeds = torch.tensor([5, 6, 7])
    refs = {"token_ids": arena.out(torch.int64, (b, n + 1)), "num_accepted": arena.out(torch.int64, (b,))}

    def request(draft_ids):
        return pb.VerifyDraftRequest(draft_token_ids=arena.put(draft_ids), target_logits=arena.put(target),
                                     draft_probs=arena.put(probs), seed_rows=arena.put(seeds), temperature=1.0,
                                     output_regions=refs)

    want = kernels.verify(ids, target, draft_probs=probs, seed=seeds.to(DEVICE), backend="triton")
    good = request(ids)
    for _ in range(3):  # eager, captured, replayed
        answer = alice.VerifyDraft(good)
        assert torch.equal(arena.read(answer.token_ids, refs["token_ids"], torch.int64), want.token_ids)
        assert torch.equal(arena.read(answer.num_accepted, refs["num_accepted"], torch.int64), want.num_accepted)
    bad = ids.clone()
    bad[2, 1] = vocab
    bad_request = request(bad)
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as info:
            alice.VerifyDraft(bad_request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"draft_token_ids[2, 1]: must be in [0, V) with V = {vocab}" in info.value.details()
