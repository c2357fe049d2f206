"""Run in the tritonclient virtual environment (tests/test_kserve.py makes it), never imported by
the suite: it needs tritonclient's protobuf (< 7), which the server's stack refuses.

    python tests/kserve_tritonclient.py TARGET SCENARIO IN.npz OUT.npz [TOKEN]

Reads the inputs the test wrote (IN.npz: arrays named ``<model>.<INPUT>``), drives the server
with ``tritonclient.grpc`` as an unchanged Triton client would, and writes what it got back
(OUT.npz: arrays, and ``report`` a JSON string of everything else).
"""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

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


SCENARIOS = {"models": models, "stream": stream, "shm": shared_memory, "health": health, "errors": errors}


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
    got, report = {}, {}
    with grpcclient.InferenceServerClient(target) as client:
        for scenario in scenarios.split(","):
            if scenario == "auth":
                auth(client, data, got, report, token)
            else:
                SCENARIOS[scenario](client, data, got, report)
    np.savez(path_out, report=np.array(json.dumps(report)), **got)


if __name__ == "__main__":
    main()
