"""The checked-in generated code is exactly what the pinned generator makes from the protos."""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Each proto (relative to protos/) and its generated files, beside it.
PROTOS = {
    "logitserve/v1/logitserve.proto": ("logitserve_pb2.py", "logitserve_pb2.pyi", "logitserve_pb2_grpc.py"),
    "logitserve/kserve/grpc_service.proto": ("grpc_service_pb2.py", "grpc_service_pb2.pyi",
                                             "grpc_service_pb2_grpc.py"),
}
PINNED_TOOLS = "1.84.0"  # pyproject.toml's dev extra; scripts/gen_protos.sh says why


def test_generator_is_the_pinned_version():
    assert importlib.metadata.version("grpcio-tools") == PINNED_TOOLS


@pytest.mark.parametrize("proto", sorted(PROTOS))
def test_checked_in_code_matches_a_fresh_generation(tmp_path, proto):
    # The same command as scripts/gen_protos.sh, writing into a temporary folder.
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}",
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         str(ROOT / "protos" / proto)],
        check=True, capture_output=True, text=True)
    folder = pathlib.PurePosixPath(proto).parent
    stale = [name for name in PROTOS[proto]
             if (tmp_path / folder / name).read_bytes() != (ROOT / "protos" / folder / name).read_bytes()]
    assert not stale, f"regenerate with scripts/gen_protos.sh: {stale} differ from {proto}"


def test_gen_script_runs_the_same_command():
    script = (ROOT / "scripts/gen_protos.sh").read_text()
    assert "grpc_tools.protoc -Iprotos" in script
    for flag in ("--python_out=protos", "--pyi_out=protos", "--grpc_python_out=protos"):
        assert flag in script
    for proto in PROTOS:
        assert f"protos/{proto}" in script


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


@pytest.mark.parametrize("proto", sorted(PROTOS))
def test_every_rpc_and_field_is_commented(proto):
    # STYLE.md (TGI): a comment on every rpc and field. The descriptor keeps comments only in
    # the source, so read the proto: each `rpc` and field line follows a `//` comment line.
    lines = (ROOT / "protos" / proto).read_text().splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        text = line.strip()
        is_rpc = text.startswith("rpc ")
        is_field = text.endswith(";") and "=" in text and not text.startswith(("syntax", "option"))
        if (is_rpc or is_field) and not lines[i - 1].strip().startswith("//"):
            uncommented.append(text)
    assert not uncommented, f"lines without a comment above: {uncommented}"
