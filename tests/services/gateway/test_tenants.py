"""Tenants: the key file (errors name the entry and field, never the key), classes and clamping,
the token bucket, and the fair queue's adapter answers (429 + Retry-After, 408, 499) in the
OpenAI error shape."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdmesh_gateway.admission import Shed
from pdmesh_gateway.auth import InvalidApiKey, Keys, check_authorization
from pdmesh_gateway.fair_queue import FairQueueConfig
from pdmesh_gateway.openai_api import error_body
from pdmesh_gateway.tenant_admission import QueueTimeout, TenantAdmission, tenancy_of
from pdmesh_gateway.tenants import (
    OPEN_TENANT,
    PriorityClass,
    Tenancy,
    TenantLimits,
    Tenants,
    TokenBucket,
    body_priority,
    request_class,
)
from pdmesh_service.errors import InvalidArgument

SECRET = "sk-acme-very-secret-key"
DOC = {
    "keys": {
        SECRET: {
            "tenant": "acme",
            "max_priority": "interactive",
            "max_concurrency": 8,
            "max_queued": 64,
            "max_tokens_per_s": 2000,
            "cache_salt": "acme",
        },
        "sk-bulk-0000000": {"tenant": "bulk", "max_priority": "batch"},
    }
}


def test_the_key_file_parses_json_and_yaml(tmp_path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(DOC))
    tenants = Tenants.from_file(path)
    acme = tenants.lookup(SECRET)
    assert acme == TenantLimits("acme", PriorityClass.INTERACTIVE, 8, 64, 2000.0, "acme")
    assert tenants.lookup("sk-bulk-0000000").max_priority is PriorityClass.BATCH
    assert tenants.lookup("sk-nope-0000000") is None
    assert [t.tenant for t in tenants.tenants] == ["acme", "bulk"]
    yaml_path = tmp_path / "keys.yaml"
    yaml_path.write_text("keys:\n  sk-yaml-00000000:\n    tenant: y\n    max_concurrency: 2\n")
    assert Tenants.from_file(yaml_path).lookup("sk-yaml-00000000").max_concurrency == 2
    # every field but tenant is optional: system is granted, never assumed
    only = Tenants.parse({"keys": {"sk-only-00000000": {"tenant": "o"}}})
    assert only.lookup("sk-only-00000000") == TenantLimits("o")


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"max_concurrency": 8}, "tenant"),
        ({"tenant": "a", "max_concurrency": 0}, "max_concurrency"),
        ({"tenant": "a", "max_queued": "many"}, "max_queued"),
        ({"tenant": "a", "max_tokens_per_s": -1}, "max_tokens_per_s"),
        ({"tenant": "a", "max_priority": "urgent"}, "max_priority"),
        ({"tenant": "a", "cache_salt": 3}, "cache_salt"),
        ({"tenant": "a", "colour": "red"}, "colour"),
    ],
)
def test_key_file_errors_name_the_entry_and_field_never_the_key(entry, field, tmp_path) -> None:
    doc = {"keys": {"sk-first-00000000": {"tenant": "ok"}, SECRET: entry}}
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as info:
        Tenants.from_file(path)
    message = str(info.value)
    assert "keys[1]" in message and field in message and SECRET not in message


def test_key_file_shape_errors_never_echo_the_key(tmp_path) -> None:
    for text in ("[]", '{"keys": {}}', '{"keys": {"' + SECRET + '": }}'):
        path = tmp_path / "keys.json"
        path.write_text(text)
        with pytest.raises(ValueError) as info:
            Tenants.from_file(path)
        assert SECRET not in str(info.value)
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  {SECRET}: [unclosed\n")
    with pytest.raises(ValueError) as info:
        Tenants.from_file(path)
    assert SECRET not in str(info.value)
    with pytest.raises(ValueError, match=r"keys\[0\].*8 characters"):
        Tenants.parse({"keys": {"short": {"tenant": "a"}}})
    doc = {"keys": {"sk-a-000000000": {"tenant": "a"}, SECRET: {"tenant": "a", "max_queued": 1}}}
    with pytest.raises(ValueError, match=r"keys\[1\].*other limits") as info:
        Tenants.parse(doc)
    assert SECRET not in str(info.value)


def test_classes_from_names_and_vllm_integers_clamped_to_the_tenant() -> None:
    assert [PriorityClass.parse(v) for v in ("System", "interactive", "default", "batch")] == list(
        PriorityClass
    )
    # an integer maps to the band that holds it; vLLM's default 0 is `default`
    ints = {-100: "system", -20: "system", -19: "interactive", -10: "interactive", -1: "default"}
    ints |= {0: "default", 1: "batch", 10: "batch", 99: "batch"}
    assert {v: str(PriorityClass.parse(v)) for v in ints} == ints
    assert PriorityClass.parse("-15") is PriorityClass.INTERACTIVE
    assert all(PriorityClass.of_int(c.value) is c for c in PriorityClass)
    bulk = TenantLimits("bulk", max_priority=PriorityClass.BATCH)
    assert request_class("system", None, bulk) is PriorityClass.BATCH  # clamped, not refused
    assert request_class(None, 0, OPEN_TENANT) is PriorityClass.DEFAULT
    assert request_class(" interactive ", "batch", OPEN_TENANT) is PriorityClass.INTERACTIVE
    assert request_class(None, None, TenantLimits("a")) is PriorityClass.DEFAULT
    assert request_class("system", None, TenantLimits("a")) is PriorityClass.INTERACTIVE
    assert body_priority({"priority": -10}) == -10 and body_priority([]) is None
    with pytest.raises(ValueError, match="x-pdmesh-priority"):
        request_class("urgent", None, OPEN_TENANT)
    with pytest.raises(ValueError):
        PriorityClass.parse(True)


def test_tenancy_from_the_authorization_header() -> None:
    tenants = Tenants.parse(DOC)
    acme = tenancy_of(tenants, f"Bearer {SECRET}", "system", None)
    assert acme == Tenancy(tenants.lookup(SECRET), PriorityClass.INTERACTIVE)
    assert tenancy_of(None, f"Bearer {SECRET}", None, "batch") == Tenancy(
        OPEN_TENANT, PriorityClass.BATCH
    )
    assert tenancy_of(tenants, None, "system", None).priority is PriorityClass.SYSTEM
    with pytest.raises(InvalidArgument) as info:
        tenancy_of(tenants, None, "nope", None)
    assert info.value.param == "priority" and info.value.http_status == 400


def test_keys_accept_the_single_key_and_every_tenant_key() -> None:
    keys = Keys("sk-admin-0000000", Tenants.parse(DOC))
    for key in ("sk-admin-0000000", SECRET, "sk-bulk-0000000"):
        check_authorization(f"Bearer {key}", keys)
    with pytest.raises(InvalidApiKey) as info:
        check_authorization("Bearer sk-wrong-000000", keys)
    assert "sk-wrong" not in str(info.value)


def test_the_token_bucket_bounds_the_rate() -> None:
    bucket = TokenBucket(100.0)
    assert bucket.is_open(0.0) and bucket.level == 100
    bucket.charge(250, 0.0)  # may go into debt: tokens are known as they come
    assert not bucket.is_open(0.0) and bucket.opens_at(0.0) == pytest.approx(1.5)
    assert not bucket.is_open(1.4) and bucket.is_open(1.5)
    assert bucket.refill(100.0) == 100  # the burst is one second's worth
    # charged whenever open, over T seconds at most rate x (T + 1) + one charge past zero
    bucket, charged, now = TokenBucket(100.0), 0, 0.0
    while now < 10.0:
        if bucket.is_open(now):
            bucket.charge(37, now)
            charged += 37
        now += 0.01
    assert charged <= 100 * (10 + 1) + 37
    with pytest.raises(ValueError):
        TokenBucket(0.0)


def _run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 10))


def test_a_full_tenant_queue_is_429_with_retry_after_in_the_openai_shape() -> None:
    async def scenario() -> None:
        gate = TenantAdmission(FairQueueConfig(capacity=1))
        tenant = Tenancy(TenantLimits("t", max_concurrency=1, max_queued=1))
        far = asyncio.get_running_loop().time() + 60
        first = await gate.admit(tenant, 10, 5, far)
        waiting = asyncio.ensure_future(gate.admit(tenant, 10, 5, far))
        await asyncio.sleep(0.01)
        with pytest.raises(Shed) as info:
            await gate.admit(tenant, 10, 5, far)
        shed = info.value
        assert shed.http_status == 429 and shed.retry_after_header == "1"
        assert error_body(shed)["error"] == {
            "message": "too many requests are queued for tenant 't'; retry later",
            "type": "rate_limit_exceeded",
            "param": None,
            "code": "queue_tenant_full",
        }
        gate.finished(first)
        second = await waiting
        gate.finished(second)
        view = gate.view()["classes"][0]
        assert view["admitted_requests"] == 2 and view["rejected_requests"] == {"tenant_full": 1}

    _run(scenario())


def test_a_wait_past_the_queue_timeout_is_408_and_a_client_gone_is_counted() -> None:
    async def scenario() -> None:
        gate = TenantAdmission(FairQueueConfig(capacity=1), queue_timeout_s=0.1)
        tenant = Tenancy(TenantLimits("t"))
        far = asyncio.get_running_loop().time() + 60
        held = await gate.admit(tenant, 10, 5, far)
        with pytest.raises(QueueTimeout) as info:
            await gate.admit(tenant, 10, 5, far)
        assert info.value.http_status == 408
        assert error_body(info.value)["error"]["type"] == "timeout_error"
        assert error_body(info.value)["error"]["code"] == "queue_timeout"
        gone = asyncio.ensure_future(gate.admit(tenant, 10, 5, far))
        await asyncio.sleep(0.01)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert gate.num_queued == 0
        gate.finished(held)
        row = gate.view()["classes"][0]
        assert row["rejected_requests"] == {"timeout": 1, "client_gone": 1}

    _run(scenario())


def test_a_rate_limited_tenant_is_woken_by_its_bucket_not_by_polling() -> None:
    async def scenario() -> None:
        gate = TenantAdmission(FairQueueConfig(capacity=4))
        tenant = Tenancy(TenantLimits("t", max_tokens_per_s=100.0))
        far = asyncio.get_running_loop().time() + 60
        first = await gate.admit(tenant, 150, 150, far)  # 150 prompt tokens: 50 in debt
        gate.finished(first)
        clock = asyncio.get_running_loop().time
        t0 = clock()
        second = await gate.admit(tenant, 10, 10, far)
        assert 0.3 < clock() - t0 < 2.0  # the debt (50 tokens) at 100 tokens/s
        gate.finished(second)

    _run(scenario())


def test_a_waiter_cancelled_as_it_is_granted_gives_its_slot_back() -> None:
    """The race: the client goes (its future is cancelled at once) and a slot frees before the
    waiter runs again; the grant it got must come back."""

    async def scenario() -> None:
        gate = TenantAdmission(FairQueueConfig(capacity=1))
        tenant = Tenancy(TenantLimits("t"))
        far = asyncio.get_running_loop().time() + 60
        held = await gate.admit(tenant, 10, 5, far)
        waiter = asyncio.ensure_future(gate.admit(tenant, 10, 5, far))
        await asyncio.sleep(0.01)
        waiter.cancel()
        gate.finished(held)  # grants the cancelled waiter before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.core.num_starting == 0 and gate.core.running("t") == 0
        again = await asyncio.wait_for(gate.admit(tenant, 10, 5, far), 1)
        gate.finished(again)

    _run(scenario())
