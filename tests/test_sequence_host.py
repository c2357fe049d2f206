"""bench.sequence_host's measured pass runs the server's sequence path end to end on the CPU
(a stand-in launch): a call's rows drawn, counted and kept, as the bench times them."""

import asyncio

from bench.sequence_host import _measure


def test_the_host_pass_runs_a_call_by_sequence_ids():
    assert asyncio.run(_measure(batch=4, calls=2)) > 0
