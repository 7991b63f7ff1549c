"""The pure parts of `pdmesh bench soak` (no sockets, processes or clocks): the mixed workload, one
request's answer, the samples and the verdict over their series.

SoakCase (completions or chat, greedy or seeded, short or a long prompt with a shared prefix) →
Answer (what the gateway said, streamed or not) + the case's reference → classify;
Sample (every process's RSS and fds, blocks per rank, Redis keys per prefix, gateway in-flight) →
series → flatness (first post-warm-up window vs the last, and a linear fit) → verdict.
"""

from __future__ import annotations

import json
import random
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdmesh_bench.chaos_core import SEEDED_TEMPERATURE, error_key, prompt_text

CATEGORIES = ("completed_correct", "completed_wrong", "errored", "hung", "aborted")
# (series kind, absolute slack): growth within max(tolerance x base, slack) is flat; a MB of RSS,
# and a few fds or keys (small integers that move with every connection or hand-off in flight)
SLACK = {"rss_mb": 1.0, "fds": 4.0, "redis_other": 8.0, "redis_handoffs": 8.0}
HANDOFF_PREFIX = "handoff"
# Redis key prefixes a soak may add on purpose: the supervisor's restart records (chaos)
NEW_PREFIXES_ALLOWED = ("restarts",)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(ms|s|m|min|h)?\s*$")
_UNIT_S = {None: 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds of "30m", "90s", "1.5h", "250ms" or a bare number of seconds; ValueError else."""
    match = _DURATION.match(str(text))
    if match is None:
        raise ValueError(f"not a duration: {text!r} (e.g. 30m, 90s, 1h)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def warmup_of(duration_s: float, fraction: float = 0.2) -> float:
    """The warm-up: `fraction` of the run, at least a minute once the run lasts 5 minutes."""
    warmup = fraction * duration_s
    return max(warmup, 60.0) if duration_s >= 300 else warmup


# ----- the workload ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakCase:
    index: int
    prompt: tuple[int, ...]  # completions: the prompt's token ids
    text: str  # chat: the user message (the same prompt as text)
    max_tokens: int
    is_chat: bool = False
    is_long: bool = False  # a long prompt that shares its prefix with the other long ones
    temperature: float = 0.0
    seed: int | None = None

    def body(self, model: str, is_stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": True,
            "stream": is_stream,
        }
        if is_stream:
            body["stream_options"] = {"include_usage": True}
        if self.is_chat:
            body["messages"] = [{"role": "user", "content": self.text}]
        else:
            body["prompt"] = list(self.prompt)
        return body if self.seed is None else {**body, "seed": self.seed}


def build_cases(
    encode: Callable[[str], list[int]],
    num_prompts: int,
    num_long: int,
    num_seeded: int,
    token_range: tuple[int, int],
    long_tokens: int,
    seed: int = 0,
) -> list[SoakCase]:
    """num_prompts short greedy cases, num_long long greedy ones (one shared prefix of about
    long_tokens tokens, then a distinct tail), then num_seeded seeded-sampling cases on the first
    prompts again; every third case is a chat. Deterministic given the arguments."""
    rng = random.Random(seed)
    shared = ""
    while len(encode(shared)) < long_tokens:
        shared += prompt_text(rng, -1) + " "
    texts = [prompt_text(rng, i) for i in range(num_prompts)]
    texts += [shared + prompt_text(rng, num_prompts + k) for k in range(num_long)]
    cases = []
    for i, text in enumerate(texts):
        tokens = rng.randint(*token_range)
        cases.append(SoakCase(i, tuple(encode(text)), text, tokens, i % 3 == 2, i >= num_prompts))
    for k in range(num_seeded):
        base = cases[k % len(cases)]
        tokens = rng.randint(*token_range)
        index = len(texts) + k
        cases.append(
            SoakCase(
                index,
                base.prompt,
                base.text,
                tokens,
                base.is_chat,
                base.is_long,
                SEEDED_TEMPERATURE,
                2000 + seed + k,
            )
        )
    return cases


@dataclass
class Draws:
    """Each request: a case, streamed or not, and (streamed only) whether its client hangs up
    after a number of text chunks."""

    rng: random.Random
    cases: Sequence[SoakCase]
    stream_fraction: float
    abort_fraction: float  # of the streamed requests

    def next(self) -> tuple[SoakCase, bool, int | None]:
        case = self.rng.choice(self.cases)
        is_stream = self.rng.random() < self.stream_fraction
        if not is_stream or self.rng.random() >= self.abort_fraction:
            return case, is_stream, None
        return case, True, self.rng.randint(1, max(1, case.max_tokens - 1))


# ----- one request's answer --------------------------------------------------------------------


@dataclass
class Answer:
    case: int
    is_stream: bool
    start: float  # seconds since the load began
    end: float = 0.0
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    num_chunks: int = 0  # stream chunks that carried text
    done: bool = False  # streamed: `data: [DONE]`; else: a 200 with a choice
    error: str | None = None
    hung: bool = False
    aborted: bool = False  # the client hung up on purpose

    def apply_line(self, line: str) -> bool:
        """One SSE line; False once the stream is over ([DONE] or an error event)."""
        if not line.startswith("data:"):
            return True
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return False
        chunk = json.loads(data)
        if "error" in chunk:
            self.error = f"error event: {_message(chunk['error'])}"
            return False
        for choice in chunk.get("choices") or []:
            piece = choice.get("text") or (choice.get("delta") or {}).get("content")
            if piece:
                self.text += piece
                self.num_chunks += 1
        self._usage(chunk)
        return True

    def apply_body(self, body: dict[str, Any]) -> None:
        """A non-streamed answer (completions or chat)."""
        choices = body.get("choices") or []
        if not choices:
            self.error = "no choices in the answer"
            return
        choice = choices[0]
        self.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
        self._usage(body)
        self.done = True

    def _usage(self, body: dict[str, Any]) -> None:
        usage = body.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens")
            self.completion_tokens = usage.get("completion_tokens")


def _message(error: Any) -> Any:
    return error.get("message") if isinstance(error, dict) else error


@dataclass(frozen=True)
class Reference:
    text: str
    prompt_tokens: int


def reference_of(answer: Answer, case: SoakCase) -> Reference:
    """A reference from an answer taken before the soak; ValueError unless complete."""
    if answer.error or answer.hung or not answer.done or answer.prompt_tokens is None:
        raise ValueError(f"case {case.index}: {answer.error or 'hung or incomplete'}")
    if answer.completion_tokens != case.max_tokens:
        raise ValueError(
            f"case {case.index}: {answer.completion_tokens} tokens, expected {case.max_tokens}"
        )
    return Reference(answer.text, answer.prompt_tokens)


def mismatch(answer: Answer, case: SoakCase, reference: Reference) -> str | None:
    """Why a completed answer is wrong; None when it matches its case's reference."""
    if answer.completion_tokens != case.max_tokens:
        return f"completion_tokens {answer.completion_tokens}, expected {case.max_tokens}"
    if answer.prompt_tokens != reference.prompt_tokens:
        return f"prompt_tokens {answer.prompt_tokens}, expected {reference.prompt_tokens}"
    if answer.text != reference.text:
        pairs = zip(answer.text, reference.text, strict=False)
        at = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        at = min(len(answer.text), len(reference.text)) if at is None else at
        return f"text differs from the reference at character {at}"
    return None


def classify(answer: Answer, case: SoakCase, reference: Reference) -> str:
    """One of CATEGORIES; errored and hung ones are lost."""
    if answer.aborted:
        return "aborted"
    if answer.hung:
        return "hung"
    if answer.error or not answer.done:
        return "errored"
    return "completed_wrong" if mismatch(answer, case, reference) else "completed_correct"


def tally(
    answers: Sequence[Answer], cases: dict[int, SoakCase], references: dict[int, Reference]
) -> dict[str, Any]:
    """Counts per category and per kind of request, errors by message, a few wrong examples."""
    labels = [classify(a, cases[a.case], references[a.case]) for a in answers]
    counts = {c: labels.count(c) for c in CATEGORIES}
    kinds: dict[str, int] = {}
    for a in answers:
        case = cases[a.case]
        for kind, on in (
            ("chat", case.is_chat),
            ("streamed", a.is_stream),
            ("seeded", case.seed is not None),
            ("long", case.is_long),
        ):
            kinds[kind] = kinds.get(kind, 0) + on
    errors: dict[str, int] = {}
    for a, label in zip(answers, labels, strict=True):
        if label in ("errored", "hung"):
            key = error_key(a.error or ("hung" if a.hung else "ended without [DONE]"))
            errors[key] = errors.get(key, 0) + 1
    wrong = [
        {
            "case": a.case,
            "streamed": a.is_stream,
            "why": mismatch(a, cases[a.case], references[a.case]),
        }
        for a, label in zip(answers, labels, strict=True)
        if label == "completed_wrong"
    ]
    return {
        "sent": len(answers),
        **counts,
        "lost": counts["errored"] + counts["hung"],
        "kinds": kinds,
        "errors_by_message": errors,
        "wrong_examples": wrong[:10],
    }


# ----- samples and the verdict -----------------------------------------------------------------


@dataclass
class Sample:
    """What the mesh looked like at one moment (None / a missing key: could not be read)."""

    t: float  # seconds since the load began
    phase: str  # "load", then "idle" once the load ended
    rss_mb: dict[str, float] = field(default_factory=dict)  # service → RSS of its process tree
    fds: dict[str, int] = field(default_factory=dict)  # service → open fds of its process tree
    pids: dict[str, int] = field(default_factory=dict)  # service → its main pid (new: restarted)
    blocks: dict[str, int] = field(default_factory=dict)  # worker rank → KV blocks held
    requests: dict[str, tuple[int, int]] = field(default_factory=dict)  # rank → (running, waiting)
    redis_keys: int | None = None  # DBSIZE
    redis_prefixes: dict[str, int] = field(default_factory=dict)  # key kind → count
    in_flight: float | None = None  # the gateway's requests being generated
    num_ended: int = 0  # requests ended so far


def key_prefix(key: str, namespace: str) -> str:
    """The kind of a Redis key: its first segment after the deployment's namespace
    (`pdmesh:{deployment}:handoff:…` → handoff), else its first segment."""
    rest = key[len(namespace) + 1 :] if key.startswith(namespace + ":") else key
    return rest.split(":", 1)[0]


def series_of(samples: Sequence[Sample]) -> dict[str, list[tuple[float, float]]]:
    """name → [(t, value)]: rss_mb:SERVICE, fds:SERVICE, blocks:RANK, redis_keys, redis_other (the
    keys but hand-off records), in_flight."""
    series: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, t: float, value: float | None) -> None:
        if value is not None:
            series.setdefault(name, []).append((t, float(value)))

    for s in samples:
        for kind, values in (("rss_mb", s.rss_mb), ("fds", s.fds), ("blocks", s.blocks)):
            for name, value in values.items():
                add(f"{kind}:{name}", s.t, value)
        add("redis_keys", s.t, s.redis_keys)
        if s.redis_prefixes:  # one SCAN: DBSIZE was read a moment apart
            other = sum(s.redis_prefixes.values()) - s.redis_prefixes.get(HANDOFF_PREFIX, 0)
            add("redis_other", s.t, other)
        add("in_flight", s.t, s.in_flight)
    return series


def restarted_after(samples: Sequence[Sample], service: str, t0: float) -> bool:
    """Whether the service's pid changed (a restart) after time t0."""
    pids = [s.pids[service] for s in samples if s.t >= t0 and service in s.pids]
    return len(set(pids)) > 1


@dataclass(frozen=True)
class Flatness:
    name: str
    status: str  # flat, growing, restarted (not judged), too short (not judged)
    base: float | None = None  # median of the first post-warm-up window
    last: float | None = None  # median of the last window of the load
    growth: float | None = None  # last - base
    fit_growth: float | None = None  # a least-squares slope x the post-warm-up span
    limit: float | None = None  # max(tolerance x base, the kind's slack)

    @property
    def growth_pct(self) -> float | None:
        return None if self.growth is None or not self.base else 100 * self.growth / self.base


def flatness(
    name: str,
    points: Sequence[tuple[float, float]],
    span: tuple[float, float],
    tolerance: float,
    is_restarted: bool = False,
) -> Flatness:
    """Judge one series over span = (end of warm-up, end of load): flat when neither the growth of
    the last window's median over the first's nor the linear fit's exceeds the limit. A window is a
    tenth of the span, at least 3 samples."""
    if is_restarted:
        return Flatness(name, "restarted")
    start, end = span
    post = [(t, v) for t, v in points if start <= t <= end]
    if len(post) < 6:
        return Flatness(name, "too short")
    width = max(3, len(post) // 10)
    base = statistics.median(v for _, v in post[:width])
    last = statistics.median(v for _, v in post[-width:])
    fit = _slope(post) * (post[-1][0] - post[0][0])
    limit = max(tolerance * abs(base), SLACK.get(name.split(":", 1)[0], 0.0))
    is_flat = last - base <= limit and fit <= limit
    return Flatness(name, "flat" if is_flat else "growing", base, last, last - base, fit, limit)


def handoff_bound(
    samples: Sequence[Sample], span: tuple[float, float], retention_s: float, concurrency: int
) -> Flatness:
    """Hand-off records, whose number follows the request rate (each request leaves one, kept for
    the kvstore's retention once finished): at every post-warm-up sample at most the requests that
    ended within the retention (and 10 s) before it, plus those that may be in flight, plus slack.
    base: the median bound; last: the records at the last sample; growth: the largest excess."""
    start, end = span
    excess, bounds = [], []
    for s in samples:
        if not start <= s.t <= end or s.redis_keys is None:
            continue
        earlier = [p.num_ended for p in samples if p.t <= s.t - retention_s - 10.0]
        if not earlier:  # the references' records may still be there
            continue
        bound = s.num_ended - earlier[-1] + concurrency
        bounds.append(bound)
        excess.append(s.redis_prefixes.get(HANDOFF_PREFIX, 0) - bound)
    if not excess:
        return Flatness("redis_handoffs", "too short")
    limit = SLACK["redis_handoffs"]
    last = samples[-1].redis_prefixes.get(HANDOFF_PREFIX, 0)
    status = "flat" if max(excess) <= limit else "growing"
    return Flatness(
        "redis_handoffs", status, statistics.median(bounds), last, max(excess), None, limit
    )


def _slope(points: Sequence[tuple[float, float]]) -> float:
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return 0.0 if var == 0 else sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def redis_leftovers(
    baseline: dict[str, int],
    end: dict[str, int],
    live_handoffs: int,
    handoff_ttls_ms: Sequence[int],
    retention_ms: int,
) -> list[str]:
    """Why the Redis keys at the end (load over, ranks idle) are not back to the baseline: a kind
    with more keys than before the load (the supervisor's restart records excepted), a hand-off
    still live, or a finished one that would outlive the kvstore's retention (finished records
    are kept that long by design, then expire)."""
    problems = [
        f"{kind}: {count} keys, {baseline.get(kind, 0)} before the load"
        for kind, count in sorted(end.items())
        if kind != HANDOFF_PREFIX
        and kind not in NEW_PREFIXES_ALLOWED
        and count > baseline.get(kind, 0)
    ]
    if live_handoffs:
        problems.append(f"{live_handoffs} hand-off records still live (not finished)")
    lasting = [ttl for ttl in handoff_ttls_ms if ttl < 0 or ttl > retention_ms]
    if lasting:
        problems.append(f"{len(lasting)} hand-off records without expiry or beyond the retention")
    return problems


def failures(report: dict[str, Any]) -> list[str]:
    """Why the soak failed (empty: it passed)."""
    found = [f"{report[c]} {c}" for c in ("completed_wrong", "hung", "errored") if report[c]]
    if report["completed_correct"] == 0:
        found.append("no request completed correctly")
    growing = [f["name"] for f in report["flatness"] if f["status"] == "growing"]
    if growing:
        found.append(f"growing after warm-up: {', '.join(growing)}")
    leak = report["leak_check"]
    leaked = {k: v for k, v in leak.get("leaked_blocks", {}).items() if v}
    if leaked:
        found.append(f"blocks held when idle: {leaked}")
    for what in ("unreachable", "busy"):
        if leak.get(what):
            found.append(f"ranks {what} at the end: {leak[what]}")
    if leak.get("integrity_errors"):
        found.append(f"KV integrity errors: {leak['integrity_errors']}")
    if report["in_flight_end"]:
        found.append(f"the gateway still counts {report['in_flight_end']} requests in flight")
    found += [f"redis: {p}" for p in report["redis_end"]["problems"]]
    if report.get("supervisor_gave_up"):
        found.append(f"the supervisor gave up on {report['supervisor_gave_up']}")
    return found
