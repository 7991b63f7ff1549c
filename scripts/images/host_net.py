"""What a `dockerd` started for a test changes on the host's network, and putting it back.

    python scripts/images/host_net.py snapshot DIR    # before starting dockerd
    python scripts/images/host_net.py restore DIR     # after it stopped

dockerd sets the iptables FORWARD policy to DROP, adds its chains (DOCKER, DOCKER-USER,
DOCKER-ISOLATION-STAGE-*) and the rules that jump to them or name docker0 (filter and nat
tables), creates the docker0 bridge and loads br_netfilter (bridge-nf-call-iptables = 1); all of
it stays after dockerd stops, and bridged traffic on the host is then dropped. `restore` undoes
exactly that: the rules and chains that were not there before and belong to Docker, the policies
as they were, docker0, and the bridge sysctls. Rules anyone else added meanwhile stay.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

TOOLS = ("iptables", "ip6tables")
SYSCTLS = ("bridge-nf-call-iptables", "bridge-nf-call-ip6tables")
BRIDGE = Path("/proc/sys/net/bridge")
DOCKERISH = re.compile(r"DOCKER|docker0")


def _save(tool: str) -> str:
    if shutil.which(f"{tool}-save") is None:
        return ""
    done = subprocess.run([f"{tool}-save"], capture_output=True, text=True, check=False)
    return done.stdout if done.returncode == 0 else ""


def parse(saved: str) -> dict[str, dict[str, list[str]]]:
    """{table: {"policies": [":CHAIN POLICY"], "chains": [names], "rules": ["-A ..."]}}."""
    tables: dict[str, dict[str, list[str]]] = {}
    table: dict[str, list[str]] | None = None
    for line in saved.splitlines():
        if line.startswith("*"):
            table = tables.setdefault(line[1:], {"policies": [], "chains": [], "rules": []})
        elif table is None or line.startswith(("#", "COMMIT")):
            continue
        elif line.startswith(":"):
            name, policy = line[1:].split()[:2]
            table["chains"].append(name)
            if policy != "-":
                table["policies"].append(f"{name} {policy}")
        elif line.startswith("-A "):
            table["rules"].append(line)
    return tables


def undo(before: str, after: str) -> list[list[str]]:
    """The iptables arguments that take `after` back to `before` for Docker's part."""
    old, new = parse(before), parse(after)
    commands: list[list[str]] = []
    for name, table in new.items():
        was = old.get(name, {"policies": [], "chains": [], "rules": []})
        for rule in table["rules"]:
            if rule not in was["rules"] and DOCKERISH.search(rule):
                commands.append(["-t", name, "-D", *rule.split()[1:]])
        added = [c for c in table["chains"] if c not in was["chains"] and DOCKERISH.search(c)]
        for chain in added:
            commands.append(["-t", name, "-F", chain])
        for chain in added:
            commands.append(["-t", name, "-X", chain])
        for policy in was["policies"]:
            if policy not in table["policies"]:
                commands.append(["-t", name, "-P", *policy.split()])
    return commands


def snapshot(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:
        (folder / f"{tool}.before").write_text(_save(tool))
    values = [f"{k} {(BRIDGE / k).read_text().strip()}" for k in SYSCTLS if (BRIDGE / k).exists()]
    (folder / "bridge.before").write_text("\n".join(values) + "\n" if values else "absent\n")


def restore(folder: Path) -> None:
    for tool in TOOLS:
        for args in undo((folder / f"{tool}.before").read_text(), _save(tool)):
            subprocess.run([tool, "-w", *args], capture_output=True, check=False)
    if subprocess.run(["ip", "link", "show", "docker0"], capture_output=True).returncode == 0:
        subprocess.run(["ip", "link", "delete", "docker0"], check=False)
    before = (folder / "bridge.before").read_text().split("\n")
    if before[0] == "absent":  # br_netfilter was not loaded: unload it, or at least disarm it
        unloaded = subprocess.run(["modprobe", "-r", "br_netfilter"], capture_output=True)
        if unloaded.returncode != 0:
            for key in SYSCTLS:
                if (BRIDGE / key).exists():
                    (BRIDGE / key).write_text("0\n")
        return
    for line in filter(None, before):
        key, value = line.split()
        (BRIDGE / key).write_text(value + "\n")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("snapshot", "restore"):
        print(__doc__, file=sys.stderr)
        return 2
    (snapshot if argv[0] == "snapshot" else restore)(Path(argv[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
