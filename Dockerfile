# syntax=docker/dockerfile:1
# One image for both roles: the operator (the default command) and training pods (which set their
# own command, e.g. `python train.py`). Multi-stage so the compiler never reaches the runtime image.
ARG PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm

# --- build: compile the native core into a wheel, and wheel every dependency -----------------------
FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY native/ native/
COPY runtime/ runtime/
COPY operator/ operator/
# Extras to bake in: "operator" (kopf, kubernetes); add "cuda" for the CUDA runtime wheel (GPU training).
ARG EXTRAS=operator
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[${EXTRAS}]"

# --- runtime: slim Python, the wheels installed offline, a numeric non-root user -------------------
FROM ${PYTHON_IMAGE}
ARG EXTRAS=operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp
# The wheels are bind-mounted from the build stage, so they never become a layer of this image. What no
# SneppX process reads is deleted in the same layer, so it never ships: the dependencies' test suites, and
# the kubernetes package's asyncio copy of its client (kubernetes.aio, ~70 MB; the operator uses the
# synchronous client, and kopf talks to the API through aiohttp). Bytecode stays: the root filesystem is
# read-only in a pod, so it could never be written later, and it saves a second at each operator start.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels "sneppx[${EXTRAS}]" \
 && site=$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
 && find "$site" -type d -name tests -prune -exec rm -rf {} + \
 && rm -rf "$site/kubernetes/aio" \
 && groupadd --gid 65532 sneppx \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin sneppx \
 && mkdir /workspace && chown 65532:65532 /workspace
# Numeric, so the kubelet can check runAsNonRoot without reading /etc/passwd.
USER 65532:65532
WORKDIR /workspace
LABEL org.opencontainers.image.title="sneppx" \
      org.opencontainers.image.description="SneppX operator and training runtime" \
      org.opencontainers.image.licenses="Apache-2.0"
CMD ["python", "-m", "sneppx_operator"]
