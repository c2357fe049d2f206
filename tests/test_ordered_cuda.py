"""Calls ordered on the GPU (issue 44), on a GPU: a `logitserve serve` process on cuda:0 and this
test process as the engine, sharing the logits, the tokens and the session's marks over CUDA IPC.

The engine never synchronizes between steps: each step's "forward" is slow on purpose (a kernel
that spins for ~10 ms, then the logits' writes), and the tokens drawn from it are copied into a
history on the engine's stream right after the ordered call. A server that read the logits
before the mark, or a stream that went on before the outputs were written, would put another
step's tokens in the history."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from logitserve import kernels
from logitserve.client import Client, LogitServeError
from logitserve.server.process import ServerProcess

# One worker runs them in turn (scripts/gpu_check.sh: --dist loadgroup): each times another
# client's calls against a stall of its own, which a long kernel of another test would hold.
pytestmark = [pytest.mark.cuda, pytest.mark.xdist_group("ordered_cuda")]

DEVICE = "cuda:0"
SLOW_FORWARD_CYCLES = 20_000_000  # ~10 ms of torch.cuda._sleep on an H100


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("cuda.bindings")
    with ServerProcess("--warmup-dtypes", "none", "--ordered-wait-s", "3", device=DEVICE, backend="triton",
                       start_timeout=900) as s:
        yield s


def _engine_buffers(client: Client, rows: int, vocab: int):
    logits = torch.zeros(rows, vocab, device=DEVICE)
    tokens = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)  # poisoned
    client.register_cuda("logits", logits)
    client.register_cuda("tokens", tokens)
    return logits, tokens


def test_greedy_steps_read_each_forwards_logits_after_a_slow_forward(server):
    rows, vocab, steps = 4, 4096, 16
    expected = torch.randint(0, vocab, (steps, rows), generator=torch.Generator().manual_seed(1))
    with Client(server.target, timeout=300) as client:
        logits, tokens = _engine_buffers(client, rows, vocab)
        history = torch.full((steps, rows), -9, dtype=torch.int64, device=DEVICE)
        stream = torch.cuda.Stream()
        with client.ordered_session() as session, torch.cuda.stream(stream):
            for n in range(steps):
                torch.cuda._sleep(SLOW_FORWARD_CYCLES)
                logits.zero_()
                logits.scatter_(1, expected[n].view(rows, 1).to(DEVICE), 10.0)
                step = session.sample(logits, out={"token_ids": tokens}, stream=stream, temperature=0.0)
                history[n].copy_(tokens)
            assert step.mark == steps
            last = step.result()
        assert torch.equal(history.cpu(), expected)
        assert last.token_ids.tolist() == expected[-1].tolist() and last.valid.all()


def test_seeded_steps_draw_what_sample_draws_in_process(server):
    rows, vocab, steps = 8, 32000, 12
    seeds = torch.arange(rows, dtype=torch.int64) + 1234
    with Client(server.target, timeout=300) as client:
        logits, tokens = _engine_buffers(client, rows, vocab)
        logits_seen = torch.empty(steps, rows, vocab, device=DEVICE)
        history = torch.full((steps, rows), -9, dtype=torch.int64, device=DEVICE)
        stream = torch.cuda.Stream()
        generator = torch.Generator(device=DEVICE).manual_seed(7)
        with client.ordered_session() as session, torch.cuda.stream(stream):
            for n in range(steps):
                torch.cuda._sleep(SLOW_FORWARD_CYCLES // 4)
                torch.randn(rows, vocab, generator=generator, out=logits, device=DEVICE)
                logits_seen[n].copy_(logits)
                step = session.sample(logits, out={"token_ids": tokens}, stream=stream, temperature=0.8, top_k=50,
                                      top_p=0.9, seed=seeds.numpy(), step=n)
                history[n].copy_(tokens)
            step.result()
        expected = torch.stack([kernels.sample(logits_seen[n], temperature=0.8, top_k=50, top_p=0.9,
                                               seed=seeds.to(DEVICE), step=n) for n in range(steps)])
        assert torch.equal(history, expected)


def test_a_standing_call_draws_each_step_with_no_call_and_a_call_ahead_takes_over(server):
    """One call serves every step (repeat), the engine only writing ready marks; a call sent at
    step 5 for step 9 (rows changing) takes over there."""
    rows, vocab, steps, switch = 4, 32000, 16, 9
    seeds = torch.arange(rows, dtype=torch.int64) + 4321
    with Client(server.target, timeout=300) as client:
        logits, tokens = _engine_buffers(client, rows, vocab)
        logits_seen = torch.empty(steps, rows, vocab, device=DEVICE)
        history = torch.full((steps, rows), -9, dtype=torch.int64, device=DEVICE)
        stream = torch.cuda.Stream()
        generator = torch.Generator(device=DEVICE).manual_seed(11)
        with client.ordered_session(max_steps_ahead=2) as session, torch.cuda.stream(stream):
            for n in range(steps):
                torch.cuda._sleep(SLOW_FORWARD_CYCLES // 4)
                torch.randn(rows, vocab, generator=generator, out=logits, device=DEVICE)
                logits_seen[n].copy_(logits)
                if n == 0:
                    step = session.sample(logits, out={"token_ids": tokens}, stream=stream, temperature=0.8, top_k=50,
                                          seed=seeds.numpy(), step=0, repeat=1000)
                else:
                    if n == 5:
                        session.sample(logits, out={"token_ids": tokens}, stream=stream, temperature=0.3,
                                       seed=seeds.numpy(), step=switch, repeat=1000, mark=switch + 1)
                    step = session.step(stream)
                history[n].copy_(tokens)
            assert step.mark == steps
            step.result()
        expected = torch.stack([
            kernels.sample(logits_seen[n], temperature=0.8, top_k=50, seed=seeds.to(DEVICE), step=n) if n < switch else
            kernels.sample(logits_seen[n], temperature=0.3, seed=seeds.to(DEVICE), step=n) for n in range(steps)])
        assert torch.equal(history, expected)


def test_penalties_and_a_grammar_mask_in_cuda_regions_are_ordered_too(server):
    """The engine keeps its output lists on the GPU and appends each step's tokens there, after
    the ordered call, on its stream: the next step's penalties read them after the append."""
    rows, vocab, steps = 4, 2048, 10
    seeds = torch.arange(rows, dtype=torch.int64) + 99
    with Client(server.target, timeout=300) as client:
        logits, tokens = _engine_buffers(client, rows, vocab)
        outputs = torch.zeros(rows, steps, dtype=torch.int64, device=DEVICE)  # row r's output: outputs[r, :n]
        offsets = torch.arange(0, rows * steps + 1, steps, dtype=torch.int64, device=DEVICE)
        mask = torch.full((rows, vocab // 32), -1, dtype=torch.int32, device=DEVICE)
        mask[:, : vocab // 64] = 0  # the first half of the vocabulary banned by the grammar
        for name, t in (("outputs", outputs), ("offsets", offsets), ("mask", mask)):
            client.register_cuda(name, t)
        logits_seen = torch.empty(steps, rows, vocab, device=DEVICE)
        lists_seen = torch.empty(steps, rows, steps, dtype=torch.int64, device=DEVICE)
        history = torch.full((steps, rows), -9, dtype=torch.int64, device=DEVICE)
        stream = torch.cuda.Stream()
        generator = torch.Generator(device=DEVICE).manual_seed(3)
        with client.ordered_session() as session, torch.cuda.stream(stream):
            for n in range(steps):
                torch.randn(rows, vocab, generator=generator, out=logits, device=DEVICE)
                logits_seen[n].copy_(logits)
                lists_seen[n].copy_(outputs)
                step = session.sample(logits, out={"token_ids": tokens}, stream=stream, temperature=0.7, seed=seeds.numpy(),
                                      step=n, repetition_penalty=1.5, presence_penalty=0.5,
                                      output_token_ids=outputs.view(-1), output_offsets=offsets, grammar_bitmask=mask)
                history[n].copy_(tokens)
                outputs[:, n].copy_(tokens)
            step.result()
        expected = torch.stack([kernels.sample(logits_seen[n], temperature=0.7, seed=seeds.to(DEVICE), step=n,
                                               repetition_penalty=1.5, presence_penalty=0.5,
                                               output_token_ids=lists_seen[n].view(-1), output_offsets=offsets,
                                               grammar_bitmask=mask) for n in range(steps)])
        assert torch.equal(history, expected)
        assert (history >= vocab // 2).all()  # the grammar's half only


def test_draws_by_sequence_ids_are_ordered_and_draw_what_a_synchronous_call_draws(server):
    """The same sequences twice (other ids, the same specs and seeds): one set drawn by ordered
    calls after slow forwards, the other by synchronous calls on the same logits afterwards; with
    penalties over each sequence's own output, every step's tokens equal, and the outputs too."""
    rows, vocab, steps = 4, 32000, 8
    spec = dict(prompt_token_ids=list(range(5, 40)), repetition_penalty=1.3, frequency_penalty=0.4,
                temperature=0.9, top_k=40)
    with Client(server.target, timeout=300) as client:
        logits, tokens = _engine_buffers(client, rows, vocab)
        ordered_ids, sync_ids = list(range(500, 500 + rows)), list(range(600, 600 + rows))
        for ids in (ordered_ids, sync_ids):
            client.open_sequences([dict(id=i, seed=77 + row, **spec) for row, i in enumerate(ids)])
        logits_seen = torch.empty(steps, rows, vocab, device=DEVICE)
        history = torch.full((steps, rows), -9, dtype=torch.int64, device=DEVICE)
        stream = torch.cuda.Stream()
        generator = torch.Generator(device=DEVICE).manual_seed(13)
        with client.ordered_session() as session, torch.cuda.stream(stream):
            for n in range(steps):
                torch.cuda._sleep(SLOW_FORWARD_CYCLES // 4)
                torch.randn(rows, vocab, generator=generator, out=logits, device=DEVICE)
                logits[:, 5:40].add_(2.0)  # the prompt's tokens likely: the penalties matter
                logits_seen[n].copy_(logits)
                session.sample(logits, out={"token_ids": tokens}, stream=stream, sequence_ids=ordered_ids)
                history[n].copy_(tokens)
            stream.synchronize()
        expected = [client.sample(logits_seen[n].cpu().numpy(), sequence_ids=sync_ids).token_ids for n in range(steps)]
        assert history.cpu().tolist() == [list(t) for t in expected]
        with pytest.raises(LogitServeError, match="ordered: not with sequence_steps"):
            with client.ordered_session() as again:
                again.sample(logits, out={"token_ids": tokens}, sequence_ids=ordered_ids, sequence_steps=[steps] * rows)
        client.close_sequences(ordered_ids + sync_ids)


def test_processor_fields_as_bytes_are_refused_for_ordered_calls(server):
    with Client(server.target, timeout=300) as client:
        logits, tokens = _engine_buffers(client, 2, 256)
        with client.ordered_session() as session:
            with pytest.raises(LogitServeError, match="must be CUDA regions"):
                session.sample(logits, out={"token_ids": tokens}, output_token_ids=[1, 2], output_offsets=[0, 1, 2],
                               repetition_penalty=1.2)


def test_a_mark_that_never_comes_ends_the_session_and_other_calls_go_on(server):
    rows, vocab = 2, 4096
    with Client(server.target, timeout=300) as client, Client(server.target, timeout=300) as other:
        logits, tokens = _engine_buffers(client, rows, vocab)
        stream = torch.cuda.Stream()
        session = client.ordered_session(wait_timeout_s=0.5)
        assert session.wait_timeout_s == 0.5
        with torch.cuda.stream(stream):
            # A step first, so that the kernels are compiled: a first step's enqueue may take
            # longer than the stall below, and then find its ready mark already written.
            session.sample(logits, out={"token_ids": tokens}, stream=stream, temperature=0.0).result()
            torch.cuda._sleep(SLOW_FORWARD_CYCLES * 300)  # ~3 s before the ready mark: past the limit
            step = session.sample(logits, out={"token_ids": tokens}, stream=stream, temperature=0.0)
        start = time.monotonic()
        answer = other.sample(torch.randn(rows, vocab).numpy(), temperature=0.0)  # not held up by the wait
        print(f"another client's call during the stalled step: {time.monotonic() - start:.3f} s")
        assert answer.valid.all()
        with pytest.raises(LogitServeError) as caught:
            step.result()
        assert caught.value.code.name == "FAILED_PRECONDITION" and "wait_timeout_s" in caught.value.details
        assert session.ended.first_broken_mark == 2
        with pytest.raises(LogitServeError, match="ended"):
            session.sample(logits, out={"token_ids": tokens}, stream=stream)
        session.close()


def test_a_stalled_engine_holds_no_other_callers_work(server):
    """The engine's stream never reaches its ready mark (held by a wait on a word of its own,
    the GPU's front end, no kernel running): the server's step waits, and another client's calls
    are answered meanwhile, unlike behind an engine's long kernel (the test above: without MPS a
    kernel of one process holds the other's work until it ends)."""
    from cuda.bindings import driver

    rows, vocab = 2, 4096
    with Client(server.target, timeout=300) as client, Client(server.target, timeout=300) as other:
        logits, tokens = _engine_buffers(client, rows, vocab)
        other.sample(torch.randn(rows, vocab).numpy(), temperature=0.0)  # compiled before the clock starts
        gate = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        stream, side = torch.cuda.Stream(), torch.cuda.Stream()
        session = client.ordered_session(wait_timeout_s=2.0)
        driver.cuStreamWaitValue64(driver.CUstream(stream.cuda_stream), driver.CUdeviceptr(gate.data_ptr()), 1,
                                   driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        try:
            step = session.sample(logits, out={"token_ids": tokens}, stream=stream, temperature=0.0)
            times = []
            for _ in range(5):
                start = time.monotonic()
                assert other.sample(torch.randn(rows, vocab).numpy(), temperature=0.0).valid.all()
                times.append(time.monotonic() - start)
            print(f"another client's calls while a step waits for its mark: {[round(t, 4) for t in times]} s")
            assert session.ended is None and max(times) < 1.0  # answered long before the 2 s limit
        finally:
            with torch.cuda.stream(side):
                gate.fill_(1)  # the engine's stream goes on: its mark comes, its step runs
        step.result()
        session.close()


ENGINE = textwrap.dedent("""
    import sys, torch
    from logitserve.client import Client
    client = Client(sys.argv[1], timeout=300, region_scope="killed")
    logits = torch.zeros(2, 4096, device="cuda:0"); tokens = torch.zeros(2, dtype=torch.int64, device="cuda:0")
    client.register_cuda("logits", logits); client.register_cuda("tokens", tokens)
    client.register_cuda("kept", torch.zeros(8, device="cuda:0"))
    session = client.ordered_session(owned_regions=("logits", "tokens"))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # the mark comes long after this process is killed
        session.sample(logits, out={"token_ids": tokens}, stream=stream, temperature=0.0)
    print("enqueued", flush=True)
    sys.stdin.read()
""")


def test_a_killed_engine_frees_its_session_and_the_regions_it_owned_at_once():
    pytest.importorskip("cuda.bindings")
    with ServerProcess("--warmup-dtypes", "none", "--max-ordered-sessions", "1", "--ordered-wait-s", "60",
                       device=DEVICE, backend="triton", start_timeout=900) as server:
        engine = subprocess.Popen([sys.executable, "-c", ENGINE, server.target], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        try:
            assert engine.stdout.readline().strip() == "enqueued"
            with Client(server.target, timeout=300) as client:
                with pytest.raises(LogitServeError, match="RESOURCE_EXHAUSTED|--max-ordered-sessions"):
                    client.ordered_session()  # the engine's session holds the only place
                engine.send_signal(signal.SIGKILL)
                engine.wait(30)
                killed = time.monotonic()
                while True:  # its session ends when its call does, not after --ordered-wait-s (60 s)
                    try:
                        session = client.ordered_session()
                        break
                    except LogitServeError:
                        assert time.monotonic() - killed < 10, "the dead engine's session was not freed"
                        time.sleep(0.05)
                print(f"a killed engine's session freed after {time.monotonic() - killed:.3f} s")
                session.close()
                # The regions the session owned went with it; the engine's other region stays.
                left = [r.server_name for r in client.shared_memory_status(all_of_caller=True)]
                assert left == ["killed.kept"], left
        finally:
            engine.kill()
            engine.wait(30)
