"""Shared fixtures: which backends run here, and a client of a test module's ``server``.

On a machine without CUDA the kernels are tested through the torch reference and through
Triton's interpreter; where CUDA is present the compiled Triton backend joins them.
"""

from __future__ import annotations

import logging

import pytest
import torch

from logitserve.client import Client

# A line while a test runs long and the slowest files at the end (tests/progress.py).
pytest_plugins = ["progress"]

HAS_CUDA = torch.cuda.is_available()

# Backends the kernel tests run on this machine, each with the device its tensors live on.
BACKEND_DEVICES = {"torch": "cpu", "interpret": "cpu"}
if HAS_CUDA:
    BACKEND_DEVICES["triton"] = "cuda"


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def logitserve_logger_restored():
    """The ``logitserve`` logger as each test found it: a test that runs ``configure()`` (the CLI
    in-process) binds it to that test's captured stderr, which later in-process servers would
    write to once closed ("I/O operation on closed file" tracebacks in the run's output)."""
    logger = logging.getLogger("logitserve")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture(params=sorted(BACKEND_DEVICES))
def backend(request) -> str:
    return request.param


@pytest.fixture
def device(backend) -> torch.device:
    return torch.device(BACKEND_DEVICES[backend])


@pytest.fixture
def gen() -> torch.Generator:
    """A fresh generator per test, seeded from the test's random state so failures replay."""
    g = torch.Generator()
    g.manual_seed(torch.randint(0, 2**31 - 1, ()).item())
    return g


@pytest.fixture(scope="module")
def client(server):
    """A client of the ``server`` fixture the test's module defines."""
    with Client(server.target, timeout=120) as c:
        yield c
