"""The image: build the Dockerfile with podman on a local Debian base, serve, call, stop.

Runs only where podman is installed (``scripts/ci_container.sh`` installs it and runs this
file). The base image ``localhost/bookworm-base`` is made by ``scripts/container_base.sh``
(debootstrap, once per machine; the rootfs tarball is kept). The build gets pip's settings
on this machine (``pip config list`` and PIP_* variables: the local wheel folder with the CPU
torch wheel, the proxy's CA bundle, extra indexes) as build arguments, with the folders and
files they name mounted read-only, so none of them ends up in the image.

The container then serves on a loopback-published port with ``serve --port P --device cpu``;
the test waits (bounded) for grpc.health.v1 SERVING, samples and routes through the client,
and compares with the kernels run here with the same seeds.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(shutil.which("podman") is None,
                       reason="podman is not installed (scripts/ci_container.sh installs it and runs this test)"),
]

ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = os.environ.get("LOGITSERVE_TEST_BASE_IMAGE", "localhost/bookworm-base")
IMAGE = "localhost/logitserve-test:latest"
BUILD_MOUNTS = "/run/logitserve-build"  # pip's folders and CA bundle during the build (not /etc/ssl: apt rewrites it)
STARTUP_TIMEOUT_S = 180.0


def _log(msg: str) -> None:
    print(f"[container] {msg}", file=sys.stderr, flush=True)


def _run(argv: list[str], env: dict[str, str], timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv[:3])} ... failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def pip_settings() -> dict[str, str]:
    """pip's find-links, cert, index-url and extra-index-url here: PIP_* variables over config."""
    settings: dict[str, str] = {}
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in ("find-links", "cert", "index-url", "extra-index-url"):
            settings.setdefault(name, value.strip().strip("'\""))
    for name in ("find-links", "cert", "index-url", "extra-index-url"):
        env = os.environ.get("PIP_" + name.upper().replace("-", "_"))
        if env:
            settings[name] = env
    return settings


def _local_dir(location: str) -> str | None:
    """The local folder a find-links or index location needs mounted, or None if remote."""
    if "://" in location and not location.startswith("file:"):
        return None
    path = (urlparse(location).path if location.startswith("file:") else location).rstrip("/")
    if not path or not os.path.isdir(path):
        return None
    # A PEP 503 index (".../simple") links to files beside it ("../../files/..."): mount its parent.
    return os.path.dirname(path) if os.path.basename(path) == "simple" else path


def build_args(settings: dict[str, str]) -> list[str]:
    """``--build-arg`` and ``-v`` options handing pip's settings to the build.

    Local folders and the CA bundle are mounted read-only under /run/logitserve-build/ (a
    tmpfs during RUN: nothing of them, not even an empty mount point, stays in the image) and
    the settings are rewritten to name them there.
    """
    argv: list[str] = []
    mounts: dict[str, str] = {}  # host folder -> folder in the build
    for name in ("find-links", "index-url", "extra-index-url"):
        if name not in settings:
            continue
        locations = []
        for location in settings[name].split():
            folder = _local_dir(location)
            if folder is not None:
                inside = mounts.setdefault(folder, f"{BUILD_MOUNTS}/{len(mounts)}")
                path = urlparse(location).path if location.startswith("file:") else location
                location = ("file://" if location.startswith("file:") else "") + inside + path[len(folder):]
            locations.append(location)
        argv += ["--build-arg", f"PIP_{name.upper().replace('-', '_')}={' '.join(locations)}"]
    if "cert" in settings and os.path.isfile(settings["cert"]):
        argv += ["-v", f"{settings['cert']}:{BUILD_MOUNTS}/ca.crt:ro", "--build-arg", f"PIP_CERT={BUILD_MOUNTS}/ca.crt"]
    for folder, inside in mounts.items():
        argv += ["-v", f"{folder}:{inside}:ro"]
    return argv


@pytest.fixture(scope="module")
def podman_env() -> dict[str, str]:
    """Environment for podman: CONTAINERS_CONF naming the runc/ulimits file; base image present."""
    t0 = time.monotonic()
    proc = _run(["bash", str(ROOT / "scripts" / "container_base.sh"), BASE_IMAGE], dict(os.environ), timeout=900)
    conf = proc.stdout.strip().splitlines()[-1]
    _log(f"base image {BASE_IMAGE} ready in {time.monotonic() - t0:.1f} s ({proc.stderr.strip()})")
    return {**os.environ, "CONTAINERS_CONF": conf}


@pytest.fixture(scope="module")
def image(podman_env: dict[str, str]) -> str:
    t0 = time.monotonic()
    argv = ["podman", "build", "--format", "docker", "--network", "host",
            "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", *build_args(pip_settings()),
            "-t", IMAGE, str(ROOT)]
    _run(argv, podman_env, timeout=1800)
    _log(f"built {IMAGE} in {time.monotonic() - t0:.1f} s")
    return IMAGE


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(target: str, name: str, env: dict[str, str]) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    status = "no answer"
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            state = _run(["podman", "inspect", "--format", "{{.State.Status}}", name], env, 30, check=False)
            if state.stdout.strip() not in ("running", "created", "configured"):
                break
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                status = exc.code().name
            time.sleep(0.5)
    logs = _run(["podman", "logs", name], env, 30, check=False)
    raise AssertionError(f"container {name} not SERVING within {STARTUP_TIMEOUT_S:.0f} s (last: {status});"
                         f" logs:\n{logs.stdout[-4000:]}{logs.stderr[-4000:]}")


@pytest.fixture(scope="module")
def server(image: str, podman_env: dict[str, str]):
    """The image serving on the CPU, published on 127.0.0.1 only; yields ``(target, name)``."""
    port = free_port()
    name = f"logitserve-test-{uuid.uuid4().hex[:8]}"
    # The port as the Dockerfile says to give another one: LOGITSERVE_PORT, which the server and the
    # image's HEALTHCHECK both read (a --port the probe would not see).
    _run(["podman", "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:{port}", "-e", f"LOGITSERVE_PORT={port}",
          image, "serve", "--device", "cpu"], podman_env, timeout=120)
    try:
        t0 = time.monotonic()
        wait_serving(f"127.0.0.1:{port}", name, podman_env)
        _log(f"SERVING {time.monotonic() - t0:.1f} s after start")
        yield f"127.0.0.1:{port}", name
    finally:
        _run(["podman", "rm", "-f", "-t", "5", name], podman_env, timeout=60, check=False)


def test_image_runs_as_non_root_without_build_settings(image: str, podman_env: dict[str, str]):
    uid = _run(["podman", "run", "--rm", "--entrypoint", "id", image, "-u"], podman_env, timeout=120)
    assert uid.stdout.strip() != "0", "the image must not run as root"
    env = _run(["podman", "image", "inspect", "--format", "{{json .Config.Env}}", image], podman_env, timeout=60)
    assert "PIP_" not in env.stdout, f"pip build settings baked into the image: {env.stdout}"
    assert "/opt/wheels" not in env.stdout
    config = _run(["podman", "image", "inspect", "--format",
                   "{{json .Config.Entrypoint}} {{json .Config.Cmd}} {{json .Config.ExposedPorts}}", image],
                  podman_env, timeout=60)
    assert '["logitserve"]' in config.stdout and '"serve"' in config.stdout and "50051" in config.stdout


def test_sample_and_route_match_in_process_kernels(server):
    from logitserve.client import Client
    from logitserve.kernels import sample, topk_softmax

    target, _ = server
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((4, 32000)) * 3).astype(np.float32)
    cases = [
        dict(temperature=0.8, top_k=50, top_p=0.9, seed=1234),
        dict(temperature=1.0, top_k=0, top_p=0.95, seed=99),
        dict(temperature=0.0, seed=5),  # greedy
    ]
    with Client(target) as client:
        for params in cases:
            got = client.sample(logits, **params)
            want = sample(torch.from_numpy(logits), backend="torch", **params)
            np.testing.assert_array_equal(np.asarray(got.token_ids), want.numpy(), err_msg=str(params))
        bf16 = torch.from_numpy(logits[:2]).to(torch.bfloat16)
        got = client.sample(bf16, temperature=0.7, top_k=20, seed=42)
        want = sample(bf16, temperature=0.7, top_k=20, seed=42, backend="torch")
        np.testing.assert_array_equal(np.asarray(got.token_ids), want.numpy())

        gates = rng.standard_normal((16, 64)).astype(np.float32)
        weights, indices = client.route_experts(gates, 6, renormalize=True)
        want_w, want_i = topk_softmax(torch.from_numpy(gates), 6, renormalize=True, backend="torch")
        np.testing.assert_array_equal(np.asarray(indices), want_i.numpy())
        np.testing.assert_allclose(np.asarray(weights), want_w.numpy(), rtol=1e-6, atol=1e-7)


def test_healthcheck_and_graceful_stop(server, podman_env: dict[str, str]):
    _, name = server
    # The image's HEALTHCHECK command, run by podman inside the container.
    health = _run(["podman", "healthcheck", "run", name], podman_env, timeout=60, check=False)
    assert health.returncode == 0, f"HEALTHCHECK failed: {health.stdout} {health.stderr}"
    # SIGTERM (podman stop): the server drains and exits by itself, with status 0.
    _run(["podman", "stop", "-t", "30", name], podman_env, timeout=90)
    code = _run(["podman", "inspect", "--format", "{{.State.ExitCode}}", name], podman_env, timeout=30)
    assert code.stdout.strip() == "0", f"exit status after SIGTERM: {code.stdout.strip()}"
