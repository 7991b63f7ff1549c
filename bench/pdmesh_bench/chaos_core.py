"""The pure parts of `pdmesh bench chaos` (no sockets, processes or clocks): the seeded workload,
the fault schedule, one request's SSE stream and its classification, and the report.

Case (prompt ids, max_tokens, temperature, seed) → Outcome (what the stream said) + Reference (the
same case's outcome before any fault) → classify → summarize → failures.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pdmesh_bench.traces import distribution

KILLABLE = ("prefill", "decode", "kvstore", "eplb", "redis")
CATEGORIES = ("completed_correct", "completed_wrong", "errored", "hung", "aborted")
SEEDED_TEMPERATURE = 0.8
MIGRATIONS, RETRIES = "pdmesh_gateway_migrations_total", "pdmesh_gateway_retries_total"
_WORDS = (
    "river stone engine quiet lantern market winter orbit copper garden signal harbor violet "
    "ledger thunder meadow cipher basket falcon marble rocket velvet canyon pepper glacier "
    "saddle quartz ember willow anchor beacon tunnel prism orchard comet harvest mirror"
).split()
_OPENINGS = ("Once", "Today", "In the report,", "The answer:", "Q:", "Note:", "Chapter", "Why")


# ----- the workload (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None  # seeded sampling (temperature > 0)

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return body if self.seed is None else {**body, "seed": self.seed}


def prompt_text(rng: random.Random, index: int) -> str:
    """Varied English-like text; the index makes every prompt distinct."""
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 40))]
    cut = rng.randint(1, len(words))
    return f"{rng.choice(_OPENINGS)} {index}: {' '.join(words[:cut])}. {' '.join(words[cut:])}"


def build_cases(
    encode: Callable[[str], list[int]],
    num_prompts: int,
    num_seeded: int,
    min_tokens: int,
    max_tokens: int,
    seed: int = 0,
) -> list[Case]:
    """num_prompts greedy cases, then num_seeded seeded-sampling cases on the first prompts again
    (cycling); deterministic given the arguments and the tokenizer."""
    rng = random.Random(seed)
    prompts = [tuple(encode(prompt_text(rng, i))) for i in range(num_prompts)]
    cases = [Case(i, p, rng.randint(min_tokens, max_tokens)) for i, p in enumerate(prompts)]
    for k in range(num_seeded):
        prompt = prompts[k % num_prompts]
        tokens = rng.randint(min_tokens, max_tokens)
        cases.append(Case(num_prompts + k, prompt, tokens, SEEDED_TEMPERATURE, 1000 + seed + k))
    return cases


@dataclass
class Draws:
    """Which case each chaos request sends, and whether (after how many token chunks) its client
    disconnects."""

    rng: random.Random
    cases: Sequence[Case]
    abort_fraction: float

    def next(self) -> tuple[Case, int | None]:
        case = self.rng.choice(self.cases)
        if self.rng.random() >= self.abort_fraction:
            return case, None
        return case, self.rng.randint(1, max(1, case.max_tokens - 1))


@dataclass(frozen=True)
class PlannedFault:
    at_s: float  # seconds after the chaos phase started
    role: str


def fault_schedule(
    roles: Sequence[str], every_s: float, duration_s: float, seed: int
) -> list[PlannedFault]:
    """A fault every every_s seconds strictly inside the load, each on a role drawn from roles."""
    if not roles:
        return []
    rng = random.Random(seed)
    count = max(0, int((duration_s - 1e-9) // every_s))
    return [PlannedFault(every_s * (k + 1), rng.choice(list(roles))) for k in range(count)]


def killable(names: Sequence[str], live: Sequence[str], serving: Sequence[str]) -> list[str]:
    """The processes of one role that may be killed now, SERVING ones first: of a single-instance
    role, the live one; else the live ones that leave another instance SERVING. Only when none of
    those is SERVING (all still starting) are the starting ones offered."""
    if len(names) <= 1:
        allowed = [n for n in names if n in live]
    else:
        allowed = [n for n in names if n in live and any(o in serving for o in names if o != n)]
    return [n for n in allowed if n in serving] or allowed


# ----- one request: the SSE stream and its classification (pure) -----------------------------


@dataclass
class Outcome:
    case: int
    start: float  # when sent, seconds on the sender's clock (0: the chaos phase began)
    end: float = 0.0
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    num_chunks: int = 0  # chunks that carried text
    done: bool = False  # `data: [DONE]` arrived
    error: str | None = None
    hung: bool = False
    aborted: bool = False  # the client disconnected on purpose

    def apply(self, line: str) -> bool:
        """Take one SSE line; False once the stream is over ([DONE] or an error event)."""
        if not line.startswith("data:"):
            return True
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return False
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            self.error = f"error event: {message}"
            return False
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                self.text += choice["text"]
                self.num_chunks += 1
        usage = chunk.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens")
            self.completion_tokens = usage.get("completion_tokens")
        return True


@dataclass(frozen=True)
class Reference:
    text: str
    prompt_tokens: int
    completion_tokens: int


def mismatch(outcome: Outcome, case: Case, reference: Reference) -> str | None:
    """Why a completed request is wrong; None when it matches its reference."""
    if outcome.text != reference.text:
        pairs = zip(outcome.text, reference.text, strict=False)
        shorter = min(len(outcome.text), len(reference.text))
        at = next((i for i, (a, b) in enumerate(pairs) if a != b), shorter)
        return f"text differs from the reference at character {at}"
    if outcome.completion_tokens != reference.completion_tokens or (
        outcome.completion_tokens != case.max_tokens
    ):
        return f"completion_tokens {outcome.completion_tokens}, expected {case.max_tokens}"
    if outcome.prompt_tokens != reference.prompt_tokens or outcome.prompt_tokens != len(
        case.prompt
    ):
        return f"prompt_tokens {outcome.prompt_tokens}, expected {len(case.prompt)}"
    return None


def classify(outcome: Outcome, case: Case, reference: Reference) -> str:
    """One of CATEGORIES."""
    if outcome.aborted:
        return "aborted"
    if outcome.hung:
        return "hung"
    if outcome.error or not outcome.done:
        return "errored"
    return "completed_wrong" if mismatch(outcome, case, reference) else "completed_correct"


def reference_of(outcome: Outcome, case: Case) -> Reference:
    """The reference from a fault-free outcome; ValueError unless it completed in full."""
    if outcome.hung or outcome.error or outcome.aborted or not outcome.done:
        raise ValueError(f"case {case.index}: {outcome.error or 'hung or incomplete'}")
    if outcome.completion_tokens != case.max_tokens or outcome.prompt_tokens != len(case.prompt):
        raise ValueError(
            f"case {case.index}: usage {outcome.prompt_tokens} prompt + "
            f"{outcome.completion_tokens} completion tokens, expected {len(case.prompt)} + "
            f"{case.max_tokens}"
        )
    return Reference(outcome.text, outcome.prompt_tokens, outcome.completion_tokens)


def http_error(status: int, body: bytes) -> str:
    """`HTTP <status>: <message>` of a non-200 answer (the OpenAI error shape, or its text)."""
    text = body.decode(errors="replace")
    try:
        error = json.loads(text).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {message if message else text[:300]}"


def error_key(message: str) -> str:
    """An error message with its request ids and hex blobs masked, to count alike ones together."""
    masked = re.sub(r"\b(cmpl|chatcmpl|req)-[0-9A-Za-z_-]+", r"\1-*", message)
    return re.sub(r"\b[0-9a-f]{12,}\b", "*", masked)[:300]


def overlaps_fault(start: float, end: float, fault_times: Sequence[float]) -> bool:
    return any(start <= t <= end for t in fault_times)


def counter_total(metrics_text: str, name: str) -> float | None:
    """The sum over labels of a Prometheus sample `name` in an exposition; None if absent."""
    values = [
        float(parts[-1])
        for line in metrics_text.splitlines()
        if (parts := line.split()) and re.split(r"[{\s]", line, maxsplit=1)[0] == name
    ]
    return sum(values) if values else None


# ----- the report (pure) -----------------------------------------------------------------------


@dataclass
class Fault:
    at_s: float  # seconds since the chaos phase started
    role: str
    name: str | None  # the process killed; None: skipped (no killable process)
    pid: int | None = None
    was_serving: bool = False  # the victim answered SERVING (else it was still starting)


@dataclass
class ChaosRun:
    """What a chaos phase gathered; every time is in seconds since it started."""

    cases: dict[int, Case]
    references: dict[int, Reference]
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    duration_s: float = 0.0
    leak: dict[str, Any] = field(default_factory=dict)  # `leak_report`
    counters_before: dict[str, float | None] = field(default_factory=dict)
    counters_after: dict[str, float | None] = field(default_factory=dict)
    restarts: dict[str, int] | None = None  # None: the launcher keeps no count

    def label(self, outcome: Outcome) -> str:
        return classify(outcome, self.cases[outcome.case], self.references[outcome.case])

    def counts(self) -> Counter[str]:
        return Counter(self.label(o) for o in self.outcomes)

    def counter_delta(self, name: str) -> float | None:
        before, after = self.counters_before.get(name), self.counters_after.get(name)
        return None if before is None or after is None else after - before


def summarize(run: ChaosRun, max_examples: int = 10) -> dict[str, Any]:
    """The report: counts per category, errors by message, faults, leaks, restarts, latency."""
    labels = [run.label(o) for o in run.outcomes]
    counts = Counter(labels)
    injected = [f for f in run.faults if f.name is not None]
    times = [f.at_s for f in injected]
    completed = [
        (o.end - o.start, overlaps_fault(o.start, o.end, times))
        for o, label in zip(run.outcomes, labels, strict=True)
        if label.startswith("completed")
    ]
    errored = [o for o, label in zip(run.outcomes, labels, strict=True) if label == "errored"]
    errors = Counter(error_key(o.error or "the stream ended without [DONE]") for o in errored)
    wrong = [
        {
            "case": o.case,
            "why": mismatch(o, run.cases[o.case], run.references[o.case]),
            "during_fault": overlaps_fault(o.start, o.end, times),
        }
        for o, label in zip(run.outcomes, labels, strict=True)
        if label == "completed_wrong"
    ]
    report: dict[str, Any] = {
        "sent": len(run.outcomes),
        **{c: counts.get(c, 0) for c in CATEGORIES},
        "migrated": run.counter_delta(MIGRATIONS),
        "retried": run.counter_delta(RETRIES),
        "errors_by_message": dict(errors.most_common()),
        "wrong_examples": wrong[:max_examples],
        "leaked_blocks": run.leak.get("leaked_blocks", {}),
        "leak_check": run.leak,
        "restarts": run.restarts,
        "faults": {
            "injected": len(injected),
            "skipped": len(run.faults) - len(injected),
            "per_role": dict(Counter(f.role for f in injected)),
            "events": [asdict(f) for f in run.faults],
        },
        "latency_ms": {
            "during_faults": _latency([s for s, hit in completed if hit]),
            "outside_faults": _latency([s for s, hit in completed if not hit]),
        },
        "duration_s": run.duration_s,
    }
    report["failures"] = failures(report)
    return report


def _latency(seconds: list[float]) -> dict[str, Any]:
    d = distribution([s * 1e3 for s in seconds])
    return {"count": len(seconds), "p50": d["p50"], "p99": d["p99"]}


def failures(report: dict[str, Any]) -> list[str]:
    """Why the run failed (empty: it passed)."""
    found = [f"{report[c]} {c}" for c in ("completed_wrong", "hung", "errored") if report[c]]
    leaked = {k: v for k, v in report["leaked_blocks"].items() if v}
    if leaked:
        found.append(f"leaked blocks: {leaked}")
    leak = report["leak_check"]
    if not leak.get("ran"):
        found.append("the leak check did not run")
    if leak.get("unreachable"):
        found.append(f"leak check incomplete, unreachable ranks: {leak['unreachable']}")
    if leak.get("busy"):
        found.append(f"ranks still running or queueing requests: {leak['busy']}")
    if leak.get("integrity_errors"):
        found.append(f"KV integrity errors: {leak['integrity_errors']}")
    if report["completed_correct"] == 0:
        found.append("no request completed correctly")
    return found


def leak_report(statuses: dict[str, Any], waited_s: float) -> dict[str, Any]:
    """The leak check's figures from each rank's last `WorkerStatus` (None: unreachable)."""
    ranks = {
        key: None
        if s is None
        else {name: getattr(s, name) for name in _STATUS_FIELDS if hasattr(s, name)}
        for key, s in statuses.items()
    }
    return {
        "ran": True,
        "waited_s": waited_s,
        "leaked_blocks": {k: s.kv_blocks_used for k, s in statuses.items() if s is not None},
        "unreachable": [k for k, s in statuses.items() if s is None],
        "busy": [k for k, s in statuses.items() if s is not None and not is_quiet(s)],
        "integrity_errors": {
            k: s.integrity_error for k, s in statuses.items() if s is not None and s.integrity_error
        },
        "ranks": ranks,
    }


def is_quiet(status: Any) -> bool:
    """A rank with no running and no waiting request."""
    return not (status.num_running or status.num_waiting)


def is_idle(status: Any) -> bool:
    """A reachable rank that is quiet and holds no KV block for any request."""
    return status is not None and is_quiet(status) and not status.kv_blocks_used


_STATUS_FIELDS = (
    "num_running",
    "num_waiting",
    "kv_blocks_used",
    "kv_blocks_free",
    "kv_blocks_total",
    "lease_expiries",
    "kv_quarantines",
    "transfer_failures",
    "requests_total",
    "kv_digest_mismatches",
    "kv_corruptions_injected",
)


def corruption_report(leak: dict[str, Any], restarted: bool) -> dict[str, Any]:
    """`--corrupt-kv`: the KV corruptions the prefill ranks' fault hook injected and the digest
    mismatches the decode ranks counted, summed over the leak check's statuses (counted since each
    rank started: `exact` is False once a worker restarted, and then they are not compared)."""
    ranks = [r for r in leak.get("ranks", {}).values() if r is not None]
    return {
        "injected": sum(r.get("kv_corruptions_injected", 0) for r in ranks),
        "caught": sum(r.get("kv_digest_mismatches", 0) for r in ranks),
        "exact": not restarted and not leak.get("unreachable"),
    }


def corruption_failures(corruption: dict[str, Any]) -> list[str]:
    """Why a `--corrupt-kv` run failed on its counts: an injected corruption not counted on
    decode (or one counted that was never injected), or none injected at all."""
    if not corruption["exact"]:
        return []
    if corruption["injected"] == 0:
        return ["--corrupt-kv injected no corruption (raise P or send more requests)"]
    if corruption["injected"] != corruption["caught"]:
        return [
            f"{corruption['injected']} KV corruptions injected but {corruption['caught']} "
            "digest mismatches counted"
        ]
    return []
