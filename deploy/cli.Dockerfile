# syntax=docker/dockerfile:1
# pdmesh/cli: the `pdmesh` command (every distribution), for one-shot jobs such as `pdmesh model init`
# (the compose `model-init` service, the cpu overlay's model-init Job). Not a serving image.
# Build from the repository root:
#   docker build -f deploy/cli.Dockerfile -t pdmesh/cli:latest .
# torch comes from the index in TORCH_INDEX_URL when given (e.g. PyTorch's CPU wheel index, to keep the
# image small), else from the default index.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
RUN if [ -n "$TORCH_INDEX_URL" ]; then /opt/venv/bin/pip install --index-url "$TORCH_INDEX_URL" torch; fi
WORKDIR /src
COPY protos/ protos/
COPY kernels/ kernels/
COPY engine/ engine/
COPY services/ services/
COPY sdk/ sdk/
COPY bench/ bench/
COPY pdmesh/ pdmesh/
COPY pyproject.toml README.md ./
RUN /opt/venv/bin/pip install ./protos ./kernels "./engine[runtime]" "./services/common[worker]" \
        ./services/gateway ./services/kvstore ./services/eplb ./services/prefill ./services/decode ./sdk ./bench .

FROM ${BASE_IMAGE}
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/pdmesh --shell /usr/sbin/nologin pdmesh \
    && mkdir /models && chown 10001:10001 /models
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# A fresh named volume mounted on /models takes this directory's owner, so the job can write it.
USER 10001:10001
WORKDIR /home/pdmesh
ENTRYPOINT ["pdmesh"]
CMD ["--help"]
