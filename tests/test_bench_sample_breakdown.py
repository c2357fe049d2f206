"""bench.sample_breakdown's smoke mode: on the CPU, interpreted, at 2x1000, it lists the launches a
SamplePlan takes for each case with the bytes of the logits each reads, and the passes a case
takes over the row (its GPU timings need a CUDA device)."""

import re

from bench.sample_breakdown import CASES, DTYPES, main


def test_the_smoke_run_lists_each_cases_launches_and_passes(tmp_path):
    out = tmp_path / "breakdown.md"
    assert main(["--smoke", "--out", str(out)]) == 0
    text = out.read_text()
    launches = {}
    for dtype in DTYPES:
        for case in CASES:
            row = re.search(rf"^\| 2x1000 \| {dtype} \| {re.escape(case)} \| (\d+) \| ([^|]+) \| - \| - \| - \| - \|$",
                            text, re.M)
            assert row, (dtype, case)
            launches[dtype, case] = int(row[1]), row[2].strip()
            names = re.findall(rf"^\| 2x1000 \| {dtype} \| {re.escape(case)} \| (_\w+) \|", text, re.M)
            assert names[0] == "_stats_merge" and len(names) == int(row[1]), (case, names)
    # Greedy ends with the merge: one pass. Top-k re-reads a few groups, not the row; top_p without
    # top_k adds the check's pass over the row and leaves the walk's rejections uncounted.
    assert launches["f32", "greedy"] == (1, "1.00")
    assert launches["f32", "T .8"] == (3, "2.00")
    assert launches["f32", "T .8 k 50 p .9"][0] == 3 and 1 < float(launches["f32", "T .8 k 50 p .9"][1]) < 2
    assert launches["f32", "T .8 p .9"] == (4, ">= 3.00")
    assert "| _check |" in text and "a pass a walk rejection" in text
