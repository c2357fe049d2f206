"""The Kubernetes manifests under deploy/ (docs/DEPLOY.md).

Every YAML document is validated against the Kubernetes OpenAPI schemas of pinned versions with
kubernetes-validate, strictly (an unknown or misspelt field is an error). The schemas ship inside
the package: validation reads its files and fetches nothing. Two documents are custom resources
whose schemas it lacks, the ServiceMonitor and Istio's DestinationRule: they are checked field
by field against the objects they name instead (CUSTOM_KINDS), and nothing else is left out.

Then the rules no schema can state, read from each Deployment's container arguments through the
server's own flag parser (a misspelt flag fails here as it would in the pod): the drain fits in
terminationGracePeriodSeconds; the startup probe covers a cold warm-up; every probe asks
grpc.health.v1 on the serving port (natively, or over TLS through the ConfigMap's script, which
runs here against a TLS server); the headless Service, the budget and the ServiceMonitor select
the pods; GPU variants ask for a GPU and CPU ones do not; the compile cache and the Secrets'
files are mounted where the flags point.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import subprocess
import sys

import kubernetes_validate  # the dev extra's: the schemas of every Kubernetes version it names
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from logitserve.server import ServerConfig, cli
from logitserve.server.app import STOP_ANSWER_S, STOP_LAUNCH_S
from logitserve.server.testing import ServerThread

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"
# The oldest Kubernetes the manifests need (preStop's sleep action is on by default from 1.30)
# and the newest whose schemas the pinned kubernetes-validate carries.
K8S_VERSIONS = ("1.30", "1.37")
# Custom resources: no schema in kubernetes-validate; each has a test of its own below.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("networking.istio.io/v1", "DestinationRule")}
# Which device each directory's Deployment runs on.
VARIANTS = {"gpu": "cuda", "gpu-tls": "cuda", "cpu": "cpu"}
# A cold warm-up: 56 s on a fresh H200 host with default flags, 262 s compiling in the server
# alone (docs/SERVICE.md); the startup probe must wait at least this long.
STARTUP_BUDGET_S = 300
# What the server takes after --grace-period-s at most (server/app.py).
AFTER_GRACE_S = STOP_ANSWER_S + STOP_LAUNCH_S
TLS_PROBE_SERVER_NAME = "logitserve-headless"


def _documents() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                found.append((f"{path.relative_to(DEPLOY)}#{i}", doc))
    return found


DOCUMENTS = _documents()


def _of_kind(kind: str, under: str = "") -> list[tuple[str, dict]]:
    return [(where, d) for where, d in DOCUMENTS if d["kind"] == kind and where.startswith(under)]


def _one(kind: str, name: str) -> dict:
    (doc,) = [d for _, d in _of_kind(kind) if d["metadata"]["name"] == name]
    return doc


DEPLOYMENTS = _of_kind("Deployment")


def _variant(where: str) -> str:
    return where.split("/", 1)[0]


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _server_config(container: dict) -> ServerConfig:
    """The container's arguments and variables read as `logitserve serve` reads them."""
    environ = {e["name"]: e["value"] for e in container.get("env", ())}
    try:
        command, config = cli.parse(container["args"], environ)
    except SystemExit as exc:  # argparse's exit on a bad flag; its message went to stderr
        raise AssertionError(f"args: `logitserve {' '.join(container['args'])}` does not parse") from exc
    assert command == "serve", f"args: must start with serve, got {command}"
    return config


def _mount_of(pod: dict, container: dict, path: str) -> tuple[dict, dict, str]:
    """(volume mount, volume, path inside the volume) of the mount that holds ``path``."""
    mounts = [m for m in container.get("volumeMounts", ()) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path}: no volumeMount holds it"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return mount, volume, path[len(mount["mountPath"].rstrip("/")) + 1:]


def _secret_file(pod: dict, container: dict, path: str, what: str) -> tuple[str, str]:
    """(Secret name, key) of the file ``path``, which must come from a Secret mounted read-only."""
    mount, volume, inside = _mount_of(pod, container, path)
    assert "secret" in volume, f"{what} {path}: volume {volume['name']} must be a Secret"
    assert mount.get("readOnly"), f"{what} {path}: mount {mount['name']} must be readOnly"
    items = {i["path"]: i["key"] for i in volume["secret"].get("items", ())}
    return volume["secret"]["secretName"], items.get(inside, inside)


def _budget(probe: dict) -> int:
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def _matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _flag(command: list[str], name: str) -> str:
    assert name in command, f"probe command {command}: no {name}"
    return command[command.index(name) + 1]


SCHEMA_CHECKED = [(w, d) for w, d in DOCUMENTS if (d["apiVersion"], d["kind"]) not in CUSTOM_KINDS]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("where,doc", SCHEMA_CHECKED, ids=[f"{w}:{d['kind']}" for w, d in SCHEMA_CHECKED])
def test_document_matches_kubernetes_schema(where, doc, version):
    try:
        validated = kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise AssertionError(f"{where} {doc['kind']}/{doc['metadata']['name']}: {path}: {exc.message} "
                             f"(Kubernetes {exc.version})") from None
    # An older schema set stands in for a missing version without a word: refuse that.
    assert validated == version, (f"kubernetes-validate {kubernetes_validate.__version__} has no schemas for "
                                  f"Kubernetes {version} (used {validated})")


def test_every_document_is_checked():
    """The documents the schema test leaves out are exactly the custom resources the tests below
    check by hand, and each directory holding a Deployment is a known variant."""
    assert {(d["apiVersion"], d["kind"]) for _, d in DOCUMENTS} - {
        (d["apiVersion"], d["kind"]) for _, d in SCHEMA_CHECKED} == CUSTOM_KINDS
    assert {_variant(w) for w, _ in DEPLOYMENTS} == set(VARIANTS)


@pytest.mark.parametrize("where,deployment", DEPLOYMENTS, ids=[w for w, _ in DEPLOYMENTS])
class TestDeployment:
    def test_drain_ends_before_the_kill(self, where, deployment):
        """SIGTERM comes after preStop; the server then takes at most grace + AFTER_GRACE_S. The
        kubelet's countdown (terminationGracePeriodSeconds) covers preStop too."""
        pod = deployment["spec"]["template"]["spec"]
        container = _container(deployment)
        grace = _server_config(container).grace_period_s
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        needed = pre_stop + grace + AFTER_GRACE_S
        assert pod["terminationGracePeriodSeconds"] > needed, (
            f"terminationGracePeriodSeconds: must exceed preStop {pre_stop} s + --grace-period-s {grace} s + "
            f"{AFTER_GRACE_S} s = {needed} s, got {pod['terminationGracePeriodSeconds']}")

    def test_probes_ask_health_on_the_serving_port(self, where, deployment):
        pod = deployment["spec"]["template"]["spec"]
        container = _container(deployment)
        config = _server_config(container)
        for name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[name]
            if "grpc" in probe:
                # The kubelet's gRPC probe speaks plaintext only: it cannot reach a TLS server.
                assert config.tls_cert is None, f"{name}: a native gRPC probe cannot talk to --tls-cert's TLS"
                assert probe["grpc"] == {"port": config.port, "service": ""}, f"{name}.grpc: must ask '' on --port"
                continue
            command = probe["exec"]["command"]
            assert config.tls_cert is not None, f"{name}: exec probes are for TLS servers; use grpc"
            _, volume, script = _mount_of(pod, container, command[1])
            assert "configMap" in volume and script == "tls_health.py", f"{name}: must run the probe ConfigMap's script"
            configmap = _one("ConfigMap", volume["configMap"]["name"])
            assert script in configmap["data"]
            assert int(_flag(command, "--port")) == config.port, f"{name}: --port must be the server's"
            ca_secret, ca_key = _secret_file(pod, container, _flag(command, "--ca"), f"{name} --ca")
            assert (ca_secret, ca_key) == (_secret_file(pod, container, config.tls_cert, "--tls-cert")[0], "ca.crt")
            assert _flag(command, "--server-name") == TLS_PROBE_SERVER_NAME
        assert _budget(container["startupProbe"]) >= STARTUP_BUDGET_S, \
            f"startupProbe: must wait {STARTUP_BUDGET_S} s for a cold warm-up, waits {_budget(container['startupProbe'])}"
        # Readiness drops a draining pod from the endpoints before its grace period ends, and
        # liveness cannot restart a container that is still draining.
        assert _budget(container["readinessProbe"]) < config.grace_period_s
        assert _budget(container["livenessProbe"]) > config.grace_period_s + AFTER_GRACE_S

    def test_ports_and_metrics(self, where, deployment):
        container = _container(deployment)
        config = _server_config(container)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": config.port, "metrics": config.metrics_port}
        assert config.metrics_host == "0.0.0.0", "--metrics-host: the scraper is in another pod"
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(config.metrics_port),
                               "prometheus.io/path": "/metrics"}

    def test_device_and_gpu_request(self, where, deployment):
        container = _container(deployment)
        config = _server_config(container)
        resources = container["resources"]
        gpus = [int(resources.get(part, {}).get("nvidia.com/gpu", 0)) for part in ("requests", "limits")]
        if VARIANTS[_variant(where)] == "cuda":
            assert config.device.startswith("cuda:") and gpus[1] >= 1, "GPU variant: --device cuda:N and a GPU limit"
        else:
            assert config.device == "cpu" and gpus == [0, 0], "CPU variant: --device cpu and no GPU"

    def test_files_are_mounted_where_the_flags_point(self, where, deployment):
        pod = deployment["spec"]["template"]["spec"]
        container = _container(deployment)
        config = _server_config(container)
        if VARIANTS[_variant(where)] == "cuda":
            assert config.compile_cache_dir, "--compile-cache-dir: GPU variants keep Triton's cache on a volume"
        if config.compile_cache_dir:
            mount, volume, _ = _mount_of(pod, container, config.compile_cache_dir)
            assert {"emptyDir", "persistentVolumeClaim"} & set(volume) and not mount.get("readOnly")
        example_secrets = {d["metadata"]["name"]: d["stringData"] for _, d in _of_kind("Secret", "examples/")}
        for flag, path in (("--auth-token-file", config.auth_token_file), ("--tls-cert", config.tls_cert),
                           ("--tls-key", config.tls_key)):
            if path is not None:
                secret, key = _secret_file(pod, container, path, flag)
                assert key in example_secrets.get(secret, {}), f"{flag} {path}: Secret {secret} has no key {key}"
        assert config.auth_token_file, "--auth-token-file: every variant serves tokens"

    def test_pods_are_selected(self, where, deployment):
        """The Deployment, the headless Service and the budget select the pod template's labels;
        no Service link variables reach the server (LOGITSERVE_PORT=tcp://... would be read as
        --port's default)."""
        spec = deployment["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert _matches(spec["selector"]["matchLabels"], labels)
        headless = _one("Service", "logitserve-headless")
        assert headless["spec"]["clusterIP"] == "None" and not headless["spec"].get("publishNotReadyAddresses")
        assert _matches(headless["spec"]["selector"], labels)
        config = _server_config(_container(deployment))
        targets = {p["name"]: p["targetPort"] for p in headless["spec"]["ports"]}
        assert targets == {"grpc": "grpc", "metrics": "metrics"}
        assert {p["name"]: p["port"] for p in headless["spec"]["ports"]}["grpc"] == config.port
        for _, budget in _of_kind("PodDisruptionBudget"):
            assert _matches(budget["spec"]["selector"]["matchLabels"], labels)
        assert spec["template"]["spec"]["enableServiceLinks"] is False


def test_servicemonitor_scrapes_the_metrics_port():
    """Checked by hand: the ServiceMonitor CRD's schema is not in kubernetes-validate."""
    (monitor,) = [d for _, d in _of_kind("ServiceMonitor")]
    headless = _one("Service", "logitserve-headless")
    assert _matches(monitor["spec"]["selector"]["matchLabels"], headless["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "interval"} and endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in headless["spec"]["ports"] if p["targetPort"] == "metrics"}


def test_destinationrule_hashes_a_header_onto_a_clusterip_service():
    """Checked by hand: Istio's CRD schema is not in kubernetes-validate (on paper: no mesh here)."""
    (rule,) = [d for _, d in _of_kind("DestinationRule")]
    service = _one("Service", rule["spec"]["host"])
    assert service["spec"].get("clusterIP") != "None", "a mesh balances a ClusterIP Service's calls"
    assert [p["name"] for p in service["spec"]["ports"]] == ["grpc"]
    assert set(rule["spec"]) == {"host", "trafficPolicy"}
    assert rule["spec"]["trafficPolicy"] == {"loadBalancer": {"consistentHash": {"httpHeaderName": "x-logitserve-sequence"}}}


def test_example_token_secret_holds_no_token():
    """Applied by mistake, the example leaves the server refusing to start ("holds no token"),
    never serving with a token everyone can read here."""
    tokens = _one("Secret", "logitserve-tokens")["stringData"]["tokens"]
    assert all(not line.strip() or line.strip().startswith("#") for line in tokens.splitlines())


def test_client_service_config_balances_with_health_and_retries():
    """deploy/client/service-config.json (tests/test_deploy_drain.py runs it through a drain)."""
    config = json.loads((DEPLOY / "client" / "service-config.json").read_text())
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": ""}
    (method,) = config["methodConfig"]
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """ca.crt, tls.crt and tls.key as the logitserve-tls Secret holds them: a CA, and a server
    certificate it signed that names the Service the probe asks for (and not 127.0.0.1)."""
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def cert(subject, key, issuer, issuer_key, extensions):
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30)))
        for extension in extensions:
            builder = builder.add_extension(extension, critical=isinstance(extension, x509.BasicConstraints))
        return builder.sign(issuer_key, hashes.SHA256())

    d = tmp_path_factory.mktemp("tls")
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("logitserve-ca", ca_key, "logitserve-ca", ca_key, [x509.BasicConstraints(ca=True, path_length=None)])
    server = cert("logitserve", key, "logitserve-ca", ca_key,
                  [x509.BasicConstraints(ca=False, path_length=None),
                   x509.SubjectAlternativeName([x509.DNSName(TLS_PROBE_SERVER_NAME)])])
    pem = serialization.Encoding.PEM
    (d / "ca.crt").write_bytes(ca.public_bytes(pem))
    (d / "tls.crt").write_bytes(server.public_bytes(pem))
    (d / "tls.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return d


def test_tls_probe_script_follows_health(tls_files, tmp_path):
    """The gpu-tls probe, run as the kubelet runs it: exit 1 while NOT_SERVING (warm-up), 0 once
    SERVING, 1 for a name the certificate lacks (it does verify)."""
    script = tmp_path / "tls_health.py"
    script.write_text(_one("ConfigMap", "logitserve-probe")["data"]["tls_health.py"])
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(),
                          tls_cert=str(tls_files / "tls.crt"), tls_key=str(tls_files / "tls.key"))

    def probe(name: str = TLS_PROBE_SERVER_NAME) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), "--port", str(server.port), "--ca",
                               str(tls_files / "ca.crt"), "--server-name", name],
                              capture_output=True, text=True, timeout=60)

    with ServerThread(config, warm_up=False) as server:
        warming = probe()
        server.run(server.service.warm_up())
        serving = probe()
        wrong_name = probe("elsewhere.example")
    assert (warming.returncode, warming.stdout.split()[-1]) == (1, "NOT_SERVING"), warming.stderr
    assert (serving.returncode, serving.stdout.split()[-1]) == (0, "SERVING"), serving.stderr
    assert wrong_name.returncode == 1 and "UNAVAILABLE" in wrong_name.stderr
