"""Ordered draws by sequence ids off the GPU: a real sequence table, the session's table and enqueue
path, and a stand-in launch thread whose "device" stores each step's tokens where the kernels'
append would (tests/test_ordered_cuda.py runs the real launch). What is checked is the host's
part: a step's rows held from its enqueue until it is done (no other call draws them), its
tokens counted then (output, step, last draw), and a session's next draw by sequence ids
answered at once but enqueued only once the step before it is done."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from logitserve.server.ops.limits import Limits
from logitserve.server.ops.sample import SampleCall
from logitserve.server.ordered import SessionTable, check_orderable, enqueue_sample
from logitserve.server.ordered import sample as ordered_sample
from logitserve.server.ordered import table as table_module
from logitserve.server.sequences.bounds import SequenceBounds
from logitserve.server.sequences.open import open_specs
from logitserve.server.sequences.sample import SequenceRows
from logitserve.server.sequences.sequence import StepMismatch
from logitserve.server.sequences.table import SequenceTable
from logitserve.v1 import logitserve_pb2 as pb

from test_ordered_table import Event, Gpu, Handle, Regions, _until

VOCAB = 16


class SequenceHandle(Handle):
    """The launch thread of a draw by sequence ids: the table's reserve (real), then each row's
    token stored after its output as the launch's append does; the tokens' "host copy"."""

    def __init__(self, tokens: list[list[int]]):
        super().__init__()
        self.tokens = tokens  # each step's tokens, in order

    async def enqueue(self, fn, call, gpu, mark, _handle, *state_rows):
        if fn is not ordered_sample._enqueue_sequences:
            return await super().enqueue(fn, call, gpu, mark, _handle)
        rows = call.sequences
        rows.table.reserve(rows.sequences)
        tokens = self.tokens[mark - 1]
        for seq, token in zip(rows.sequences, tokens):
            if token >= 0:
                seq.output[seq.output_len] = token
        self.steps.append((mark, [seq.step for seq in rows.sequences]))
        event = self.events[id(gpu), mark] = Event()
        return event, torch.tensor(tokens)


def _sequence_call(seq_table: SequenceTable, sequences) -> SampleCall:
    logits = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[len(sequences), VOCAB],
                       data=np.zeros((len(sequences), VOCAB), np.float32).tobytes())
    call = SampleCall.from_pb(pb.SampleRequest(logits=logits), Limits(max_rows=8, max_vocab=VOCAB))
    call.sequences = SequenceRows(seq_table, list(sequences), VOCAB, "")
    call.regions = Regions()
    return call


async def _two_sequences_in_a_session():
    """Sequences 1 and 2 (seeds 1, 2) open in a real table, and an ordered session whose stand-in
    device draws [3, 4] then [5, 6]: (sequence table, sequences, handle, session table, session)."""
    seq_table = SequenceTable(SequenceBounds(64, 1 << 20), idle_s=60, device=torch.device("cpu"))
    seqs = await open_specs(seq_table, [pb.SequenceSpec(id=i, seed=i) for i in (1, 2)], None, VOCAB)
    handle = SequenceHandle([[3, 4], [5, 6]])
    table = SessionTable(handle, 4, 4, wait_timeout_s=5)
    return seq_table, seqs, handle, table, await table.open(None, 0, 0)


@pytest.fixture
def sessions(monkeypatch):
    monkeypatch.setattr(table_module, "POLL_S", 0.001)
    monkeypatch.setattr(table_module, "available", lambda: None)


def test_a_draw_by_sequence_ids_holds_its_rows_until_done_and_counts_its_tokens_then(sessions):
    async def scenario():
        seq_table = SequenceTable(SequenceBounds(64, 1 << 20), idle_s=60, device=torch.device("cpu"))
        specs = [pb.SequenceSpec(id=i, prompt_token_ids=[1, 2], seed=10 + i, temperature=0.5) for i in (1, 2)]
        seqs = await open_specs(seq_table, specs, None, VOCAB)
        handle = SequenceHandle([[3, 4], [5, -1]])
        table = SessionTable(handle, 4, 4, wait_timeout_s=5)
        session = await table.open(None, 0, 0)

        first = _sequence_call(seq_table, seqs)
        await enqueue_sample(table, session, first, 1)
        assert first.seeds() == [11, 12]  # the sequences' seeds, for the call's answer
        with pytest.raises(StepMismatch, match=r"sequence_ids\[0\]: sequence 1 is in the draw of ordered session"):
            seq_table.check_open(seqs)  # another call, of this caller or not, waits its turn
        assert [(s.step, s.output_len) for s in seqs] == [(0, 0), (0, 0)]

        # The next call returns at once, promised: its step waits on the host for the first's count.
        await asyncio.wait_for(enqueue_sample(table, session, _sequence_call(seq_table, seqs), 2), 1)
        await asyncio.sleep(0.02)
        assert [m for m, _ in handle.steps] == [1]  # its state is the first's result: not enqueued yet

        handle.pass_step(session, 1)
        await _until(lambda: len(handle.steps) == 2)
        assert handle.steps[1] == (2, [1, 1])  # enqueued after the first was counted, at the next step
        assert [s.outputs().tolist() for s in seqs] == [[3], [4]] and [s.last.token for s in seqs] == [3, 4]

        handle.pass_step(session, 2)
        await _until(lambda: not session.pending)
        assert [s.outputs().tolist() for s in seqs] == [[3, 5], [4]]  # -1: nothing drawn, nothing stored
        assert [s.step for s in seqs] == [2, 2] and all(s.ordered is None for s in seqs)
        seq_table.check_open(seqs)  # free for any call again

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_an_ordered_draw_by_sequence_ids_may_not_name_steps():
    """A retry is the mark's business (a mark enqueued already is refused as such), not sequence_steps'."""
    call = SampleCall.from_pb(pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 4],
                                                                data=bytes(16))), Limits(max_rows=8, max_vocab=4))
    call.sequences = SequenceRows(None, [], 4, "", steps=[0])
    with pytest.raises(ValueError, match="ordered: not with sequence_steps"):
        check_orderable(call, torch.device("cuda", 0))


def test_sequences_closed_during_a_step_and_a_faulted_step_leave_nothing_counted_or_held(sessions):
    """Closed while its draw is on the GPU: the step still counts its token into the (closed)
    sequence, and the table holds nothing for it after. A step whose device faulted counts
    nothing and lets its rows go."""
    async def scenario():
        seq_table, seqs, handle, table, session = await _two_sequences_in_a_session()

        await enqueue_sample(table, session, _sequence_call(seq_table, seqs), 1)
        assert seq_table.close(None, [1]) == [1]
        handle.pass_step(session, 1)
        await _until(lambda: not session.pending)
        assert seqs[0].outputs().tolist() == [3] and seqs[0].ordered is None
        assert seq_table.stats(None)["open_sequences"] == 1
        assert seq_table.stats(None)["sequence_bytes"] == seqs[1].nbytes  # the closed one's bytes gone

        await enqueue_sample(table, session, _sequence_call(seq_table, seqs[1:]), 2)
        session.pending[0].retired(False)  # as retire_all does for a faulted context
        assert seqs[1].ordered is None and seqs[1].step == 1 and seqs[1].outputs().tolist() == [4]

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_promised_draw_whose_sequence_closed_meanwhile_ends_the_session_with_the_reason(sessions):
    """The next draw, promised while the step before is on the GPU, is enqueued when that step is
    done; a sequence of it closed in between cannot be drawn: the session ends, saying why."""
    async def scenario():
        seq_table, seqs, handle, table, session = await _two_sequences_in_a_session()

        await enqueue_sample(table, session, _sequence_call(seq_table, seqs), 1)
        await asyncio.wait_for(enqueue_sample(table, session, _sequence_call(seq_table, seqs), 2), 1)
        assert seq_table.close(None, [2]) == [2]
        handle.pass_step(session, 1)
        await _until(lambda: session.ended is not None)
        assert "enqueueing mark 2 failed" in session.ended and "sequence 2 was closed" in session.ended
        assert [m for m, _ in handle.steps] == [1] and seqs[0].ordered is None

    asyncio.run(asyncio.wait_for(scenario(), 10))
