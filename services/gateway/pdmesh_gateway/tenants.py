"""Tenants at the front door (pure: no asyncio, grpc or I/O but reading the key file).

`--api-keys-file FILE` maps API keys to tenants, JSON (or YAML by its suffix) of this shape, every
field but `tenant` optional:

    {"keys": {"<api key>": {"tenant": "acme", "max_priority": "interactive", "max_concurrency": 8,
                           "max_queued": 64, "max_tokens_per_s": 2000, "cache_salt": "acme"}}}

- `max_priority`: the most urgent class the tenant's requests may ask for (asking for more is
  clamped to it, never refused); absent: `interactive` (`system` is granted, never assumed).
- `max_concurrency`: requests of the tenant that run at once (granted until their end);
  `max_queued`: requests that may wait beyond those (more: 429 with Retry-After); absent: no bound.
- `max_tokens_per_s`: a token bucket over prompt + output tokens (`TokenBucket`): a request starts
  only while the bucket is not in debt; prompt tokens are charged when it starts, output tokens as
  they stream.
- `cache_salt`: the salt of the tenant's requests that carry none (prefix caches are shared only
  within a salt).
Several keys may name one tenant; they must then agree on its limits. The single `--api-key` (or
no key at all) is one tenant, `OPEN_TENANT`, with no limits.

Priority classes (`PriorityClass`): strict order system > interactive > default > batch; each maps
to the engine's `SamplingParams.priority` (vLLM's meaning: lower runs first), its value. From the
`x-pdmesh-priority` header (a class name or an integer) or the body's `priority` field (vLLM's
integer, or a class name). An integer maps to the class whose band holds it: p <= -20 system,
-20 < p <= -10 interactive, -10 < p <= 0 default, p > 0 batch; so vLLM's default 0 is `default`,
and a class's own value maps back to it.

Errors name the entry by its index among the keys (`keys[2]`) and the field, never the key.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

PRIORITY_HEADER = "x-pdmesh-priority"


class PriorityClass(IntEnum):
    """A request's class; the value is the engine's `SamplingParams.priority` (lower runs first)."""

    SYSTEM = -20
    INTERACTIVE = -10
    DEFAULT = 0
    BATCH = 10

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def of_int(cls, value: int) -> PriorityClass:
        """The class whose band holds the vLLM integer `value` (module docstring)."""
        return next((c for c in cls if value <= c.value), cls.BATCH)

    @classmethod
    def parse(cls, value: Any, what: str = "priority") -> PriorityClass:
        """A class from a name (any case), an integer, or an integer's text; ValueError naming
        `what` otherwise."""
        if isinstance(value, bool):
            raise ValueError(f"{what} must be a class name or an integer, got a boolean")
        if isinstance(value, int):
            return cls.of_int(value)
        if isinstance(value, str):
            text = value.strip().lower()
            by_name = {str(c): c for c in cls}
            if text in by_name:
                return by_name[text]
            try:
                return cls.of_int(int(text))
            except ValueError:
                pass
        names = ", ".join(str(c) for c in cls)
        raise ValueError(f"{what} must be one of {names} or an integer, got {value!r}")

    def clamp(self, most: PriorityClass) -> PriorityClass:
        """This class, or `most` when this one is more urgent than the tenant may ask for."""
        return max(self, most)


CLASSES: tuple[PriorityClass, ...] = tuple(sorted(PriorityClass))  # most urgent first


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits (module docstring); None: no such bound."""

    tenant: str
    max_priority: PriorityClass = PriorityClass.INTERACTIVE
    max_concurrency: int | None = None
    max_queued: int | None = None
    max_tokens_per_s: float | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class Tenancy:
    """Whose a request is and its class (clamped to the tenant's `max_priority`)."""

    limits: TenantLimits
    priority: PriorityClass = PriorityClass.DEFAULT


# the tenant of a gateway with one --api-key, or none: every request, no limits
OPEN_TENANT = TenantLimits("default", max_priority=PriorityClass.SYSTEM)
_FIELDS = ("tenant", "max_priority", "max_concurrency", "max_queued", "max_tokens_per_s")
_FIELDS += ("cache_salt",)


def _positive_int(where: str, name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return value


def _limits(where: str, entry: Any) -> TenantLimits:
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}: must be an object with at least 'tenant'")
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {list(_FIELDS)}")
    tenant = entry.get("tenant")
    if not isinstance(tenant, str) or not tenant.strip():
        raise ValueError(f"{where}: tenant must be a non-empty string")
    rate = entry.get("max_tokens_per_s")
    if rate is not None and (
        isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf
    ):
        raise ValueError(f"{where}: max_tokens_per_s must be a positive number, got {rate!r}")
    salt = entry.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"{where}: cache_salt must be a non-empty string")
    try:
        most = PriorityClass.parse(entry.get("max_priority", "interactive"), "max_priority")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return TenantLimits(
        tenant.strip(),
        most,
        _positive_int(where, "max_concurrency", entry.get("max_concurrency")),
        _positive_int(where, "max_queued", entry.get("max_queued")),
        None if rate is None else float(rate),
        salt,
    )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Tenants:
    """The key table: `lookup(key)` is the key's tenant, or None. Keys are held as SHA-256 digests,
    so a lookup's time does not depend on how much of a wrong key matched."""

    by_digest: Mapping[bytes, TenantLimits] = field(repr=False)

    @classmethod
    def parse(cls, doc: Any) -> Tenants:
        """The table from the parsed file (module docstring); ValueError naming the entry's index
        and the field."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("keys"), Mapping):
            raise ValueError("the API keys file must be an object with a 'keys' object")
        if not doc["keys"]:
            raise ValueError("the API keys file lists no key")
        table: dict[bytes, TenantLimits] = {}
        by_tenant: dict[str, TenantLimits] = {}
        for index, (key, entry) in enumerate(doc["keys"].items()):
            where = f"keys[{index}]"
            if not isinstance(key, str) or len(key.strip()) < 8 or key != key.strip():
                raise ValueError(f"{where}: the key must be at least 8 characters, no spaces")
            if not key.isprintable() or " " in key:
                raise ValueError(f"{where}: the key must be printable, without spaces")
            limits = _limits(where, entry)
            known = by_tenant.setdefault(limits.tenant, limits)
            if known != limits:
                raise ValueError(
                    f"{where}: tenant {limits.tenant!r} is given other limits by an earlier key"
                )
            table[_digest(key)] = limits
        return cls(table)

    @classmethod
    def from_file(cls, path: str | Path) -> Tenants:
        """Read `path`: YAML when it ends in .yaml/.yml, else JSON."""
        text = Path(path).read_text(encoding="utf-8")
        is_yaml = str(path).endswith((".yaml", ".yml"))
        errors: tuple[type[Exception], ...] = (ValueError,)
        try:
            if is_yaml:
                import yaml  # only for YAML files

                errors += (yaml.YAMLError,)
                doc = yaml.safe_load(text)
            else:
                doc = json.loads(text)
        except errors as e:  # its message may quote the file (a key): only the position
            mark = getattr(e, "problem_mark", None)
            line = getattr(e, "lineno", None) or (mark.line + 1 if mark is not None else "?")
            raise ValueError(f"--api-keys-file {path}: cannot be parsed (line {line})") from None
        try:
            return cls.parse(doc)
        except ValueError as e:
            raise ValueError(f"--api-keys-file {path}: {e}") from None

    def lookup(self, key: str) -> TenantLimits | None:
        return self.by_digest.get(_digest(key))

    @property
    def tenants(self) -> list[TenantLimits]:
        """Each tenant once, by name."""
        return sorted({t.tenant: t for t in self.by_digest.values()}.values(), key=_name)


def _name(limits: TenantLimits) -> str:
    return limits.tenant


def request_class(header: str | None, body_priority: Any, tenant: TenantLimits) -> PriorityClass:
    """The class of a request: the header's, else the body's `priority`, else `default`; clamped
    to the tenant's `max_priority`. ValueError (a 400) for a value that names no class."""
    if header is not None and header.strip():
        asked = PriorityClass.parse(header, PRIORITY_HEADER)
    elif body_priority is not None:
        asked = PriorityClass.parse(body_priority, "priority")
    else:
        asked = PriorityClass.DEFAULT
    return asked.clamp(tenant.max_priority)


def body_priority(body: Any) -> Any:
    """The `priority` field of a parsed REST body (vLLM's request field), or None."""
    return body.get("priority") if isinstance(body, Mapping) else None


@dataclass(slots=True)
class TokenBucket:
    """Tokens per second with a burst of one second's worth. `charge` may drive the level below 0
    (a request's tokens are known only as they come); the tenant may start a request only while
    the level is >= 0, so over any window of T seconds it is charged at most rate x (T + 1) plus
    what its last started requests were charged past 0."""

    rate: float
    level: float = 0.0
    at: float = 0.0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"max_tokens_per_s must be positive, got {self.rate}")
        self.level = self.rate  # full

    @property
    def burst(self) -> float:
        return self.rate

    def refill(self, now: float) -> float:
        """The level at `now` (time never runs backwards here)."""
        if now > self.at:
            self.level = min(self.burst, self.level + (now - self.at) * self.rate)
            self.at = now
        return self.level

    def is_open(self, now: float) -> bool:
        return self.refill(now) >= 0

    def charge(self, tokens: int, now: float) -> None:
        self.refill(now)
        self.level -= tokens

    def opens_at(self, now: float) -> float:
        """When `is_open` becomes true (now, if it is)."""
        level = self.refill(now)
        return now if level >= 0 else now + -level / self.rate
