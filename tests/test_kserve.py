"""The KServe v2 / Triton front driven by ``tritonclient[grpc]`` from PyPI, unchanged, against a
server process: every model, streams with a bad request in the middle, system shared memory,
CUDA shared memory (where CUDA is present: a server on cuda:0), health, metadata, configuration,
statistics, bad input, auth; results equal to logitserve.v1's.

tritonclient pins protobuf < 7, which the server's stack refuses, so it runs
tests/kserve_tritonclient.py in a process of its own, from one of:

- ``LOGITSERVE_TRITONCLIENT_PYTHONPATH`` set: this interpreter with that PYTHONPATH (and no
  other), a directory of unpacked wheels of tritonclient, protobuf < 7, python-rapidjson,
  ml-dtypes and packaging; the rest (numpy, grpcio, and cuda-python for CUDA shared memory) from
  this interpreter's own site-packages. For machines with no network, such as the GPU host.
- otherwise a virtual environment (``LOGITSERVE_TRITONCLIENT_VENV``, default
  ``.venv-tritonclient`` at the checkout's root, git-ignored, made once and kept: a stamp file
  names what was installed).

Either way the child gets this process's environment without its PYTHONPATH and PYTHONHOME,
which point at the server's packages (protobuf 7 among them). Without tritonclient (no network,
no index, no wheels) these tests fail, saying why: they never skip.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from logitserve.client import Client
from logitserve.server.process import ServerProcess

ROOT = pathlib.Path(__file__).resolve().parents[1]
VENV = pathlib.Path(os.environ.get("LOGITSERVE_TRITONCLIENT_VENV", ROOT / ".venv-tritonclient"))
SITE = os.environ.get("LOGITSERVE_TRITONCLIENT_PYTHONPATH")
REQUIREMENTS = ("tritonclient[grpc]", "numpy")
STAMP = VENV / ".logitserve-stamp"
SCRIPT = ROOT / "tests/kserve_tritonclient.py"
TOKEN = "kserve-test-token"
SAMPLE = {"seed": 1234, "temperature": 0.7, "top_k": 50, "top_p": 0.9}  # as the script's PARAMS
VERIFY = {"seed": 99, "top_k": 5}


def child_env(pythonpath: str | None = None) -> dict:
    """This process's environment, read now, without PYTHONPATH and PYTHONHOME (here they point
    at the server's packages, protobuf 7 among them); ``pythonpath`` alone in their place."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return env


@dataclass(frozen=True)
class TritonPython:
    """An interpreter that imports tritonclient, and the PYTHONPATH it needs (None: none)."""

    python: str
    pythonpath: str | None = None


def _venv_python() -> pathlib.Path:
    """The tritonclient venv's python, made on first use and reused (stamp file)."""
    python = VENV / "bin/python"
    wanted = " ".join(REQUIREMENTS)
    if python.exists() and STAMP.exists() and STAMP.read_text() == wanted:
        return python
    steps = ([sys.executable, "-m", "venv", "--clear", str(VENV)],
             [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *REQUIREMENTS])
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=600, env=child_env())
        if done.returncode:
            pytest.fail(f"cannot make the tritonclient virtual environment at {VENV} ({' '.join(step)} exited "
                        f"{done.returncode}); these tests need pip to reach PyPI or a mirror of it, or "
                        f"LOGITSERVE_TRITONCLIENT_PYTHONPATH set to unpacked wheels:\n"
                        f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}", pytrace=False)
    STAMP.write_text(wanted)
    return python


@pytest.fixture(scope="session")
def triton_python() -> TritonPython:
    """How to run the tritonclient script (the module docstring says which is chosen)."""
    if SITE is None:
        return TritonPython(str(_venv_python()))
    triton = TritonPython(sys.executable, SITE)
    done = subprocess.run([triton.python, "-c", "import tritonclient.grpc"], capture_output=True, text=True,
                          timeout=120, env=child_env(triton.pythonpath))
    if done.returncode:
        pytest.fail(f"{triton.python} with PYTHONPATH={SITE} (LOGITSERVE_TRITONCLIENT_PYTHONPATH) cannot import "
                    f"tritonclient.grpc:\n{done.stderr[-2000:]}", pytrace=False)
    return triton


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--warmup-dtypes", "none") as s:
        yield s


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    rng = np.random.default_rng(7)
    arrays = {
        "sample.LOGITS": rng.standard_normal((4, 1000)).astype(np.float32),
        "route_experts.GATE_LOGITS": rng.standard_normal((5, 16)).astype(np.float32),
        "softmax.X": rng.standard_normal((3, 70)).astype(np.float32),
        "causal_softmax.X": rng.standard_normal((2, 3, 9)).astype(np.float32),
        "silu.X": rng.standard_normal((3, 33)).astype(np.float32),
        "swiglu.GATE": rng.standard_normal((3, 33)).astype(np.float32),
        "swiglu.UP": rng.standard_normal((3, 33)).astype(np.float32),
        "verify_draft.DRAFT_TOKEN_IDS": rng.integers(0, 16, (3, 2)).astype(np.int64),
        "verify_draft.DRAFT_PROBS": rng.dirichlet(np.ones(16), (3, 2)).astype(np.float32),
        "verify_draft.TARGET_LOGITS": rng.standard_normal((3, 3, 16)).astype(np.float32),
    }
    path = tmp_path_factory.mktemp("kserve") / "in.npz"
    np.savez(path, **arrays)
    return path, arrays


def drive(triton: TritonPython, target: str, scenarios: str, data_path, tmp_path, token: str | None = None):
    out = tmp_path / "out.npz"
    done = subprocess.run([triton.python, str(SCRIPT), target, scenarios, str(data_path), str(out),
                           *([token] if token else [])], capture_output=True, text=True, timeout=300,
                          env=child_env(triton.pythonpath))
    assert done.returncode == 0, done.stderr[-4000:]
    got = dict(np.load(out))
    return json.loads(str(got.pop("report"))), got


def v1_answers(target: str, arrays: dict) -> dict:
    """The logitserve.v1 answers to the same inputs."""
    with Client(target) as c:
        s = c.sample(arrays["sample.LOGITS"], **SAMPLE)
        weights, indices = c.route_experts(arrays["route_experts.GATE_LOGITS"], k=2)
        v = c.verify_draft(arrays["verify_draft.DRAFT_TOKEN_IDS"], arrays["verify_draft.TARGET_LOGITS"],
                           draft_probs=arrays["verify_draft.DRAFT_PROBS"], **VERIFY)
        return {
            "verify_draft.OUTPUT_TOKEN_IDS": v.token_ids, "verify_draft.NUM_ACCEPTED": v.num_accepted,
            "verify_draft.VALID": v.valid, "verify_draft.SEEDS": v.seeds,
            "sample.TOKEN_IDS": s.token_ids, "sample.SEEDS": s.seeds, "sample.VALID": s.valid,
            "route_experts.WEIGHTS": weights, "route_experts.INDICES": indices,
            "softmax.OUT": c.softmax(arrays["softmax.X"]),
            "causal_softmax.OUT": c.causal_softmax(arrays["causal_softmax.X"]),
            "silu.OUT": c.silu(arrays["silu.X"]),
            "swiglu.OUT": c.swiglu(arrays["swiglu.GATE"], arrays["swiglu.UP"]),
        }


def test_every_model_through_infer_equals_logitserve_v1(triton_python, server, data, tmp_path):
    path, arrays = data
    report, got = drive(triton_python, server.target, "models", path, tmp_path)
    want = v1_answers(server.target, arrays)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], np.asarray(value), err_msg=name)
        assert got[name].dtype == np.asarray(value).dtype, name
    assert report["sample"]["id"] == "id-sample"
    assert report["sample"]["outputs"] == [["TOKEN_IDS", "INT64", [4]], ["SEEDS", "INT64", [4]], ["VALID", "BOOL", [4]]]
    assert report["route_experts"]["outputs"] == [["WEIGHTS", "FP32", [5, 2]], ["INDICES", "INT32", [5, 2]]]
    assert report["verify_draft"]["outputs"] == [["OUTPUT_TOKEN_IDS", "INT64", [3, 3]], ["NUM_ACCEPTED", "INT64", [3]],
                                                 ["VALID", "BOOL", [3]], ["SEEDS", "INT64", [3]]]


def test_a_bad_request_mid_stream_answers_alone(triton_python, server, data, tmp_path):
    path, arrays = data
    report, got = drive(triton_python, server.target, "stream", path, tmp_path)
    answers = report["stream"]
    assert [a["id"] for a in answers] == ["first", None, None, "last"]
    assert "model 'sample' has no input 'X'" in answers[1]["error"]
    assert "unknown model 'no_such_model'" in answers[2]["error"]
    want = v1_answers(server.target, arrays)["softmax.OUT"]
    np.testing.assert_array_equal(got["stream.0"], want)
    np.testing.assert_array_equal(got["stream.3"], want)


def test_inputs_and_outputs_in_system_shared_memory(triton_python, server, data, tmp_path):
    path, arrays = data
    report, got = drive(triton_python, server.target, "shm", path, tmp_path)
    want = v1_answers(server.target, arrays)
    assert report["status"] == ["kserve_in", "kserve_out"]
    assert report["softmax_shm_outputs"] == [["OUT", "FP32", [3, 70]]]
    np.testing.assert_array_equal(got["shm.softmax.OUT"], want["softmax.OUT"])
    np.testing.assert_array_equal(got["shm.sample.TOKEN_IDS"], want["sample.TOKEN_IDS"])
    np.testing.assert_array_equal(got["shm.sample.SEEDS"], want["sample.SEEDS"])
    status, message = report["unregistered"]
    assert status == "StatusCode.NOT_FOUND" and "X shared_memory_region" in message, message
    assert report["status_after"] == []


@pytest.fixture(scope="module")
def cuda_server():
    with ServerProcess("--warmup-dtypes", "none", device="cuda:0", backend="triton", start_timeout=900) as s:
        yield s


def same_bytes(got: np.ndarray, want: np.ndarray, name: str) -> None:
    """Equal dtype, shape and bytes. Booleans compare by their bytes: numpy reads any nonzero
    byte as True, so a VALID the server never wrote would pass a comparison of values."""
    assert got.dtype == want.dtype, name
    if want.dtype == np.bool_:
        got, want = got.view(np.uint8), want.view(np.uint8)
    np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.cuda
def test_inputs_and_outputs_in_cuda_shared_memory_of_another_process(triton_python, cuda_server, data, tmp_path):
    path, arrays = data
    report, got = drive(triton_python, cuda_server.target, "cuda_shm", path, tmp_path)
    want = v1_answers(cuda_server.target, arrays)
    assert "cuda_shared_memory" in report["extensions"]
    assert report["status"] == ["kserve_cuda_in", "kserve_cuda_out"]
    assert sorted(k.removeprefix("cuda_shm.") for k in got) == sorted(want)
    for name, value in want.items():
        same_bytes(got[f"cuda_shm.{name}"], np.asarray(value), name)
    for model, answer in report["answers"].items():
        assert answer["raw_output_contents"] == 0, model  # every output went into the region
    assert report["answers"]["sample"]["outputs"] == [["TOKEN_IDS", "INT64", [4]], ["SEEDS", "INT64", [4]],
                                                      ["VALID", "BOOL", [4]]]
    status, message = report["past_the_end"]
    assert status == "StatusCode.INVALID_ARGUMENT", message
    assert "LOGITS shared_memory_region:" in message and "past the end of region 'kserve_cuda_in'" in message
    assert report["status_after"] == []


def test_the_servers_packages_stay_off_the_tritonclient_path(triton_python, server, data, tmp_path, monkeypatch):
    """A protobuf 7 on this process's PYTHONPATH (as the server's is on the GPU host) does not
    reach the tritonclient process."""
    shadow = tmp_path / "site"
    (shadow / "google/protobuf").mkdir(parents=True)
    (shadow / "google/protobuf/__init__.py").write_text("__version__ = '7.99.0'\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")])))
    report, _ = drive(triton_python, server.target, "health", data[0], tmp_path)
    assert int(report["protobuf"].split(".")[0]) < 7, report["protobuf"]


def test_health_metadata_config_statistics(triton_python, server, data, tmp_path):
    path, _ = data
    drive(triton_python, server.target, "models", path, tmp_path)  # something to count
    report, _ = drive(triton_python, server.target, "health", path, tmp_path)
    assert report["live"] is True and report["ready"] is True
    assert report["model_ready"] == {**{m: True for m in report["model_metadata"]}, "no_such_model": False}
    meta = report["server_metadata"]
    assert meta["name"] == "logitserve" and "system_shared_memory" in meta["extensions"]
    sample = report["model_metadata"]["sample"]
    assert [i["name"] for i in sample["inputs"]] == ["LOGITS", "TEMPERATURE", "TOP_K", "TOP_P", "MIN_P", "SEED",
                                                     "STEP", "RANDOM_VAL"]
    assert sample["inputs"][0] == {"name": "LOGITS", "datatype": "FP32", "shape": ["-1", "-1"]}
    assert [o["name"] for o in sample["outputs"]] == ["TOKEN_IDS", "SEEDS", "VALID"]
    config = report["model_config"]["swiglu"]["config"]
    assert config["name"] == "swiglu" and config["backend"] == "logitserve"
    assert [(i["name"], i["data_type"]) for i in config["input"]] == [("GATE", "TYPE_FP32"), ("UP", "TYPE_FP32")]
    assert [m["name"] for m in report["index"]["models"]] == list(report["model_metadata"])
    assert all(m["state"] == "READY" for m in report["index"]["models"])
    stats = {s["name"]: s for s in report["statistics"]["model_stats"]}
    assert set(stats) == set(report["model_metadata"])
    assert int(stats["sample"]["inference_count"]) >= 1
    assert int(stats["sample"]["inference_stats"]["success"]["count"]) >= 1
    assert [s["name"] for s in report["statistics_sample"]["model_stats"]] == ["sample"]


def test_bad_input_gets_the_same_checks_and_clear_messages(triton_python, server, data, tmp_path):
    path, _ = data
    report, _ = drive(triton_python, server.target, "errors", path, tmp_path)
    cases = report["errors"]
    assert cases["unknown_model"][0] == "StatusCode.NOT_FOUND"
    assert "unknown model 'no_such_model'" in cases["unknown_model"][1]
    assert cases["missing_input"] == ["StatusCode.INVALID_ARGUMENT",
                                      "input UP: required (model 'swiglu' takes GATE, UP)"]
    assert cases["wrong_datatype"] == ["StatusCode.INVALID_ARGUMENT",
                                       "LOGITS datatype: must be one of FP16, BF16, FP32, FP64, got INT64"]
    assert cases["shape_and_data_disagree"] == ["StatusCode.INVALID_ARGUMENT",
                                                "LOGITS: 16000 bytes, but shape [4, 1001] of FP32 needs 16016"]
    assert cases["bad_parameter"] == ["StatusCode.INVALID_ARGUMENT",
                                      "parameters[top_p]: must be in (0, 1], got 1.5"]
    assert cases["draft_id_outside"] == ["StatusCode.INVALID_ARGUMENT",
                                         "DRAFT_TOKEN_IDS[1, 0]: must be in [0, V) with V = 16 (TARGET_LOGITS "
                                         "shape[2]), got 16"]


def test_bearer_token_auth(triton_python, data, tmp_path):
    path, _ = data
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    with ServerProcess("--warmup-dtypes", "none", "--auth-token-file", str(tokens)) as s:
        report, _ = drive(triton_python, s.target, "auth", path, tmp_path, token=TOKEN)
    assert report["auth"]["with_token"] is None
    assert report["auth"]["without"][0] == "StatusCode.UNAUTHENTICATED"
