"""The checked-in generated code is exactly what the pinned generator (scripts/gen_protos.sh) makes
from the protos, and pyproject.toml's grpcio and protobuf floors are the ones that code demands.

The generator is installed by the script into a cache folder of its own on first use (pip, no
dependencies); without it (no index, no network) these tests fail, saying why.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTOS = sorted(p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src").glob("**/*.proto"))
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generated_names(proto: str) -> list[str]:
    """The files the generator writes beside ``proto`` (paths relative to protos/)."""
    stem = proto.removesuffix(".proto")
    return [stem + suffix for suffix in SUFFIXES]


def floor(requirement: str) -> str:
    """The ``>=`` version of the project dependency named ``requirement``."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    req = next(r for r in map(Requirement, deps) if r.name == requirement)
    return next(s.version for s in req.specifier if s.operator == ">=")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> pathlib.Path:
    """scripts/gen_protos.sh's output written into a temporary folder."""
    out = tmp_path_factory.mktemp("protos")
    done = subprocess.run(["bash", str(ROOT / "scripts/gen_protos.sh"), str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHON": sys.executable})
    if done.returncode:
        pytest.fail(f"scripts/gen_protos.sh exited {done.returncode} (it installs the pinned grpcio-tools with pip "
                    f"on first use):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}", pytrace=False)
    return out


def test_protos_were_found():
    assert {"logitserve/v1/logitserve.proto", "logitserve/kserve/grpc_service.proto"} <= set(PROTOS)


@pytest.mark.parametrize("proto", PROTOS)
def test_checked_in_code_matches_a_fresh_generation(fresh, proto):
    missing = [name for name in generated_names(proto) if not (ROOT / "src" / name).exists()]
    assert not missing, f"not checked in: {missing}; run scripts/gen_protos.sh"
    stale = [name for name in generated_names(proto)
             if (fresh / name).read_bytes() != (ROOT / "src" / name).read_bytes()]
    assert not stale, f"regenerate with scripts/gen_protos.sh: {stale} differ from {proto}"


def test_no_generated_file_without_its_proto():
    expected = {name for proto in PROTOS for name in generated_names(proto)}
    found = {p.relative_to(ROOT / "src").as_posix() for suffix in SUFFIXES
             for p in (ROOT / "src").glob(f"**/*{suffix}")}
    assert found == expected, f"generated files whose proto is gone: {sorted(found - expected)}"


@pytest.mark.parametrize("proto", PROTOS)
def test_pyproject_floors_match_the_generated_code(proto):
    # The messages check the protobuf runtime (ValidateProtobufRuntimeVersion: never older than
    # the generator's), the stubs the grpcio runtime (GRPC_GENERATED_VERSION): pyproject.toml's
    # floors must be exactly those, or pip installs a runtime the code refuses at import.
    messages, _, stubs = ((ROOT / "src" / name).read_text() for name in generated_names(proto))
    gencode = re.search(r"^# Protobuf Python Version: (\S+)$", messages, re.M).group(1)
    validate = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", messages)
    assert ".".join(validate.groups()) == gencode
    assert floor("protobuf") == gencode
    assert re.search(r"^GRPC_GENERATED_VERSION = '(\S+)'$", stubs, re.M).group(1) == floor("grpcio")


@pytest.mark.parametrize("module", ["logitserve.v1.logitserve_pb2", "logitserve.v1.logitserve_pb2_grpc",
                                    "logitserve.kserve.grpc_service_pb2", "logitserve.kserve.grpc_service_pb2_grpc"])
def test_generated_modules_import(module):
    __import__(module)


def test_kserve_contract_names():
    # tritonclient calls /inference.GRPCInferenceService/<Method>: the package and service names
    # are the contract, whatever the file's path.
    from logitserve.kserve import grpc_service_pb2 as kpb
    service = kpb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == "inference.GRPCInferenceService"
    assert kpb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number == 7
    assert kpb.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number == 6
    assert kpb.ModelConfig.DESCRIPTOR.fields_by_name["backend"].number == 17


@pytest.mark.parametrize("proto", PROTOS)
def test_every_rpc_and_field_is_commented(proto):
    # STYLE.md (TGI): a comment on every rpc and field. The descriptor keeps comments only in
    # the source, so read the proto: each `rpc` and field line follows a `//` comment line.
    lines = (ROOT / "src" / proto).read_text().splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        text = line.strip()
        is_rpc = text.startswith("rpc ")
        is_field = text.endswith(";") and "=" in text and not text.startswith(("syntax", "option"))
        if (is_rpc or is_field) and not lines[i - 1].strip().startswith("//"):
            uncommented.append(text)
    assert not uncommented, f"lines without a comment above: {uncommented}"
