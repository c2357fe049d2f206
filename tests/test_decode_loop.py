"""bench.decode_loop's pure parts, on the CPU (no GPU, no server): the matrix's arguments and
features, the token comparison, the calibration's arithmetic on made-up timings, the summary and
its table, the budget's forecast, and the penalties_bitmask feature's tensors (made on the CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench import decode_features
from bench.decode_engine import ForwardModel, calibrate, compare_tokens, fit, layers_for
from bench.decode_loop import (MODES, forecast_s, header, parse_args, summarize, table, tokens_verdict,
                               write_results)


def test_the_default_matrix_is_every_mode_at_every_batch_and_step_time():
    args = parse_args([])
    assert args.batch == [1, 32, 256]
    assert args.step_ms == [5.0, 2.0, 20.0]
    assert args.modes == list(MODES)
    assert args.features == ["plain", "penalties_bitmask", "sequences"]
    assert (args.repeats, args.steps, args.warmup, args.hidden, args.vocab) == (3, 200, 10, 8192, 128256)
    assert args.budget_s < 540  # ends, with its shutdown, inside a 10-minute command


def test_subsets_keep_the_reference_first_and_the_modes_in_order():
    args = parse_args(["--batch", "32", "--step-ms", "2.5,20", "--modes", "ordered_channel,sync_grpc"])
    assert args.batch == [32] and args.step_ms == [2.5, 20.0]
    assert args.modes == ["in_process", "sync_grpc", "ordered_channel"]


@pytest.mark.parametrize("argv, features", [
    ([], ["plain", "penalties_bitmask", "sequences"]), (["--step-ms", "2,20"], ["plain"]),  # default: those that run there
    (["--features", "penalties_bitmask,plain"], ["plain", "penalties_bitmask"]),
    (["--features", "penalties_bitmask", "--step-ms", "5.0"], ["penalties_bitmask"]),
])
def test_features_run_where_they_can(argv, features):
    assert parse_args(argv).features == features


def test_penalties_and_sequences_run_at_5_ms_only():
    chosen = list(decode_features.FEATURES)
    assert decode_features.cell_features(5.0, chosen) == ["plain", "penalties_bitmask", "sequences"]
    assert decode_features.cell_features(2.0, chosen) == decode_features.cell_features(20.0, chosen) == ["plain"]
    assert decode_features.cell_features(2.0, ["penalties_bitmask"]) == []


@pytest.mark.parametrize("argv", [["--modes", "in_process,async"], ["--batch", "0,32"], ["--batch", "a"],
                                  ["--step-ms", "-2"], ["--steps", "1"], ["--repeats", "0"],
                                  ["--features", "plain,grammar"],
                                  ["--features", "penalties_bitmask", "--step-ms", "2,20"]])
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


CELL = dict(step_ms=5.0, batch=32, feature="plain", layers=108, calibrated_forward_ms=4.95, logit_std=2.5, runs=[
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
    assert lines[0].startswith("| step ms | B | feature |") and len(lines) == 2 + 3
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[3] == ("| 5 | 32 | plain | 108 | 4.90 | sync_grpc | 5.450 | 5.500, 5.400 | 340.0 | 445.0 |  "
                        "| **no**: 4 steps in 1 of 2 runs, first at step 206 |")
    assert "error: LogitServeError: UNAVAILABLE" in lines[4]


def test_table_rows_name_their_feature():
    penalties = dict(CELL, feature="penalties_bitmask", runs=CELL["runs"][:2])
    rows = summarize([CELL, penalties])
    assert [r["feature"] for r in rows] == ["plain"] * 3 + ["penalties_bitmask"] * 2
    assert table(rows)[-1].startswith("| 5 | 32 | penalties_bitmask | 108 | 4.90 | sync_grpc | 5.500 |")


META = dict(date="2026-12-08T10:00:00", gpu="NVIDIA H100 80GB HBM3", commit="f9216f1", torch="2.13.0",
            command="python -m bench.decode_loop --out d.json", hidden=8192, vocab=128256, steps=200, warmup=10,
            repeats=3, features=decode_features.describe(["plain", "penalties_bitmask"]),
            skipped={"ordered_channel": "no ordered_session"}, stopped="at 470 s, before sync_grpc")


def test_header_names_the_gpu_commit_command_skips_and_early_stop():
    text = "\n".join(header(META))
    for part in ("NVIDIA H100 80GB HBM3", "commit f9216f1", "`python -m bench.decode_loop --out d.json`",
                 "Skipped ordered_channel: no ordered_session", "Stopped early: at 470 s",
                 "plain (T 0.8, top_k 50, top_p 0.9) at every step time", "penalties_bitmask (plain after",
                 "at 5 ms only"):
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


def test_penalties_bitmask_passes_its_lists_and_bitmask_registered_once_per_batch_size():
    registered = []

    class Client:
        def register_cuda(self, name, tensor):
            registered.append((name, tensor))

    lists = decode_features.Lists(vocab=100, device="cpu", register_all=lambda register: register(Client()))
    assert lists.params("plain", 3) == dict(temperature=0.8, top_k=50, top_p=0.9) and not registered
    params = lists.params("penalties_bitmask", 3)
    assert lists.params("penalties_bitmask", 3)["grammar_bitmask"] is params["grammar_bitmask"]
    assert sorted(name for name, _ in registered) == [
        "grammar_bitmask-3", "output_offsets-3", "output_token_ids-3", "prompt_offsets-3", "prompt_token_ids-3"]
    assert all(params[name.rsplit("-", 1)[0]] is tensor for name, tensor in registered)
    assert (params["repetition_penalty"], params["frequency_penalty"], params["presence_penalty"]) == (1.1, 0.2, 0.3)
    assert params["prompt_token_ids"].shape == (3 * 256,) and params["output_token_ids"].shape == (3 * 1024,)
    assert params["prompt_offsets"].tolist() == [0, 256, 512, 768]
    assert params["output_offsets"].tolist() == [0, 1024, 2048, 3072]
    for ids in (params["prompt_token_ids"], params["output_token_ids"]):
        assert ids.dtype == torch.int64 and 0 <= ids.min() and ids.max() < 100
    again = decode_features.processor_tensors(3, 100, "cpu")
    assert all(torch.equal(again[name], params[name]) for name in again)  # seeded: every run alike


def test_the_bitmask_allows_about_half_and_never_nothing_nor_past_the_vocabulary():
    mask = decode_features.processor_tensors(8, 1000, "cpu")["grammar_bitmask"]
    assert mask.dtype == torch.int32 and mask.shape == (8, 32)  # ceil(1000 / 32)
    bits = (mask.to(torch.int64).unsqueeze(2) >> torch.arange(32)) & 1
    allowed = bits.reshape(8, -1).bool()
    assert not allowed[:, 1000:].any() and allowed[:, 0].all()
    assert 0.4 < allowed[:, :1000].float().mean() < 0.6


def test_the_kernels_take_the_feature_and_draw_only_allowed_tokens():
    from logitserve import kernels

    params = decode_features.Lists(500, "cpu", lambda register: None).params("penalties_bitmask", 4)
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(0)) * 3
    tokens = kernels.sample(logits, **params, seed=torch.arange(4) + 1234, step=0)
    words = params["grammar_bitmask"].to(torch.int64)[torch.arange(4), tokens // 32]
    assert ((words >> (tokens % 32)) & 1).all()


def test_the_sequences_feature_draws_in_process_what_the_server_draws_by_sequence_ids():
    """bench/decode_sequences.py's floor keeps the rows' outputs as the server does: a CPU server's
    draws by sequence ids (opened from the feature's specs) equal ``kernels.sample`` over the
    lists ``Outputs`` keeps, step after step."""
    from logitserve import kernels
    from logitserve.client import Client
    from logitserve.server import ServerConfig
    from logitserve.server.testing import ServerThread

    from bench.decode_sequences import FIRST_ID, Outputs, specs

    batch, vocab, steps = 3, 300, 4
    params = decode_features.Lists(vocab, "cpu", lambda register: None).params("sequences", batch)
    assert params["sequences"] and params["repetition_penalty"] == 1.1
    outputs = Outputs(params, batch, steps)
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=())
    generator = torch.Generator().manual_seed(3)
    with ServerThread(config) as server, Client(server.target) as client:
        client.open_sequences(specs(batch, params))
        for n in range(steps):
            logits = torch.randn(batch, vocab, generator=generator) * 4
            logits[:, :40] += 3  # the lists' tokens among the likely ones: the penalties matter
            served = client.sample(logits.numpy(), sequence_ids=[FIRST_ID + r for r in range(batch)],
                                   grammar_bitmask=params["grammar_bitmask"].numpy())
            here = kernels.sample(logits, **outputs.keywords(), seed=torch.arange(batch) + 1234, step=n)
            assert served.token_ids.tolist() == here.tolist(), n
            outputs.grow(here)
