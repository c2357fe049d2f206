# logitserve: the gRPC service in an image.
#
#   docker build -t logitserve .                       # or: podman build --format docker -t logitserve .
#   docker run --gpus all -p 50051:50051 logitserve                      # serve on cuda:0
#   docker run -p 50051:50051 logitserve serve --device cpu               # no GPU
#   docker run -p 6000:6000 -e LOGITSERVE_PORT=6000 logitserve            # another port (not --port:
#                                                     the HEALTHCHECK reads LOGITSERVE_PORT too)
#
# Warm-up compiles the kernels into Triton's cache (in parallel processes: --compile-processes);
# a volume keeps that cache across restarts, and warm-up then loads instead of compiling:
#
#   docker run --gpus all -p 50051:50051 -v logitserve-triton:/cache logitserve \
#     serve --compile-cache-dir /cache
#
# BASE_IMAGE is a PyTorch image by default: torch (a CUDA build) and triton come from the base
# image there and are not reinstalled. Triton 3.6 (torch 2.10) or newer is what the kernels
# are tested with. Any Debian-like image works as a base: where python3 or venv is missing
# it is installed with apt-get, and where torch is missing torch==$TORCH_VERSION is
# installed first (pinned: unpinned, pip would pull several GB of CUDA wheels where a CPU
# build may be wanted; point PIP_FIND_LINKS or PIP_INDEX_URL at the build you want).
#
# pip settings for the build (a private index, a proxy's CA bundle, a local wheel folder) are
# build arguments, never baked into the image: an ARG is set as an environment variable for
# the RUN steps below only, and pip reads PIP_* variables (the RUN steps unset empty ones, so an
# argument not given neither changes pip's settings nor makes it warn):
#
#   podman build --format docker --build-arg BASE_IMAGE=localhost/bookworm-base \
#     -v /opt/wheels:/run/build/wheels:ro --build-arg PIP_FIND_LINKS=/run/build/wheels \
#     -v /etc/ssl/certs/ca-certificates.crt:/run/build/ca.crt:ro --build-arg PIP_CERT=/run/build/ca.crt \
#     -t logitserve .
#
# --format docker keeps the HEALTHCHECK under podman (its default OCI format drops it); the base
# image is named in full (docker.io/...), as podman resolves no short names by default.
#
# Mount under /run (a tmpfs during RUN: no empty mount point stays in the image), and not over
# /etc/ssl/certs/ca-certificates.crt, which apt's ca-certificates rewrites on a bare base.
# tests/test_container.py builds this way; scripts/container_base.sh makes that base. Build-
# argument values are recorded in the image's history (`docker history`): never put
# credentials in them; pass those as a secret mount instead.
ARG BASE_IMAGE=docker.io/pytorch/pytorch:2.10.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ARG TORCH_VERSION=2.13.0

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/logitserve \
    PATH=/opt/logitserve/bin:$PATH

# Python with venv: present in PyTorch images; a bare Debian (bookworm: Python 3.11) gets it
# from apt. The virtual environment sees the base's site-packages, so a base's torch is used
# as it is, and pip installs nothing over it.
RUN set -eux; \
    for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CERT; do [ -n "$(printenv "$v")" ] || unset "$v"; done; \
    if ! { command -v python3 >/dev/null 2>&1 && python3 -m venv --system-site-packages "$VIRTUAL_ENV"; }; then \
        rm -rf "$VIRTUAL_ENV"; \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv python3-pip ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
        python3 -m venv --system-site-packages "$VIRTUAL_ENV"; \
    fi; \
    if ! python -c 'import torch' >/dev/null 2>&1; then \
        PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 python -m pip install "torch==${TORCH_VERSION}"; \
    fi; \
    python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

# The package's dependencies, the server extra's with them, in a layer of their own that only
# pyproject.toml and constraints.txt invalidate (on Python < 3.11, without tomllib, the next step
# installs them instead), at the versions constraints.txt pins (what the tests ran with) but for
# triton: torch is already here, and a PyTorch base image's torch comes with its own triton.
COPY pyproject.toml constraints.txt /tmp/logitserve-deps/
RUN set -eux; \
    for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CERT; do [ -n "$(printenv "$v")" ] || unset "$v"; done; \
    if python -c 'import tomllib' 2>/dev/null; then \
        python -c "import tomllib; p = tomllib.load(open('/tmp/logitserve-deps/pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *p['optional-dependencies']['server'], sep='\n')" \
            > /tmp/logitserve-deps/requirements.txt; \
        grep -v '^triton==' /tmp/logitserve-deps/constraints.txt > /tmp/logitserve-deps/image-constraints.txt; \
        PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 python -m pip install \
            -c /tmp/logitserve-deps/image-constraints.txt -r /tmp/logitserve-deps/requirements.txt; \
    fi; \
    rm -rf /tmp/logitserve-deps

# The package itself with the server extra, non-editable (every package under src/logitserve/).
# The source tree is not kept in the image.
COPY . /tmp/logitserve-src
RUN set -eux; \
    for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CERT; do [ -n "$(printenv "$v")" ] || unset "$v"; done; \
    grep -v '^triton==' /tmp/logitserve-src/constraints.txt > /tmp/logitserve-image-constraints.txt; \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 python -m pip install \
        -c /tmp/logitserve-image-constraints.txt "/tmp/logitserve-src[server]"; \
    rm /tmp/logitserve-image-constraints.txt; \
    rm -rf /tmp/logitserve-src; \
    python -c 'import logitserve.server, logitserve.client, logitserve.kernels'; \
    ln -s "$(python -c 'import logitserve.server.healthcheck as h; print(h.__file__)')" "$VIRTUAL_ENV/healthcheck.py"; \
    (getent group logitserve >/dev/null || groupadd --system logitserve); \
    useradd --system --gid logitserve --home-dir /home/logitserve --create-home \
        --shell /usr/sbin/nologin logitserve

USER logitserve
WORKDIR /home/logitserve

# gRPC (LogitServe, grpc.health.v1, reflection).
EXPOSE 50051

# Asks grpc.health.v1 on the port the server reads from LOGITSERVE_PORT (else 50051), over TLS
# trusting the server's own certificate where LOGITSERVE_TLS_CERT is set, and passes only on
# SERVING: NOT_SERVING lasts through warm-up and draining. A server on another port: set
# LOGITSERVE_PORT (server and probe both read it) rather than --port. Under mutual TLS, or
# with a certificate that does not name 127.0.0.1, give the probe its arguments
# (--client-cert/--client-key, --server-name: python -m logitserve.server.healthcheck --help)
# in a HEALTHCHECK of your own. It imports grpc and no torch (logitserve/server/healthcheck.py,
# linked above). Docker-format images only (podman build --format docker).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "/opt/logitserve/healthcheck.py"]

# A same-host engine ordering its calls on the GPU shares the GPU with this server: run both as
# clients of one MPS daemon, started on the host (docs/DEPLOY.md, "Same-host engines: MPS"):
#   docker run --gpus all --ipc=host -v /tmp/nvidia-mps:/tmp/nvidia-mps ... logitserve serve
ENTRYPOINT ["logitserve"]
CMD ["serve", "--host", "0.0.0.0"]
