"""Redis clients from a `--redis-url`: the one place a URL becomes a client (async or sync).

Two kinds of URL:

    redis://[[user]:password@]host:port/db, rediss://..., unix:///path?db=N
        one server (redis-py's `from_url`, unchanged)
    redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db][?options]
    rediss+sentinel://...  (TLS to the data nodes)
        Redis Sentinel: the sentinels are asked which node is the primary of `service_name` (the
        name in their `sentinel monitor` line); the port defaults to 26379, `db` to 0. The URL's
        user and password authenticate to the data nodes; `?sentinel_password=` (and
        `sentinel_username=`) to the sentinels, when they require it. Other query options are
        redis-py's URL options (`socket_timeout`, `socket_connect_timeout`, ...) for the data
        nodes.

Unless the URL sets them, a Sentinel client's data connections time out after `DATA_TIMEOUT_S`
(connecting after `DATA_CONNECT_TIMEOUT_S`): a primary whose host vanished without closing its
sockets must fail the command, so that the next one asks the sentinels again, rather than hang it
(the services issue no blocking commands).

A Sentinel client follows failovers by itself (redis-py's `SentinelConnectionPool`): every new
connection asks the sentinels for the current primary, and a connection whose server answers
READONLY (a demoted primary) is dropped and surfaces as `redis.exceptions.ConnectionError`. So
after a failover each command in flight fails once with a `ConnectionError` (a subclass of
`RedisError`, which the services' loops already survive: they retry on their next tick) and the next
one reaches the new primary. Closing the client closes its sentinel connections too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.sentinel import Sentinel as SyncSentinel
from redis.sentinel import SentinelConnectionPool as SyncSentinelPool

__all__ = [
    "PLAIN_SCHEMES",
    "SENTINEL_PORT",
    "SENTINEL_SCHEMES",
    "SentinelURL",
    "check_redis_url",
    "connect",
    "connect_sync",
    "is_sentinel_url",
    "parse_sentinel_url",
]

PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379  # Redis Sentinel's default port
# sentinels that do not answer within this long are skipped (master discovery asks the next one)
SENTINEL_TIMEOUT_S = 1.0
DATA_TIMEOUT_S = 10.0  # a command's reply from a data node (none of the services' commands block)
DATA_CONNECT_TIMEOUT_S = 5.0
_SENTINEL_QUERY_KEYS = frozenset({"sentinel_password", "sentinel_username"})


@dataclass(frozen=True)
class SentinelURL:
    """A parsed `redis+sentinel://` URL; `connection` holds the data nodes' connection options."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    ssl: bool = False
    connection: dict[str, Any] = field(default_factory=dict)

    def connection_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the data nodes' connections (`Sentinel.master_for`)."""
        kwargs: dict[str, Any] = {"db": self.db, **self.connection}
        if self.username:
            kwargs["username"] = self.username
        if self.password:
            kwargs["password"] = self.password
        if self.ssl:
            kwargs["ssl"] = True
        return kwargs

    def sentinel_kwargs(self, given: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments for the connections to the sentinels: the socket options given (short
        timeouts by default) and the sentinels' own credentials."""
        kwargs: dict[str, Any] = {
            "socket_timeout": SENTINEL_TIMEOUT_S,
            "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        }
        kwargs.update({k: v for k, v in given.items() if k.startswith("socket_")})
        if self.sentinel_username:
            kwargs["username"] = self.sentinel_username
        if self.sentinel_password:
            kwargs["password"] = self.sentinel_password
        return kwargs


def is_sentinel_url(url: str) -> bool:
    return url.partition("://")[0].lower() in SENTINEL_SCHEMES


def _host_port(item: str) -> tuple[str, int]:
    """`host[:port]` or `[v6]:port` → (host, port); the port defaults to SENTINEL_PORT."""
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise ValueError(f"a sentinel address needs a host, got {item!r}")
    try:
        port = int(port_text) if port_text else SENTINEL_PORT
    except ValueError:
        raise ValueError(f"bad sentinel port in {item!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"sentinel port out of range in {item!r}")
    return host, port


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    if not userinfo:
        return None, None
    user, has_password, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if has_password else None)


def _connection_options(query: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(redis-py's URL options, parsed; the sentinel credentials) from a query string."""
    options: dict[str, Any] = {}
    sentinel: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key in _SENTINEL_QUERY_KEYS:
            sentinel[key] = unquote(value)
        elif key in ("password", "username"):
            options[key] = unquote(value)
        elif key in URL_QUERY_ARGUMENT_PARSERS:
            try:
                parse = cast(Callable[[str], Any], URL_QUERY_ARGUMENT_PARSERS[key])
                options[key] = parse(value) if value else None
            except (TypeError, ValueError):
                raise ValueError(f"invalid value for the {key!r} option of the Redis URL") from None
        else:
            raise ValueError(f"unknown option {key!r} in the Redis Sentinel URL")
    return {k: v for k, v in options.items() if v is not None}, sentinel


def parse_sentinel_url(url: str) -> SentinelURL:
    """`redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db][?options]`;
    ValueError (never echoing the URL, which may hold a password) when malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Redis Sentinel URL (want {' or '.join(SENTINEL_SCHEMES)}://)")
    parts = urlsplit(f"sentinel://{rest}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if not hosts:
        raise ValueError("a Redis Sentinel URL needs at least one sentinel host:port")
    sentinels = tuple(_host_port(item) for item in hosts.split(",") if item)
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("a Redis Sentinel URL's path is /service_name or /service_name/db")
    try:
        db = int(path[1]) if len(path) == 2 else 0
    except ValueError:
        raise ValueError("the db in a Redis Sentinel URL must be a number") from None
    options, sentinel_auth = _connection_options(parts.query)
    username, password = _credentials(userinfo)
    return SentinelURL(
        sentinels=sentinels,
        service_name=unquote(path[0]),
        db=int(options.pop("db", db)),
        username=options.pop("username", username),
        password=options.pop("password", password),
        sentinel_username=sentinel_auth.get("sentinel_username"),
        sentinel_password=sentinel_auth.get("sentinel_password"),
        ssl=scheme.lower() == "rediss+sentinel",
        connection=options,
    )


def check_redis_url(url: str) -> None:
    """ValueError unless `url` is a Redis URL this module connects to (a Sentinel URL must also
    parse); the message never echoes the URL."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in SENTINEL_SCHEMES:
        parse_sentinel_url(url)
    elif scheme not in PLAIN_SCHEMES:
        raise ValueError(
            "--redis-url must be a redis://, rediss://, unix:// or redis+sentinel:// URL"
        )


class _SentinelRedis(aioredis.Redis):
    """A primary's client that also closes its sentinel connections when closed."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        await cast(AsyncSentinelPool, self.connection_pool).sentinel_manager.aclose()


class _SentinelRedisSync(redis.Redis):
    """The sync `_SentinelRedis`."""

    def close(self) -> None:
        super().close()
        if hasattr(self, "connection_pool"):
            cast(SyncSentinelPool, self.connection_pool).sentinel_manager.close()


def _data_kwargs(parsed: SentinelURL, given: dict[str, Any]) -> dict[str, Any]:
    """The data nodes' connection options: bounded timeouts, then the URL's, then `given`."""
    defaults = {"socket_timeout": DATA_TIMEOUT_S, "socket_connect_timeout": DATA_CONNECT_TIMEOUT_S}
    return {**defaults, **parsed.connection_kwargs(), **given}


def connect(url: str, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client of the Redis at `url` (the primary, for a Sentinel URL); `kwargs` are
    redis-py connection options (`decode_responses`, `socket_timeout`, ...). The caller closes it
    (`aclose()`). No I/O happens until its first command."""
    if not is_sentinel_url(url):
        return aioredis.Redis.from_url(url, **kwargs)
    parsed = parse_sentinel_url(url)
    sentinel = AsyncSentinel(list(parsed.sentinels), sentinel_kwargs=parsed.sentinel_kwargs(kwargs))
    client: aioredis.Redis = sentinel.master_for(
        parsed.service_name, redis_class=_SentinelRedis, **_data_kwargs(parsed, kwargs)
    )
    return client


def connect_sync(url: str, **kwargs: Any) -> redis.Redis:
    """The blocking `connect` (for the launcher and tools outside an event loop); closed with
    `close()`."""
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **kwargs)
    parsed = parse_sentinel_url(url)
    sentinel = SyncSentinel(list(parsed.sentinels), sentinel_kwargs=parsed.sentinel_kwargs(kwargs))
    client: redis.Redis = sentinel.master_for(
        parsed.service_name,
        redis_class=_SentinelRedisSync,
        **_data_kwargs(parsed, kwargs),
    )
    return client
