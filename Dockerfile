# tokserve, CPU image: `tokserve serve` on the demo model by default; every role by its
# subcommand (`tokserve broker|worker|gateway ...`, see docs/deployment.md, "Container image").
#
#   podman build -t tokserve:cpu .
#   podman run --rm -p 8000:8000 tokserve:cpu            # serve --host 0.0.0.0 on the demo model
#   podman run --rm tokserve:cpu broker --help
#
# The CUDA variant is deploy/container/Dockerfile.cuda, vllm-router's image
# deploy/container/Dockerfile.router.
#
# BASE_IMAGE: any Debian 12 (bookworm) image; its python3 (3.11) runs everything.
# TORCH_INDEX_URL: where torch comes from (PyTorch's CPU wheels by default: PyPI's Linux
# wheel is the CUDA build, several GB).  PIP_FIND_LINKS: a folder of wheels to prefer
# (mounted into the build, e.g. `-v /opt/wheels:/wheels:ro --build-arg PIP_FIND_LINKS=/wheels`).
# Build-time only: none of these ARGs is used by the image at run time.
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim

FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=""
# PIP_CERT: a CA bundle for pip behind a TLS-inspecting proxy (mounted like the wheels).
ARG PIP_CERT

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# g++ and ninja stay in the image: the CPU kernels are compiled below for the build host's
# CPU (-march=native); a node with another CPU compiles its own build once at start-up.
# tini is PID 1: it forwards SIGTERM (workers drain) and reaps the compiler's children.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates g++ libgomp1 ninja-build python3 python3-dev python3-venv tini \
    && rm -rf /var/lib/apt/lists/*

# A fixed non-root uid/gid: the Kubernetes manifests run as 10001 (runAsNonRoot).
RUN groupadd --system --gid 10001 tokserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/tokserve --create-home \
        --shell /usr/sbin/nologin tokserve

ENV VIRTUAL_ENV=/opt/tokserve/venv \
    PATH=/opt/tokserve/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TORCH_EXTENSIONS_DIR=/var/cache/tokserve/torch_extensions \
    TOKSERVE_CACHE=/var/cache/tokserve \
    TOKSERVE_DEMO_MODEL=/opt/tokserve/demo-model

# DL3013: pinned through the TORCH_VERSION argument, which hadolint cannot read.
# hadolint ignore=DL3013
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --index-url "$TORCH_INDEX_URL" ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} \
        "torch==${TORCH_VERSION}"

# Dependencies first (a layer that survives code edits), then the package itself.
COPY pyproject.toml /src/pyproject.toml
COPY common /src/common
COPY broker /src/broker
COPY worker /src/worker
COPY gateway /src/gateway
COPY benchmarks /src/benchmarks
# DL3013: /src is this project; its dependencies' ranges are pyproject.toml's.
# hadolint ignore=DL3013
RUN pip install ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} "torch==${TORCH_VERSION}" /src \
    && rm -rf /src

# Build-time work: the demo model (root-owned, world-readable), then the CPU kernels
# (`tokserve build-kernels`, the README install's last step: torch.utils.cpp_extension into
# $TORCH_EXTENSIONS_DIR, stamped so workers import the build without a compiler), compiled
# as the user that loads them (torch takes a lock file in their folder); --strict fails the
# build if they do not compile.
RUN tokserve demo-model --out "$TOKSERVE_DEMO_MODEL" \
    && install -d -o tokserve -g tokserve -m 0755 /var/cache/tokserve "$TORCH_EXTENSIONS_DIR"
USER 10001:10001
RUN tokserve build-kernels --strict

WORKDIR /home/tokserve
EXPOSE 8000
ENTRYPOINT ["/usr/bin/tini", "--", "tokserve"]
CMD ["serve", "--host", "0.0.0.0", "--model", "/opt/tokserve/demo-model"]
