"""Run by tests/test_kserve.py with an interpreter that imports tritonclient (its virtual
environment, or a PYTHONPATH of unpacked wheels), never imported by the suite: it needs
tritonclient's protobuf (< 7), which the server's stack refuses.

    python tests/kserve_tritonclient.py TARGET SCENARIOS IN.npz OUT.npz [TOKEN]

Reads the inputs the test wrote (IN.npz: arrays named ``<model>.<INPUT>``), drives the server
with ``tritonclient.grpc`` as an unchanged Triton client would, through each scenario named
(comma-separated; ``cuda_shm`` needs cuda-python and a CUDA server), and writes what it got back
(OUT.npz: arrays, and ``report`` a JSON string of everything else, the protobuf version among it).
"""

import json
import sys

import google.protobuf

# tritonclient's generated code needs protobuf < 7. A newer one here means the server's packages
# reached this interpreter's path (tests/test_kserve.py hands it tritonclient's alone): say so
# rather than fail somewhere inside tritonclient.
if int(google.protobuf.__version__.split(".")[0]) >= 7:
    sys.exit(f"protobuf {google.protobuf.__version__} from {google.protobuf.__file__}: tritonclient needs < 7; "
             f"the server's packages are on this interpreter's path (PYTHONPATH?)")

import numpy as np  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, triton_to_np_dtype  # noqa: E402

MODELS = ("sample", "route_experts", "softmax", "causal_softmax", "silu", "swiglu", "verify_draft")
PARAMS = {"sample": {"seed": 1234, "temperature": 0.7, "top_k": 50, "top_p": 0.9}, "route_experts": {"k": 2},
          "verify_draft": {"seed": 99, "top_k": 5}}


def inputs_of(data, model):
    out = []
    for key in data.files:
        name, _, tensor = key.partition(".")
        if name == model:
            a = data[key]
            t = grpcclient.InferInput(tensor, list(a.shape), np_to_triton_dtype(a.dtype))
            t.set_data_from_numpy(a)
            out.append(t)
    return out


def models(client, data, got, report):
    for model in MODELS:
        result = client.infer(model, inputs_of(data, model), parameters=PARAMS.get(model), request_id=f"id-{model}")
        response = result.get_response()
        report[model] = {"id": response.id, "outputs": [(o.name, o.datatype, list(o.shape)) for o in response.outputs]}
        for o in response.outputs:
            got[f"{model}.{o.name}"] = result.as_numpy(o.name)


def stream(client, data, got, report):
    answers = []
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    good = inputs_of(data, "softmax")
    client.async_stream_infer("softmax", good, request_id="first")
    client.async_stream_infer("sample", inputs_of(data, "softmax"), request_id="bad")  # no LOGITS
    client.async_stream_infer("no_such_model", good, request_id="unknown")
    client.async_stream_infer("softmax", good, request_id="last")
    client.stop_stream()  # waits for every answer
    report["stream"] = [{"id": None if r is None else r.get_response().id, "error": None if e is None else str(e)}
                        for r, e in answers]
    for i, (r, e) in enumerate(answers):
        if r is not None:
            got[f"stream.{i}"] = r.as_numpy("OUT")


def shared_memory(client, data, got, report):
    x = data["softmax.X"]
    logits = data["sample.LOGITS"]
    rows = logits.shape[0]
    size_in, size_out = x.nbytes + logits.nbytes, x.nbytes + 16 * rows + 64
    hin = shm.create_shared_memory_region("kserve_in", "/kserve_test_in", size_in)
    hout = shm.create_shared_memory_region("kserve_out", "/kserve_test_out", size_out)
    try:
        shm.set_shared_memory_region(hin, [x, logits])
        client.register_system_shared_memory("kserve_in", "/kserve_test_in", size_in)
        client.register_system_shared_memory("kserve_out", "/kserve_test_out", size_out)
        report["status"] = sorted(client.get_system_shared_memory_status(as_json=True).get("regions", {}))
        # softmax: input and output in regions.
        t = grpcclient.InferInput("X", list(x.shape), "FP32")
        t.set_shared_memory("kserve_in", x.nbytes)
        out = grpcclient.InferRequestedOutput("OUT")
        out.set_shared_memory("kserve_out", x.nbytes)
        result = client.infer("softmax", [t], outputs=[out])
        report["softmax_shm_outputs"] = [(o.name, o.datatype, list(o.shape)) for o in result.get_response().outputs]
        got["shm.softmax.OUT"] = shm.get_contents_as_numpy(hout, np.float32, list(x.shape)).copy()
        # sample: logits in a region at an offset; TOKEN_IDS into a region (capacity larger than
        # needed), SEEDS back as bytes.
        t = grpcclient.InferInput("LOGITS", list(logits.shape), "FP32")
        t.set_shared_memory("kserve_in", logits.nbytes, offset=x.nbytes)
        tokens = grpcclient.InferRequestedOutput("TOKEN_IDS")
        tokens.set_shared_memory("kserve_out", size_out - x.nbytes, offset=x.nbytes)
        result = client.infer("sample", [t], outputs=[tokens, grpcclient.InferRequestedOutput("SEEDS")],
                              parameters=PARAMS["sample"])
        got["shm.sample.SEEDS"] = result.as_numpy("SEEDS")
        got["shm.sample.TOKEN_IDS"] = shm.get_contents_as_numpy(hout, np.int64, [rows], offset=x.nbytes).copy()
        try:  # a region this caller never registered
            t = grpcclient.InferInput("X", list(x.shape), "FP32")
            t.set_shared_memory("never_registered", x.nbytes)
            client.infer("softmax", [t])
            report["unregistered"] = None
        except InferenceServerException as exc:
            report["unregistered"] = [exc.status(), exc.message()]
        client.unregister_system_shared_memory("kserve_in")
        client.unregister_system_shared_memory()
        report["status_after"] = sorted(client.get_system_shared_memory_status(as_json=True).get("regions", {}))
    finally:
        shm.destroy_shared_memory_region(hin)
        shm.destroy_shared_memory_region(hout)


ALIGN = 256  # where tensors start in a CUDA region: multiples of this, the first one past its base
UNWRITTEN = 0xA5  # the output region's bytes before the server writes into it


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def cuda_shared_memory(client, data, got, report):
    """Every model with its inputs and outputs in CUDA memory this process allocated: one region
    for the inputs, one for the outputs, each tensor at an offset inside its region (the KServe
    register request has no offset: a region is its allocation from the base). The outputs are
    read back from the device; the answer carries none of their bytes."""
    # Imported here: it needs cuda-python, which only the GPU machine has.
    import tritonclient.utils.cuda_shared_memory as cudashm

    inputs = {m: [(k.partition(".")[2], data[k]) for k in data.files if k.partition(".")[0] == m] for m in MODELS}
    outputs = {m: [o["name"] for o in client.get_model_metadata(m, as_json=True)["outputs"]] for m in MODELS}
    place_in, place_out, slots, size_in, size_out = {}, {}, {}, ALIGN, ALIGN
    for model in MODELS:
        for name, a in inputs[model]:
            place_in[model, name] = size_in
            size_in += _aligned(a.nbytes)
        # An output's slot is as large as its model's largest input: enough for every output of
        # these inputs (the byte_size of an output region is a capacity).
        slots[model] = _aligned(max(a.nbytes for _, a in inputs[model]))
        for name in outputs[model]:
            place_out[model, name] = size_out
            size_out += slots[model]
    image = np.zeros(size_in, np.uint8)
    for (model, name), offset in place_in.items():
        a = dict(inputs[model])[name]
        image[offset:offset + a.nbytes] = np.frombuffer(a.tobytes(), np.uint8)
    hin = cudashm.create_shared_memory_region("kserve_cuda_in", size_in, 0)
    hout = cudashm.create_shared_memory_region("kserve_cuda_out", size_out, 0)
    try:
        cudashm.set_shared_memory_region_from_dlpack(hin, [image])  # numpy's DLPack, copied to the device
        cudashm.set_shared_memory_region(hout, [np.full(size_out, UNWRITTEN, np.uint8)])
        client.register_cuda_shared_memory("kserve_cuda_in", cudashm.get_raw_handle(hin), 0, size_in)
        client.register_cuda_shared_memory("kserve_cuda_out", cudashm.get_raw_handle(hout), 0, size_out)
        report["extensions"] = client.get_server_metadata(as_json=True)["extensions"]
        report["status"] = sorted(client.get_cuda_shared_memory_status(as_json=True).get("regions", {}))
        answers = {}
        for model in MODELS:
            tensors = []
            for name, a in inputs[model]:
                t = grpcclient.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
                t.set_shared_memory("kserve_cuda_in", a.nbytes, offset=place_in[model, name])
                tensors.append(t)
            wanted = []
            for name in outputs[model]:
                o = grpcclient.InferRequestedOutput(name)
                o.set_shared_memory("kserve_cuda_out", slots[model], offset=place_out[model, name])
                wanted.append(o)
            response = client.infer(model, tensors, outputs=wanted, parameters=PARAMS.get(model)).get_response()
            answers[model] = {"outputs": [(o.name, o.datatype, list(o.shape)) for o in response.outputs],
                              "raw_output_contents": len(response.raw_output_contents)}
        report["answers"] = answers
        written = cudashm.get_contents_as_numpy(hout, np.uint8, [size_out])
        for model, answer in answers.items():
            for name, datatype, shape in answer["outputs"]:
                offset, dtype = place_out[model, name], np.dtype(triton_to_np_dtype(datatype))
                nbytes = int(np.prod(shape)) * dtype.itemsize
                got[f"cuda_shm.{model}.{name}"] = written[offset:offset + nbytes].view(dtype).reshape(shape)
        try:  # LOGITS running past the end of its region
            logits = data["sample.LOGITS"]
            t = grpcclient.InferInput("LOGITS", list(logits.shape), "FP32")
            t.set_shared_memory("kserve_cuda_in", logits.nbytes, offset=size_in - ALIGN)
            client.infer("sample", [t], parameters=PARAMS["sample"])
            report["past_the_end"] = None
        except InferenceServerException as exc:
            report["past_the_end"] = [exc.status(), exc.message()]
        client.unregister_cuda_shared_memory("kserve_cuda_in")
        client.unregister_cuda_shared_memory()
        report["status_after"] = sorted(client.get_cuda_shared_memory_status(as_json=True).get("regions", {}))
    finally:
        cudashm.destroy_shared_memory_region(hin)
        cudashm.destroy_shared_memory_region(hout)


def health(client, data, got, report):
    report["live"] = client.is_server_live()
    report["ready"] = client.is_server_ready()
    report["model_ready"] = {m: client.is_model_ready(m) for m in (*MODELS, "no_such_model")}
    report["server_metadata"] = client.get_server_metadata(as_json=True)
    report["model_metadata"] = {m: client.get_model_metadata(m, as_json=True) for m in MODELS}
    report["model_config"] = {m: client.get_model_config(m, as_json=True) for m in MODELS}
    report["index"] = client.get_model_repository_index(as_json=True)
    report["statistics"] = client.get_inference_statistics(as_json=True)
    report["statistics_sample"] = client.get_inference_statistics("sample", as_json=True)


def errors(client, data, got, report):
    logits = data["sample.LOGITS"]
    cases = {}

    def attempt(name, model, tensors, parameters=None):
        try:
            client.infer(model, tensors, parameters=parameters)
            cases[name] = None
        except InferenceServerException as exc:
            cases[name] = [exc.status(), exc.message()]

    attempt("unknown_model", "no_such_model", inputs_of(data, "sample"))
    attempt("missing_input", "swiglu", [t for t in inputs_of(data, "swiglu") if t.name() == "GATE"])
    wrong = grpcclient.InferInput("LOGITS", list(logits.shape), "INT64")
    wrong.set_data_from_numpy(logits.astype(np.int64))
    attempt("wrong_datatype", "sample", [wrong])
    short = grpcclient.InferInput("LOGITS", [logits.shape[0], logits.shape[1] + 1], "FP32")
    short.set_shape(list(logits.shape))
    short.set_data_from_numpy(logits)  # the data of a shape one column narrower
    short.set_shape([logits.shape[0], logits.shape[1] + 1])
    attempt("shape_and_data_disagree", "sample", [short])
    attempt("bad_parameter", "sample", inputs_of(data, "sample"), {"top_p": 1.5})
    ids = grpcclient.InferInput("DRAFT_TOKEN_IDS", [3, 2], "INT64")
    ids.set_data_from_numpy(np.array([[0, 1], [16, 2], [3, 4]], dtype=np.int64))
    attempt("draft_id_outside", "verify_draft",
            [ids, *(t for t in inputs_of(data, "verify_draft") if t.name() != "DRAFT_TOKEN_IDS")])
    report["errors"] = cases


SCENARIOS = {"models": models, "stream": stream, "shm": shared_memory, "cuda_shm": cuda_shared_memory,
             "health": health, "errors": errors}


def auth(client, data, got, report, token=None):
    cases = {}
    for name, headers in (("with_token", {"authorization": f"Bearer {token}"}), ("without", None)):
        try:
            client.infer("softmax", inputs_of(data, "softmax"), headers=headers)
            cases[name] = None
        except InferenceServerException as exc:
            cases[name] = [exc.status(), exc.message()]
    report["auth"] = cases


SCENARIOS["auth"] = auth


def main():
    target, scenarios, path_in, path_out = sys.argv[1:5]
    token = sys.argv[5] if len(sys.argv) > 5 else None
    data = np.load(path_in)
    got, report = {}, {"protobuf": google.protobuf.__version__}
    with grpcclient.InferenceServerClient(target) as client:
        for scenario in scenarios.split(","):
            if scenario == "auth":
                auth(client, data, got, report, token)
            else:
                SCENARIOS[scenario](client, data, got, report)
    np.savez(path_out, report=np.array(json.dumps(report)), **got)


if __name__ == "__main__":
    main()
