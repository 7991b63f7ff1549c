"""deploy/compose.yaml for real, without Docker: each compose service in its own network namespace.

The live test (root, `ip netns`) gives every compose service except prometheus/grafana/model-init
a network namespace on a private /24 behind a bridge it creates, with an `eth0` in each (the name
a container has, so the compose `environment:` applies unchanged: UCX over tcp on eth0) and an
/etc/netns/<ns>/hosts naming every service. It starts each service's compose entrypoint + command
with its environment inside its namespace, in depends_on order, waits for each with the compose
healthcheck, then, from one more namespace, uses the openai SDK against the gateway by name and
reads the workers' metrics: decode received KV bytes over NIXL, so the KV crossed namespaces by
UCX over tcp.
Where iptables filters bridged traffic (a host where dockerd runs or ran: FORWARD policy DROP and
br_netfilter loaded, both kept after dockerd stops), the test lets its own bridge forward between
its ports with rules of its own and removes exactly those with the namespaces; it never changes a
policy or a sysctl of the host. Another live test proves that.
The other tests check, without root, that the compose commands are flags the services take and that
Prometheus and the Grafana dashboard cover what the services export.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
NOT_STARTED = (
    "prometheus",
    "grafana",
    "model-init",
)  # monitoring, and the model the test makes itself
PDMESH_SERVICES = ("gateway", "kvstore", "eplb", "prefill", "decode")
MODEL_MOUNT = "/models"  # where compose mounts the `models` volume
HEALTH_TIMEOUT_S = 90.0  # per wave of services started together (workers load the model)
CLIENT_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
# The chains that get a rule for the test's bridge: FORWARD, and Docker's DOCKER-USER where it
# exists (a dockerd that starts meanwhile puts its jump to DOCKER-USER back ahead of our rule).
BRIDGE_CHAINS = ("FORWARD", "DOCKER-USER")
VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")
METRIC_NAME = re.compile(r"\bpdmesh_[a-z0-9_]+")
METRIC_KINDS = ("counter", "gauge", "histogram", "summary")


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def interpolate(value: str, variables: Mapping[str, str]) -> str:
    """Compose's ${NAME}, ${NAME:-default}: the variable when set, else the default."""
    return VARIABLE.sub(lambda m: variables.get(m.group(1)) or (m.group(2) or ""), value)


def service_argv(service: dict[str, Any], variables: Mapping[str, str] | None = None) -> list[str]:
    """The container's command line: entrypoint + command, interpolated."""
    argv = [*service.get("entrypoint", []), *service["command"]]
    return [interpolate(str(arg), variables or {}) for arg in argv]


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def pdmesh_options(name: str, argv: list[str]) -> list[str]:
    """The options after `python -m pdmesh_<name>`."""
    assert argv[:3] == ["python", "-m", f"pdmesh_{name}"], argv
    return argv[3:]


# --- without root: the compose file against the services' own parsers and the monitoring config ---


@pytest.mark.parametrize("name", PDMESH_SERVICES)
def test_compose_commands_are_flags_the_services_take(name: str) -> None:
    server = importlib.import_module(f"pdmesh_{name}.server")
    parser = argparse.ArgumentParser(prog=name, exit_on_error=False)
    server.add_arguments(parser)
    options = pdmesh_options(name, service_argv(compose()["services"][name]))
    namespace, unknown = parser.parse_known_args(options)
    assert unknown == [], f"{name}: the service does not take {unknown}"
    config = server.config_from_args(namespace)  # ValueError on a bad value
    assert namespace.host == "0.0.0.0" and namespace.advertise_host == name, config


@pytest.mark.parametrize("name", PDMESH_SERVICES)
def test_compose_healthchecks_are_the_readiness_probes(name: str) -> None:
    """Each pdmesh service's healthcheck GETs its /health/ready (pdmesh_service.probes) through
    `python -m pdmesh_service.healthcheck --url`: on its metrics port, the gateway's on its REST
    port."""
    service = compose()["services"][name]
    test = service["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "pdmesh_service.healthcheck"], test
    argv = service_argv(service)
    port = flag_value(argv, "--http-port" if name == "gateway" else "--metrics-port")
    assert flag_value(test, "--url") == f"http://127.0.0.1:{port}/health/ready", test


def test_compose_publishes_only_on_loopback_by_default() -> None:
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            assert interpolate(port, {}).startswith("127.0.0.1:"), (name, port)


def test_prometheus_scrapes_every_pdmesh_compose_service_where_it_serves_metrics() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for t in group["targets"]
    }
    for name in PDMESH_SERVICES:
        argv = service_argv(compose()["services"][name])
        port = flag_value(argv, "--http-port" if name == "gateway" else "--metrics-port")
        assert f"{name}:{port}" in targets, (name, sorted(targets))


def defined_metrics() -> set[str]:
    """Every `pdmesh_*` name passed first to a call of Counter/Gauge/Histogram/Summary (or of a
    helper named like one) in the services and the engine, or given to a module constant named
    `*_METRIC` (a name other code shares, as KEDA's queries do)."""
    sources = [
        *REPO.glob("services/*/pdmesh_*/**/*.py"),
        *REPO.glob("engine/pdmesh_engine/**/*.py"),
    ]
    names: set[str] = set()
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id.endswith("_METRIC") for t in node.targets)
                and isinstance(node.value, ast.Constant)
                and str(node.value.value).startswith("pdmesh_")
            ):
                names.add(str(node.value.value))
            if not (
                isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            ):
                continue
            func = (
                node.func.attr
                if isinstance(node.func, ast.Attribute)
                else getattr(node.func, "id", "")
            )
            name = node.args[0].value
            if (
                func.lower() in METRIC_KINDS
                and isinstance(name, str)
                and name.startswith("pdmesh_")
            ):
                names.add(name)
    return names


def exposed_base(name: str) -> str:
    """An exported series name back to the metric's declared name (histogram suffixes)."""
    for suffix in ("_bucket", "_count", "_sum", "_created"):
        name = name.removesuffix(suffix)
    return name


def test_dashboard_shows_every_metric_the_services_define_and_no_other() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "pdmesh.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {exposed_base(m) for e in exprs for m in METRIC_NAME.findall(e)}
    defined = defined_metrics()
    normalized = {d.removesuffix("_total") for d in defined}
    assert {u.removesuffix("_total") for u in used} == normalized, "dashboard vs services' metrics"
    assert len(defined) >= 15


# --- as root: the compose services in network namespaces ---


@dataclass
class Netns:
    """The namespaces, bridge and processes of one run; `close()` removes all of it."""

    suffix: str
    subnet: str  # "10.A.B" of 10.A.B.0/24
    namespaces: dict[str, str]  # compose service (or "client") -> namespace
    addresses: dict[str, str]
    processes: dict[str, subprocess.Popen]
    logs: Path
    rules: list[list[str]] = field(default_factory=list)  # iptables rules added for the bridge

    @property
    def bridge(self) -> str:
        return f"pdmb{self.suffix}"

    def close(self) -> None:
        try:
            for process in self.processes.values():
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for process in self.processes.values():
                try:
                    process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            for ns in self.namespaces.values():
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        finally:
            while self.rules:  # each recorded rule deleted once, the last added first
                with contextlib.suppress(subprocess.TimeoutExpired):
                    iptables("-D", *self.rules.pop())

    def log_tail(self, name: str, num_chars: int = 3000) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def iptables(*args: str) -> subprocess.CompletedProcess[str]:
    """`iptables -w ARGS` (waiting for the xtables lock, which dockerd takes too)."""
    return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, timeout=30)


def firewall_chains() -> dict[str, list[str]]:
    """`iptables -S CHAIN` of each of BRIDGE_CHAINS that exists here (none without iptables)."""
    if shutil.which("iptables") is None:
        return {}
    listed = {chain: iptables("-S", chain) for chain in BRIDGE_CHAINS}
    return {
        chain: done.stdout.splitlines() for chain, done in listed.items() if done.returncode == 0
    }


def allow_bridge_forwarding(net: Netns) -> None:
    """Let the bridge forward between its own ports through iptables: `-i BR -o BR -j ACCEPT` at the
    top of FORWARD and, where Docker made it, of DOCKER-USER. With br_netfilter loaded (dockerd
    loads it; `net.bridge.bridge-nf-call-iptables = 1`) bridged IPv4 passes FORWARD, whose policy
    dockerd sets to DROP; a bridge's own `bridge/nf_call_iptables = 0` cannot override the global 1.
    Only IPv4 needs it: the namespaces have IPv4 addresses and the hosts files name only those. Each
    rule is recorded in `net` before it is added, so `net.close()` deletes it whatever happens next.
    Without iptables (or a filter table it can list) nothing filters there and nothing is added."""
    for chain in firewall_chains():
        rule = [chain, "-i", net.bridge, "-o", net.bridge, "-j", "ACCEPT"]
        net.rules.append(rule)
        added = iptables("-I", *rule)
        assert added.returncode == 0, f"iptables -I {' '.join(rule)}: {added.stderr.strip()}"


def netns_unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, a bridge, /etc/netns)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    probe = f"pdm-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def free_subnet() -> str:
    """A 10.213.B.0/24 that no route of this host touches."""
    routes = subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True
    ).stdout
    for _ in range(50):
        subnet = f"10.213.{secrets.randbelow(254) + 1}"
        if f"{subnet}." not in routes and "10.213.0.0" not in routes:
            return subnet
    raise RuntimeError("no free 10.213.B.0/24")


def build_network(net: Netns, names: list[str]) -> None:
    """A bridge at .1, allowed to forward between its ports, and one namespace per name at .2, .3,
    ... with `eth0` and `lo` up; `net` records each piece as it is made, so `net.close()` removes a
    half-built network too."""
    ip("link", "add", net.bridge, "type", "bridge")
    ip("addr", "add", f"{net.subnet}.1/24", "dev", net.bridge)
    ip("link", "set", net.bridge, "up")
    allow_bridge_forwarding(net)
    for i, name in enumerate(names):
        ns, veth = f"pdm-{name}-{net.suffix}", f"pdv{net.suffix}{i}"
        net.namespaces[name] = ns
        net.addresses[name] = f"{net.subnet}.{i + 2}"
        ip("netns", "add", ns)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("link", "set", veth, "master", net.bridge, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{net.addresses[name]}/24", "dev", "eth0")
        ip("netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
    # `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts.
    hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in net.addresses.items())
    for ns in net.namespaces.values():
        (Path("/etc/netns") / ns).mkdir(parents=True, exist_ok=True)
        (Path("/etc/netns") / ns / "hosts").write_text(hosts)


def local_argv(argv: list[str], model_root: Path) -> list[str]:
    """A container's command line on this host: the venv's python, the test's Redis binaries,
    the test's model directory in place of the volume."""
    from pdmesh_service.redis_server import find_redis_server

    redis_server = find_redis_server()
    local = {
        "python": sys.executable,
        "redis-server": redis_server,
        "redis-cli": shutil.which("redis-cli") or str(Path(redis_server).with_name("redis-cli")),
    }
    argv = [local.get(argv[0], argv[0]), *argv[1:]]
    return [
        str(model_root) + a[len(MODEL_MOUNT) :] if a.startswith(MODEL_MOUNT + "/") else a
        for a in argv
    ]


def start_service(net: Netns, name: str, service: dict[str, Any], model_root: Path) -> None:
    env = {**os.environ, **{k: str(v) for k, v in (service.get("environment") or {}).items()}}
    argv = local_argv(service_argv(service), model_root)
    with open(net.logs / f"{name}.log", "wb") as log:
        net.processes[name] = subprocess.Popen(
            ["ip", "netns", "exec", net.namespaces[name], *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=net.logs,
        )


def wait_healthy(net: Netns, names: list[str], services: dict[str, Any], model_root: Path) -> None:
    """Run each service's compose healthcheck in its namespace until it passes (or times out)."""
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    pending = list(names)
    while pending:
        for name in list(pending):
            process = net.processes[name]
            assert process.poll() is None, (
                f"{name} exited {process.returncode}:\n{net.log_tail(name)}"
            )
            test = services[name]["healthcheck"]["test"]
            assert test[0] == "CMD", (name, test)
            check = local_argv([interpolate(a, {}) for a in test[1:]], model_root)
            done = subprocess.run(
                ["ip", "netns", "exec", net.namespaces[name], *check],
                capture_output=True,
                timeout=30,
            )
            if done.returncode == 0:
                pending.remove(name)
        if pending and time.monotonic() > deadline:
            pytest.fail(
                f"not healthy within {HEALTH_TIMEOUT_S:g}s: {pending}\n"
                + "\n".join(f"--- {n}\n{net.log_tail(n)}" for n in pending)
            )
        if pending:
            time.sleep(1.0)


def start_in_order(net: Netns, services: dict[str, Any], model_root: Path) -> None:
    """compose up: each wave is the services whose depends_on (those started here) are healthy;
    a wave waits only for the services another one depends on (the gateway, which no one waits
    for, is ready once a decode rank is), then every service must be healthy."""
    depended = {d for s in services.values() for d in s.get("depends_on", {})}
    started: set[str] = set()
    while len(started) < len(services):
        wave = [
            n
            for n, s in services.items()
            if n not in started and set(s.get("depends_on", {})) - set(NOT_STARTED) <= started
        ]
        assert wave, f"depends_on has a cycle among {sorted(set(services) - started)}"
        for name in wave:
            start_service(net, name, services[name], model_root)
        wait_healthy(net, [n for n in wave if n in depended], services, model_root)
        started |= set(wave)
    wait_healthy(net, list(services), services, model_root)


@contextlib.contextmanager
def namespace_network(names: list[str], logs: Path) -> Iterator[Netns]:
    """A network of namespaces (build_network) for the block; removed on the way out, also when
    the block (or the building) fails."""
    net = Netns(secrets.token_hex(3), free_subnet(), {}, {}, {}, logs)
    try:
        build_network(net, names)
        yield net
    finally:
        net.close()


class BlockFailed(Exception):
    """Raised inside a namespace network's block to take the path of a failing test."""


# Run in a namespace: a TCP listener that prints its port, and a client that connects by name.
LISTEN_SCRIPT = """
import socket
server = socket.create_server(("0.0.0.0", 0))
print(server.getsockname()[1], flush=True)
server.accept()[0].sendall(b"through")
"""
CONNECT_SCRIPT = """
import socket, sys
print(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).recv(64).decode())
"""


def test_netns_bridge_forwards_between_namespaces_and_leaves_the_host_firewall_as_it_was(
    tmp_path: Path,
) -> None:
    """Between two of the test's namespaces a TCP connection by name goes through the bridge (on a
    host with FORWARD policy DROP and br_netfilter, only because of the test's rules); while the
    network is up, the only rules naming the test's bridge are one ACCEPT between its ports per
    chain, and every policy is as it was; and after a block that fails, the same cleanup as the
    mesh test's leaves every chain's policy as it was and no rule naming the bridge. (Rules of
    others, e.g. a dockerd making a network meanwhile, may come and go.)"""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    before = firewall_chains()
    with pytest.raises(BlockFailed):
        with namespace_network(["server", "client"], tmp_path) as net:
            during = firewall_chains()
            listener = subprocess.Popen(
                ["ip", "netns", "exec", net.namespaces["server"], sys.executable, "-c"]
                + [LISTEN_SCRIPT],
                stdout=subprocess.PIPE,
                text=True,
            )
            net.processes["server"] = listener
            assert listener.stdout is not None
            port = listener.stdout.readline().strip()
            assert port, f"listener exited {listener.poll()}"
            done = subprocess.run(
                ["ip", "netns", "exec", net.namespaces["client"], sys.executable, "-c"]
                + [CONNECT_SCRIPT, "server", port],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert done.returncode == 0, f"client -> server across the bridge:\n{done.stderr}"
            assert done.stdout.strip() == "through", done.stdout
            raise BlockFailed
    after = firewall_chains()

    def policy(listing: list[str]) -> list[str]:
        return [line for line in listing if line.startswith(("-P ", "-N "))]

    assert during.keys() == before.keys() == after.keys(), (before, during, after)
    for chain in before:
        assert policy(during[chain]) == policy(after[chain]) == policy(before[chain]), chain
        ours = [rule for rule in during[chain] if net.bridge in rule]
        assert ours == [f"-A {chain} -i {net.bridge} -o {net.bridge} -j ACCEPT"], (chain, ours)
        assert not [rule for rule in after[chain] if net.bridge in rule], (chain, after[chain])
    assert net.rules == [], net.rules


@pytest.fixture()
def netns_mesh(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Netns]:
    """The compose mesh in network namespaces, serving a tiny checkpoint of the architecture the
    test asks for (DeepSeek-V3, or V4 whose hand-off moves its two KV groups)."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    from pdmesh.tools.model_init import init_model

    services = {n: s for n, s in compose()["services"].items() if n not in NOT_STARTED}
    model_name = Path(flag_value(service_argv(services["gateway"]), "--model")).name
    model_root = tmp_path / "models"
    init_model(model_root / model_name, "tiny", seed=0, arch=request.param, verbose=False)
    logs = tmp_path / "logs"
    logs.mkdir()
    with namespace_network([*services, "client"], logs) as net:
        start_in_order(net, services, model_root)
        yield net


# Run in the client namespace: the gateway and the workers by their compose names.
CLIENT_SCRIPT = """
import json, sys, urllib.request
from openai import OpenAI

gateway, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=f"http://{gateway}/v1", api_key="unused", max_retries=0, timeout=30)
completion = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8,
                                       temperature=0)
stream = client.chat.completions.create(model=model, max_tokens=8, temperature=0, stream=True,
                                        messages=[{"role": "user", "content": "Say hello"}])
chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
metrics = {url: urllib.request.urlopen(f"http://{url}/metrics", timeout=10).read().decode()
           for url in sys.argv[3:]}
print(json.dumps({"completion": completion.choices[0].text, "chunks": chunks, "metrics": metrics,
                  "completion_tokens": completion.usage.completion_tokens}))
"""


def samples(text: str, name: str) -> dict[str, float]:
    """The samples of one metric family in a Prometheus exposition, by their label set."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        json.dumps(s.labels, sort_keys=True): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("netns_mesh", ["deepseek_v3", "deepseek_v4"], indirect=True)
def test_compose_mesh_in_network_namespaces_serves_and_moves_kv_over_ucx_tcp(
    netns_mesh: Netns,
) -> None:
    services = compose()["services"]
    gateway_argv = service_argv(services["gateway"])
    gateway = f"gateway:{flag_value(gateway_argv, '--http-port')}"
    model = Path(flag_value(gateway_argv, "--model")).name
    worker_metrics = {
        role: f"{role}:{flag_value(service_argv(services[role]), '--metrics-port')}"
        for role in ("prefill", "decode")
    }
    for role in ("prefill", "decode"):
        assert services[role]["environment"]["UCX_TLS"] == "tcp"
        assert services[role]["environment"]["UCX_NET_DEVICES"] == "eth0"  # the namespace's veth
    done = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            netns_mesh.namespaces["client"],
            sys.executable,
            "-c",
            CLIENT_SCRIPT,
            gateway,
            model,
            gateway,
            *worker_metrics.values(),
        ],
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
    )
    logs = "\n".join(f"--- {n}\n{netns_mesh.log_tail(n)}" for n in ("gateway", "prefill", "decode"))
    assert done.returncode == 0, f"client failed:\n{done.stderr[-3000:]}\n{logs}"
    result = json.loads(done.stdout)
    assert result["completion_tokens"] > 0 and result["completion"], result
    assert "".join(result["chunks"]), result["chunks"]
    received = samples(
        result["metrics"][worker_metrics["decode"]], "pdmesh_kv_received_bytes_total"
    )
    sent = samples(result["metrics"][worker_metrics["prefill"]], "pdmesh_kv_transfer_bytes_total")
    assert sum(received.values()) > 0, f"decode received no KV over NIXL: {received}\n{logs}"
    assert sum(sent.values()) == sum(received.values()), (sent, received)
    requests = samples(result["metrics"][gateway], "pdmesh_requests_total")
    assert sum(requests.values()) >= 2, requests
