"""Revision fencing (pure): the fingerprint is stable across processes and changes with each of its
components; the registry record and KV target carry it; the prefill rank refuses a target of
another revision, naming what differs; the gateway's router pairs ranks of one revision only."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pdmesh_engine.transfer.layout import KV_FORMAT_VERSION, KVGroup, PoolLayout
from pdmesh_engine.transfer.pb import group_to_pb
from pdmesh_gateway.router import NoInstance, Router
from pdmesh_gateway.routing import choose_revision
from pdmesh_prefill.core import PushTarget, RevisionMismatch, check_revision
from pdmesh_prefill.servicer import target_from_pb
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_service.errors import FailedPrecondition
from pdmesh_service.instance import InstanceInfo, Load, Role
from pdmesh_service.revision import (
    PARTS,
    Revision,
    checkpoint_identity,
    differing_parts,
    fingerprint,
    mismatch,
    revision_parts,
)

POOL = PoolLayout(4096, 3, 16, 8, 256, 16 * 256)
GROUPS = (KVGroup("kv", (POOL,)),)


def _checkpoint(root: Path, weights: bytes = b"\x01" * 64, config: str = '{"a": 1}') -> Path:
    """A checkpoint directory: config.json and one safetensors file (8-byte header length, JSON
    header, data)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(config)
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(weights)], "data_offsets": [0, 64]}})
    raw = header.encode()
    (root / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + weights)
    return root


def _parts(checkpoint: str = "c0", **changes: object) -> dict[str, str]:
    groups = changes.pop("groups", GROUPS)
    dtype = str(changes.pop("dtype", "float32"))
    speculative = str(changes.pop("speculative", ""))
    kv_format = int(changes.pop("kv_format", KV_FORMAT_VERSION))  # type: ignore[call-overload]
    return revision_parts(checkpoint, groups, dtype, speculative, kv_format)  # type: ignore[arg-type]


def test_the_fingerprint_is_stable_across_processes(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "m")
    here = Revision(_parts(checkpoint_identity(model))).fingerprint
    code = (
        "from pdmesh_engine.transfer.layout import KVGroup, PoolLayout, KV_FORMAT_VERSION\n"
        "from pdmesh_service.revision import Revision, checkpoint_identity, revision_parts\n"
        "g = (KVGroup('kv', (PoolLayout(1 << 30, 3, 99, 8, 256, 99 * 256),)),)\n"
        f"c = checkpoint_identity({str(model)!r})\n"
        "print(Revision(revision_parts(c, g, 'float32', '', KV_FORMAT_VERSION)).fingerprint)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # another process, another pool address and block count: the same revision
    assert out.stdout.strip() == here
    assert len(here) == 12 and fingerprint({}) == ""


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        ("checkpoint", {"checkpoint": "c1"}),
        (
            "kv_layout",
            {
                "groups": (
                    KVGroup("kv", (replace(POOL, block_bytes=512, layer_stride_bytes=16 * 512),)),
                )
            },
        ),
        ("block_size", {"groups": (KVGroup("kv", (replace(POOL, block_size=16),)),)}),
        ("dtype", {"dtype": "bfloat16"}),
        ("speculative", {"speculative": "mtp"}),
        ("kv_format", {"kv_format": KV_FORMAT_VERSION + 1}),
    ],
)
def test_each_component_changes_the_fingerprint(name: str, changes: dict[str, object]) -> None:
    base = _parts()
    other = _parts(**changes)  # type: ignore[arg-type]
    assert fingerprint(base) != fingerprint(other)
    assert name in differing_parts(base, other)
    assert set(base) == set(PARTS)


def test_the_checkpoint_identity_reads_config_headers_and_sampled_weights(tmp_path: Path) -> None:
    a = checkpoint_identity(_checkpoint(tmp_path / "a"))
    assert checkpoint_identity(_checkpoint(tmp_path / "same")) == a  # the path does not count
    assert checkpoint_identity(_checkpoint(tmp_path / "w", weights=b"\x02" * 64)) != a
    assert checkpoint_identity(_checkpoint(tmp_path / "c", config='{"a": 2}')) != a
    # a draft model's checkpoint is part of it
    assert checkpoint_identity(tmp_path / "a", tmp_path / "w") != a
    with pytest.raises(ValueError, match="no config.json"):
        checkpoint_identity(tmp_path / "nowhere")


def test_the_registry_record_carries_the_revision() -> None:
    parts = _parts()
    info = InstanceInfo("decode-0", Role.DECODE, "h:1", revision=fingerprint(parts))
    back = InstanceInfo.from_json(info.to_json())
    assert back == info and back.revision == fingerprint(parts)
    # a record of an older worker has none; it still parses
    old = json.loads(info.to_json())
    for key in ("revision", "draining"):
        old.pop(key)
    legacy = InstanceInfo.from_json(json.dumps(old))
    assert legacy.revision == "" and not legacy.draining


def _target(parts: dict[str, str]) -> PushTarget:
    pb = common_pb2.KVTarget(
        agent_name="decode-0",
        groups=[group_to_pb(g) for g in GROUPS],
        revision=fingerprint(parts),
        revision_parts=parts,
    )
    pb.groups[0].block_ids.extend([1, 2])
    return target_from_pb(pb)


def test_prefill_refuses_a_target_of_another_revision_naming_what_differs() -> None:
    mine = Revision(_parts())
    check_revision(_target(_parts()), mine)
    theirs = _parts(groups=(KVGroup("kv", (replace(POOL, block_size=16),)),))
    with pytest.raises(RevisionMismatch) as e:
        check_revision(_target(theirs), mine)
    assert isinstance(e.value, FailedPrecondition)  # FAILED_PRECONDITION on the wire
    message = str(e.value)
    assert mine.fingerprint in message and fingerprint(theirs) in message
    assert "block_size '8' here, '16' there" in message and "kv_layout" in message
    assert "dtype '" not in message and "checkpoint '" not in message  # only what differs
    # a decode rank that reports no revision (an older release) is refused too
    with pytest.raises(RevisionMismatch, match="there"):
        check_revision(_target({}), mine)
    assert mismatch("a", {}, "a", {}) is None


# ----- the router -----
def _rank(name: str, role: Role, revision: str, running: int = 0, **kw: object) -> InstanceInfo:
    return InstanceInfo(
        name,
        role,
        f"h:{name}",
        ready=True,
        revision=revision,
        stats=Load(num_running=running),
        **kw,  # type: ignore[arg-type]
    )


def test_a_request_takes_the_least_loaded_decode_ranks_revision() -> None:
    assert choose_revision([("old", (3,)), ("new", (1,))], {"old"}) == "new"
    # a tie goes to the revision a hand-off can pair, then to the smallest
    assert choose_revision([("new", (1,)), ("old", (1,))], {"old"}) == "old"
    assert choose_revision([("b", (0,)), ("a", (0,))], {"a", "b"}) == "a"
    with pytest.raises(ValueError):
        choose_revision([], set())


def test_the_router_pairs_only_ranks_of_one_revision() -> None:
    router = Router()
    router.update(
        [
            _rank("decode-0", Role.DECODE, "new", running=0),
            _rank("decode-1", Role.DECODE, "old", running=2),
            _rank("prefill-0", Role.PREFILL, "new"),
            _rank("prefill-1", Role.PREFILL, "old"),
        ]
    )
    assert router.revisions(Role.DECODE) == {"new": 1, "old": 1}
    revision = router.decode_revision()
    assert revision == "new"  # decode-0 is the least loaded
    assert [i.instance_id for i in router.ready(Role.PREFILL, revision)] == ["prefill-0"]
    assert router.pick_decode(revision=revision).instance_id == "decode-0"
    # without decode-0, the request is of the old revision, on old ranks only
    assert router.decode_revision(exclude={"decode-0"}) == "old"
    assert router.pick_decode(revision="old").instance_id == "decode-1"
    with pytest.raises(NoInstance, match="of revision new left to try"):
        router.pick_decode(exclude={"decode-0"}, revision="new")
    # a revision with no prefill rank up: no prefill candidate (its decode ranks prefill alone)
    router.update([_rank("decode-0", Role.DECODE, "new"), _rank("prefill-1", Role.PREFILL, "old")])
    assert router.decode_revision() == "new" and router.ready(Role.PREFILL, "new") == []


def test_a_draining_rank_takes_nothing_new_but_stays_live() -> None:
    router = Router()
    router.update(
        [
            _rank("decode-0", Role.DECODE, "old", draining=True),
            _rank("decode-1", Role.DECODE, "new", running=5),
        ]
    )
    assert [i.instance_id for i in router.ready(Role.DECODE)] == ["decode-1"]
    assert router.pick_decode().instance_id == "decode-1"
    assert router.decode_revision() == "new"
    assert router.is_live("decode-0")  # its open calls are not abandoned
