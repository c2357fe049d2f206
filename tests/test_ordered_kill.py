"""bench.ordered_kill's windows over the survivor's step stamps (the GPU run itself is the bench's)."""

import numpy as np

from bench.ordered_kill import _window


def test_a_window_counts_the_steps_completed_in_it_but_not_those_in_a_quiet_span():
    stamps = np.array([0.0, 0.005, 0.010, 0.140, 0.145, 0.150])  # one 130 ms step, during a query
    assert _window(stamps, 0.0, 1.0, [])["max_ms"] == 130.0
    counted = _window(stamps, 0.0, 1.0, [(0.012, 0.141)])
    assert counted["steps"] == 4 and np.isclose(counted["max_ms"], 5.0) and np.isclose(counted["median_ms"], 5.0)
    assert _window(stamps, 0.146, 1.0, [])["steps"] == 1
    assert _window(stamps, 2.0, 3.0, []) == {"steps": 0}
