"""The client installs without torch: ``pip install <checkout>``, no extras, into a fresh virtual
environment brings grpcio, protobuf and numpy (and what grpcio itself requires) and nothing else,
and that environment's client works against a real server.

One environment per protobuf major, each made once: the plain install (pip resolves the newest,
protobuf 7), then protobuf 6 and 5 pinned to their newest release, then every dependency at the
floor pyproject.toml states (protobuf 5.27.2 and grpcio 1.66.2: what the generated code asks for).
In each, tests/client_install_probe.py (warnings as errors: protobuf's "gencode older than the
runtime" warning fails it) samples numpy logits (Client and AsyncClient), routes experts and
samples from a POSIX shared-memory region into another, against a server started from this
environment (.venv, CPU, torch backend); its answers must equal this environment's client's.

The environments are made with this environment's pip (``pip --python``), so they hold no pip of
their own and their site-packages is what the install brought. pip needs an index (PyPI or a
mirror): without one these tests fail, saying why; they never skip.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from logitserve.client import Client

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests/client_install_probe.py"
SAMPLE = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}  # as the probe's
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DEPENDENCIES = {r.name: r for r in map(Requirement, PROJECT["project"]["dependencies"])}
FLOORS = tuple(f"{name}=={next(s.version for s in r.specifier if s.operator == '>=')}"
               for name, r in DEPENDENCIES.items())
# Variant -> what is pinned beside the checkout (none: pip picks).
VARIANTS = {
    "plain": (),
    "protobuf6": ("protobuf==6.33.6",),
    "protobuf5": ("protobuf==5.29.6",),
    "floors": FLOORS,
}
SITE_PACKAGES_LIMIT = 150 << 20  # torch alone is over 1 GB


def child_env() -> dict:
    """This process's environment without PYTHONPATH and PYTHONHOME (they may point at .venv)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def run(argv: list, what: str, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, env=child_env())
    if done.returncode:
        pytest.fail(f"{what}: {' '.join(map(str, argv))} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                    f"{done.stderr[-3000:]}", pytrace=False)
    return done


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> pathlib.Path:
    """A copy of what the build reads (pyproject.toml, README.md and the folders setuptools finds
    the packages in), so the build writes nothing into the working tree."""
    dest = tmp_path_factory.mktemp("checkout") / "logitserve"
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for top in PROJECT["tool"]["setuptools"]["packages"]["find"]["where"]:
        shutil.copytree(ROOT / top, dest / top, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@dataclass(frozen=True)
class Env:
    """A client-only virtual environment and the variant it was made for."""

    path: pathlib.Path
    variant: str

    @property
    def python(self) -> pathlib.Path:
        return self.path / "bin/python"

    @property
    def site_packages(self) -> pathlib.Path:
        return next(self.path.glob("lib/python*/site-packages"))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def env(request, checkout, tmp_path_factory) -> Env:
    """A fresh virtual environment holding the checkout, no extras, and the variant's pins."""
    made = Env(tmp_path_factory.mktemp(f"venv-{request.param}"), request.param)
    run([sys.executable, "-m", "venv", "--without-pip", made.path], "making the virtual environment")
    run([sys.executable, "-m", "pip", "--python", made.python, "install", "--quiet", "--disable-pip-version-check",
         checkout, *VARIANTS[request.param]],
        f"pip install of the checkout ({request.param}); it needs an index (PyPI or a mirror)")
    return made


@pytest.fixture(scope="module")
def server():
    from logitserve.server.process import ServerProcess

    with ServerProcess("--warmup-dtypes", "none") as s:
        yield s


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    rng = np.random.default_rng(34)
    arrays = {"logits": (rng.standard_normal((4, 300)) * 3).astype(np.float32),
              "seeds": np.arange(4, dtype=np.int64) + 11,
              "gate": rng.standard_normal((5, 16)).astype(np.float32)}
    path = tmp_path_factory.mktemp("inputs") / "in.npz"
    np.savez(path, **arrays)
    return path, arrays


@pytest.fixture(scope="module")
def expected(server, inputs) -> dict:
    """This checkout's client's answers to the probe's calls."""
    _, a = inputs
    with Client(server.target, timeout=60) as c:
        weights, indices = c.route_experts(a["gate"], 2, True)
        return {"sampled": c.sample(a["logits"], seed=a["seeds"], **SAMPLE).token_ids,
                "greedy": np.argmax(a["logits"], axis=1), "weights": weights, "indices": indices}


def tree_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def test_client_only_install(env, server, inputs, expected, tmp_path):
    listed = run([sys.executable, "-m", "pip", "--python", env.python, "list", "--format", "json",
                  "--disable-pip-version-check"], "pip list").stdout
    versions = {canonicalize_name(d["name"]): Version(d["version"]) for d in json.loads(listed)}
    in_path, _ = inputs
    out = tmp_path / "out.npz"
    run([env.python, "-I", "-W", "error", PROBE, server.target, in_path, out], "the probe")
    got = dict(np.load(out))
    report = json.loads(str(got.pop("report")))
    size = tree_bytes(env.site_packages)
    print(f"{env.variant}: site-packages {size / 2**20:.1f} MiB: "
          + ", ".join(f"{name} {v}" for name, v in sorted(versions.items())))

    # Installed: the project, its requirements without extras (exactly grpcio, protobuf and
    # numpy) and grpcio's own (typing-extensions); no torch, no triton.
    assert sorted(Requirement(r).name for r in report["requires"]["logitserve"]) == ["grpcio", "numpy", "protobuf"]
    grpcio_needs = {canonicalize_name(Requirement(r).name) for r in report["requires"]["grpcio"]}
    assert set(versions) == {"logitserve", "grpcio", "protobuf", "numpy"} | grpcio_needs, sorted(versions)
    assert not report["torch_importable"] and not report["torch_imported"]
    assert size < SITE_PACKAGES_LIMIT, f"site-packages holds {size / 2**20:.0f} MiB"
    assert pathlib.Path(report["client_file"]).is_relative_to(env.site_packages), report["client_file"]
    # Each pin took; the plain install got protobuf 7, the newest major.
    for pin in map(Requirement, VARIANTS[env.variant]):
        assert versions[pin.name] in pin.specifier, (str(pin), versions[pin.name])
    if not VARIANTS[env.variant]:
        assert versions["protobuf"].major == 7, versions["protobuf"]

    assert np.array_equal(got["greedy"], expected["greedy"]) and np.array_equal(got["greedy_async"], expected["greedy"])
    for field in ("sampled", "weights", "indices"):
        assert np.array_equal(got[field], expected[field]), field
    assert np.array_equal(got["shm_tokens"], expected["sampled"])
    assert report["regions"] == ["logits", "tokens"]
    # The console script is there, and says what serving needs.
    served = subprocess.run([env.path / "bin/logitserve", "serve", "--device", "cpu"], capture_output=True, text=True,
                            timeout=120, env=child_env())
    assert served.returncode == 2 and "needs the server extra" in served.stderr, served.stderr[-2000:]
    assert "Traceback" not in served.stderr
