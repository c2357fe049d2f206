"""bench.decode_loop's pure parts, on the CPU (no GPU, no server): the matrix's arguments, the
token comparison, the calibration's arithmetic on made-up timings, the summary and its table,
and the budget's forecast."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.decode_engine import ForwardModel, calibrate, compare_tokens, fit, layers_for
from bench.decode_loop import (MODES, forecast_s, header, parse_args, summarize, table, tokens_verdict,
                               write_results)


def test_the_default_matrix_is_every_mode_at_every_batch_and_step_time():
    args = parse_args([])
    assert args.batch == [1, 32, 256]
    assert args.step_ms == [5.0, 2.0, 20.0]
    assert args.modes == list(MODES)
    assert (args.repeats, args.steps, args.warmup, args.hidden, args.vocab) == (3, 200, 10, 8192, 128256)
    assert args.budget_s < 540  # ends, with its shutdown, inside a 10-minute command


def test_subsets_keep_the_reference_first_and_the_modes_in_order():
    args = parse_args(["--batch", "32", "--step-ms", "2.5,20", "--modes", "ordered_channel,sync_grpc"])
    assert args.batch == [32] and args.step_ms == [2.5, 20.0]
    assert args.modes == ["in_process", "sync_grpc", "ordered_channel"]


@pytest.mark.parametrize("argv", [["--modes", "in_process,async"], ["--batch", "0,32"], ["--batch", "a"],
                                  ["--step-ms", "-2"], ["--steps", "1"], ["--repeats", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_compare_tokens_counts_the_steps_that_differ_and_the_first():
    reference = np.arange(12).reshape(6, 2)
    assert compare_tokens(reference, reference.copy()) == {"steps": 0, "first": None}
    diverged = reference.copy()
    diverged[3:, 1] += 1  # one row from step 3 on: every later step differs
    assert compare_tokens(reference, diverged) == {"steps": 3, "first": 3}
    assert compare_tokens(reference, reference[:4]) == {"steps": 6, "first": 0}


def test_tokens_verdict():
    same, off = {"steps": 0, "first": None}, {"steps": 5, "first": 7}
    assert tokens_verdict([{"mismatch": same}, {"mismatch": same}]) == "yes"
    assert tokens_verdict([{"mismatch": None}]) == "n/a"
    assert tokens_verdict([{"mismatch": same}, {"mismatch": off}]) == "**no**: 5 steps in 1 of 2 runs, first at step 7"


def test_fit_and_layers_for():
    model = fit(2, 0.78, 34, 2.06)
    assert model.fixed_ms == pytest.approx(0.7) and model.per_layer_ms == pytest.approx(0.04)
    assert layers_for(5.0, model) == 108  # (5 - 0.7) / 0.04 = 107.5
    assert layers_for(0.5, model) == 1  # under the fixed part: the least depth, reported as measured
    assert fit(2, 1.0, 34, 0.9).per_layer_ms > 0  # noise cannot make a layer free


def test_calibrate_meets_the_target_on_a_linear_forward():
    measured = []

    def measure(layers):
        measured.append(layers)
        return 0.7 + 0.04 * layers

    layers, ms = calibrate(measure, 20.0, fit(2, measure(2), 34, measure(34)), tolerance=0.1)
    assert abs(ms - 20.0) <= 2.0 and layers == round(19.3 / 0.04)
    assert len(measured) == 3  # the probes and one build


def test_calibrate_rescales_when_the_layers_get_slower_with_depth():
    def measure(layers):  # each layer past 50 costs twice the probes' rate
        return 0.7 + 0.04 * layers + 0.04 * max(layers - 50, 0)

    model = ForwardModel(0.7, 0.04)
    layers, ms = calibrate(measure, 20.0, model, tolerance=0.1)
    assert abs(ms - 20.0) <= 2.0
    assert layers < layers_for(20.0, model)


def test_calibrate_returns_the_closest_when_the_target_cannot_be_met():
    layers, ms = calibrate(lambda layers: 3.0 + 0.01 * layers, 2.0, ForwardModel(3.0, 0.01), tolerance=0.1)
    assert (layers, ms) == (1, 3.01)


def _run(mode, ms, gap, repeat=0, mismatch=None, kernel=None):
    return dict(mode=mode, repeat=repeat, ms_per_step=ms, forward_ms_median=4.9, gap_us_median=gap,
                kernel_us_median=kernel, notes=[], mismatch=mismatch or {"steps": 0, "first": None})


CELL = dict(step_ms=5.0, batch=32, features="plain", layers=108, calibrated_forward_ms=4.95, logit_std=2.5, runs=[
    _run("in_process", 5.10, 60.0, kernel=55.0), _run("sync_grpc", 5.50, 450.0),
    _run("in_process", 5.12, 62.0, 1, kernel=56.0), _run("sync_grpc", 5.40, 440.0, 1, {"steps": 4, "first": 206}),
    dict(mode="ordered_grpc", repeat=0, error="LogitServeError: UNAVAILABLE"),
])


def test_summary_takes_medians_and_the_difference_to_in_process():
    rows = {r["mode"]: r for r in summarize([CELL])}
    assert list(rows) == ["in_process", "sync_grpc", "ordered_grpc"]
    assert rows["in_process"]["ms_per_step"] == pytest.approx(5.11) and rows["in_process"]["added_us"] is None
    assert rows["in_process"]["kernel_us"] == pytest.approx(55.5)
    assert rows["sync_grpc"]["ms_per_step"] == pytest.approx(5.45)
    assert rows["sync_grpc"]["added_us"] == pytest.approx(340.0)
    assert rows["sync_grpc"]["gap_us"] == pytest.approx(445.0)
    assert rows["sync_grpc"]["tokens"].startswith("**no**: 4 steps in 1 of 2 runs")
    assert rows["ordered_grpc"]["ms_per_step"] is None and rows["ordered_grpc"]["errors"]


def test_table_has_a_row_per_mode_with_its_numbers():
    lines = table(summarize([CELL]))
    assert lines[0].startswith("| step ms | B |") and len(lines) == 2 + 3
    assert lines[3] == ("| 5 | 32 | 108 | 4.90 | sync_grpc | 5.450 | 5.500, 5.400 | 340.0 | 445.0 |  "
                        "| **no**: 4 steps in 1 of 2 runs, first at step 206 |")
    assert "error: LogitServeError: UNAVAILABLE" in lines[4]


META = dict(date="2026-12-08T10:00:00", gpu="NVIDIA H100 80GB HBM3", commit="f9216f1", torch="2.13.0",
            command="python -m bench.decode_loop --out d.json", hidden=8192, vocab=128256, steps=200, warmup=10,
            repeats=3, features="plain (temperature 0.8, top_k 50, top_p 0.9)",
            skipped={"ordered_channel": "no ordered_session"}, stopped="at 470 s, before sync_grpc")


def test_header_names_the_gpu_commit_command_skips_and_early_stop():
    text = "\n".join(header(META))
    for part in ("NVIDIA H100 80GB HBM3", "commit f9216f1", "`python -m bench.decode_loop --out d.json`",
                 "Skipped ordered_channel: no ordered_session", "Stopped early: at 470 s"):
        assert part in text


def test_results_are_written_as_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "decode.json"
    write_results(dict(META), [CELL], str(out), final=False)
    partial = json.loads(out.read_text())
    assert partial["partial"] and partial["table"] is None and not (tmp_path / "decode.md").exists()
    write_results(dict(META), [CELL], str(out), final=True)
    final = json.loads(out.read_text())
    assert not final["partial"] and len(final["summary"]) == 3
    assert (tmp_path / "decode.md").read_text().strip() == final["table"]
    assert "| sync_grpc |" in capsys.readouterr().out


def test_forecast_uses_the_slowest_run_of_the_cell_so_far():
    assert forecast_s(200, 10, 5.0, []) == pytest.approx(210 * 5.0 / 1e3 + 1.0)
    runs = [dict(ms_per_step=5.2), dict(mode="x", error="e"), dict(ms_per_step=6.0)]
    assert forecast_s(200, 10, 5.0, runs) == pytest.approx(210 * 6.0 / 1e3 + 1.0)
