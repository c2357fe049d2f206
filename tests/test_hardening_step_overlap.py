"""Issue 32, item 6: within one Step, a part's outputs may not share memory with another part's
inputs or outputs (before: Softmax's output region overlapping Silu's input overwrote it before
Silu read it, max error 3.5). Judged on the memory: two names over one object alias. The
servers, objects and helpers are test_hardening_regions'."""

from __future__ import annotations

import grpc
import numpy as np

from logitserve.v1 import logitserve_pb2 as pb
from test_hardening_regions import PAGE, INVALID, X, caller, f32, ref, server, silu, softmax  # noqa: F401 (fixtures)

def _step_code(caller, **parts):
    return caller.code("Step", pb.StepRequest(**parts))


def test_a_step_part_writing_another_parts_input_is_refused(caller):
    """Softmax's output over silu's input (max error 3.5 before: softmax wrote it first)."""
    obj = caller.region("r")
    obj.write(0, X)
    over_x = {"out": ref("r", 0, X.nbytes)}
    code, details, _ = _step_code(caller, softmax=pb.SoftmaxRequest(x=f32(X), output_regions=over_x),
                                  silu=pb.SiluRequest(x=f32(X, "r")))
    assert code == INVALID and details == (
        "softmax.output_regions[out] and silu.x: their regions share memory; a Step part's output may not share "
        "memory with another part's input or output (the parts run independently, in any order); give them "
        "disjoint memory"), details
    assert caller.in_use("r") == 0  # the refused call holds nothing
    assert np.array_equal(obj.read(0, np.float32, X.shape), X)  # nothing was written


def test_overlap_is_judged_on_the_memory_not_the_names(caller):
    """Two names over one object ("a" its two pages, "b" its second): a slice of "a" that runs
    into the second page shares bytes with "b"'s slices, as two outputs or as an output and an
    input. Slices of the two names in different bytes of the object are fine."""
    obj = caller.region("a", 2 * PAGE)
    caller.region("b", PAGE, obj=obj, offset=PAGE)  # "b" starts where "a"'s second page does
    tail = ref("a", PAGE - 4, X.nbytes)  # the last 4 bytes of the first page, then 1020 of the second
    code, details, _ = _step_code(caller, softmax=pb.SoftmaxRequest(x=f32(X), output_regions={"out": tail}),
                                  silu=pb.SiluRequest(x=f32(X), output_regions={"out": ref("b", 0, X.nbytes)}))
    assert code == INVALID and details.startswith("softmax.output_regions[out] and silu.output_regions[out]: their "
                                                  "regions share memory"), details
    code, details, _ = _step_code(caller, sample=pb.SampleRequest(logits=f32(X, "b"), temperature=0.0),
                                  softmax=pb.SoftmaxRequest(x=f32(X), output_regions={"out": tail}))
    assert code == INVALID and details.startswith("sample.logits and softmax.output_regions[out]"), details
    # "a"'s first 1024 bytes and "b"'s first 1024: different bytes of the object.
    obj.write(PAGE, X)
    head = {"out": ref("a", 0, X.nbytes)}
    code, _, answer = _step_code(caller, softmax=pb.SoftmaxRequest(x=f32(X), output_regions=head),
                                 silu=pb.SiluRequest(x=f32(X, "b")))
    assert code == grpc.StatusCode.OK
    assert np.allclose(obj.read(0, np.float32, X.shape), softmax(X), atol=1e-6)
    assert np.allclose(np.frombuffer(answer.silu.out.data, np.float32).reshape(X.shape), silu(X), atol=1e-5)


def test_parts_may_share_inputs_and_one_op_may_write_in_place(caller):
    """Reading the same bytes from two parts is fine; so is an op writing its own input (its
    documented in-place use), in a Step as alone."""
    obj = caller.region("r")
    obj.write(0, X)
    code, _, answer = _step_code(caller, softmax=pb.SoftmaxRequest(x=f32(X, "r")), silu=pb.SiluRequest(x=f32(X, "r")),
                                 sample=pb.SampleRequest(logits=f32(X, "r"), temperature=0.0))
    assert code == grpc.StatusCode.OK
    assert np.allclose(np.frombuffer(answer.softmax.out.data, np.float32).reshape(X.shape), softmax(X), atol=1e-6)
    assert np.allclose(np.frombuffer(answer.silu.out.data, np.float32).reshape(X.shape), silu(X), atol=1e-5)
    in_place = pb.SoftmaxRequest(x=f32(X, "r"), output_regions={"out": ref("r", 0, X.nbytes)})
    code, _, _ = _step_code(caller, softmax=in_place, silu=pb.SiluRequest(x=f32(X)))
    assert code == grpc.StatusCode.OK
    assert np.allclose(obj.read(0, np.float32, X.shape), softmax(X), atol=1e-6)
    obj.write(0, X)
    code, _, answer = caller.code("Softmax", in_place)
    assert code == grpc.StatusCode.OK and answer.out.region.region == "r"
    assert np.allclose(obj.read(0, np.float32, X.shape), softmax(X), atol=1e-6)
