"""scripts/images/host_net.py: after a dockerd started for the image test, exactly Docker's part of
the host's iptables state is undone (its chains, the rules naming them or docker0, the policies it
changed), and a rule someone else added meanwhile stays."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "host_net", ROOT / "scripts" / "images" / "host_net.py"
)
assert spec is not None and spec.loader is not None
host_net = importlib.util.module_from_spec(spec)
sys.modules["host_net"] = host_net
spec.loader.exec_module(host_net)

BEFORE = """\
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -i lo -j ACCEPT
COMMIT
"""
AFTER = """\
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:DOCKER - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER
-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE
-A DOCKER -i docker0 -j RETURN
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
:DOCKER - [0:0]
:DOCKER-USER - [0:0]
-A INPUT -i lo -j ACCEPT
-A FORWARD -i pdmbab12 -o pdmbab12 -j ACCEPT
-A FORWARD -j DOCKER-USER
-A FORWARD -o docker0 -j DOCKER
-A DOCKER-USER -j RETURN
COMMIT
"""


def test_only_dockers_rules_chains_and_policy_are_undone() -> None:
    commands = host_net.undo(BEFORE, AFTER)
    assert ["-t", "filter", "-P", "FORWARD", "ACCEPT"] in commands
    assert ["-t", "filter", "-D", "FORWARD", "-j", "DOCKER-USER"] in commands
    assert ["-t", "filter", "-D", "FORWARD", "-o", "docker0", "-j", "DOCKER"] in commands
    assert ["-t", "nat", "-D", "POSTROUTING", "-s", "172.17.0.0/16", "!", "-o", "docker0", "-j",
            "MASQUERADE"] in commands  # fmt: skip
    deleted = {tuple(c[:4]) for c in commands if c[2] == "-X"}
    assert deleted == {("-t", "filter", "-X", "DOCKER"), ("-t", "filter", "-X", "DOCKER-USER"),
                       ("-t", "nat", "-X", "DOCKER")}  # fmt: skip
    # in each table, every chain is flushed before any is deleted (a referenced chain cannot go)
    for table in ("filter", "nat"):
        steps = [c[2] for c in commands if c[1] == table]
        assert steps.index("-X") > max(i for i, s in enumerate(steps) if s in ("-D", "-F"))
    # another test's own rule, added while Docker ran, stays; nothing of the host's is touched
    assert not any("pdmbab12" in c for command in commands for c in command)
    assert not any("INPUT" in command for command in commands)


def test_nothing_to_undo_when_docker_changed_nothing() -> None:
    assert host_net.undo(BEFORE, BEFORE) == []
    assert host_net.undo("", "") == []
