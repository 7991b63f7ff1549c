# pdmesh/cli: the `pdmesh` command (every distribution), for one-shot jobs such as `pdmesh model init`
# (the compose `model-init` service, the cpu overlay's model-init Job). Not a serving image.
# Build from the repository root:
#   docker build -f deploy/cli.Dockerfile -t pdmesh/cli:latest .
# Build arguments as the worker images' (services/decode/Dockerfile): BASE_IMAGE, TORCH_SPEC (default
# the CPU build torch==2.13.0+cpu), PIP_EXTRA_INDEX_URL (default PyTorch's CPU wheel index: one more
# index beside PyPI, which keeps serving torch's own dependencies), EXTRA_CA_CERTS. Wheels in
# deploy/image/wheels/ are found first; every install is held to constraints.txt.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS builder
ARG TORCH_SPEC=torch==2.13.0+cpu
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRA_CA_CERTS=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_FIND_LINKS=/opt/build/wheels
COPY deploy/image/ /opt/build/
RUN sh /opt/build/builder.sh
COPY constraints.txt /opt/build/constraints.txt
RUN /opt/venv/bin/pip install -c /opt/build/constraints.txt "${TORCH_SPEC}"
WORKDIR /src
COPY protos/ protos/
COPY kernels/ kernels/
COPY engine/ engine/
COPY services/ services/
COPY sdk/ sdk/
COPY bench/ bench/
COPY pdmesh/ pdmesh/
COPY pyproject.toml README.md ./
RUN /opt/venv/bin/pip install -c /opt/build/constraints.txt ./protos ./kernels "./engine[runtime]" \
        "./services/common[worker]" ./services/gateway ./services/kvstore ./services/eplb \
        ./services/prefill ./services/decode ./sdk ./bench .

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
