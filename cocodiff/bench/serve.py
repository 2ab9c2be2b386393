"""`cocodiff bench serve`: closed-loop clients against a running `cocodiff serve`, level after level.

At each concurrency C, C client threads each send a request, wait for its answer, and send the
next, until `--duration` seconds have passed; the requests then in flight are waited for (up to
`--request-timeout`). Each request ends one of three ways: an image (200), an error (any other
HTTP status: 429 queue full, 503, 500, 400), or lost (no answer at all: the connection failed,
closed, or timed out). Lost must be 0.

Before the first level, `GET /health` must answer 200 with a cocodiff server's JSON: a URL that
nothing answers, or that something else answers, is one line naming it (exit 1), not thousands of
lost requests. A connection refused during a level (the server went away) stops the clients at
once: that request is not counted (it never reached a server), the levels so far are reported,
then the same one-line error.

Per level: images per second (images answered / time from the first request to the last answer),
latency percentiles of the answered requests, errors, lost, the batch sizes the server ran in the
meantime (from its /metrics histogram, differenced), and with `--mix steps=4:0.5,20:0.5` (each
request draws its denoising steps by these weights) the same latencies per steps class.

JSON (`--json`), the DESIGN.md contract plus extras: `{"url", "server": {"model", "plan",
"ranks"} (as the server's /health says), "duration_s", "mix", "levels":
[{"concurrency", "images_per_s", "p50_ms", "p95_ms", "p99_ms", "errors", "lost", "requests",
"ok", "errors_by_status", "batch_sizes", "by_steps"}], "error"}` (null, or why the run stopped); a latency is null when no request of
its kind was answered.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RunFailed, UsageError

__all__ = ["ServeBenchSpec", "add_parser", "bench_serve", "check_server", "main", "parse_concurrency", "parse_mix"]


@dataclass(frozen=True, kw_only=True)
class ServeBenchSpec:
    url: str
    """The server's base URL, e.g. http://127.0.0.1:8000."""
    concurrency: tuple[int, ...]
    duration_s: float
    """How long each level sends new requests."""
    mix: tuple[tuple[int, float], ...] = ()
    """(steps, weight) pairs each request draws its steps from; empty: the server's default."""
    prompt: str = "a red circle above a blue square"
    size: str | None = None
    """"WxH"; None: the server's default."""
    request_timeout_s: float = 300.0
    """A request unanswered this long counts as lost."""
    seed: int = 0
    """Seeds the steps each client draws (its requests' own seeds follow from it)."""


def parse_concurrency(text: str) -> tuple[int, ...]:
    """'1,4,16' -> (1, 4, 16)."""
    try:
        levels = tuple(int(part) for part in text.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise UsageError(f"--concurrency {text!r} is not a comma-separated list of positive integers, e.g. 1,4,16")
    return levels


def parse_mix(text: str | None) -> tuple[tuple[int, float], ...]:
    """'steps=4:0.5,20:0.5' -> ((4, 0.5), (20, 0.5)); None or '' -> ()."""
    if not text:
        return ()
    example = "e.g. steps=4:0.5,20:0.5 (steps:weight pairs)"
    if not text.startswith("steps="):
        raise UsageError(f"--mix {text!r}: only steps can be mixed, {example}")
    mix = []
    for part in text[len("steps="):].split(","):
        steps, _, weight = part.partition(":")
        try:
            pair = (int(steps), float(weight) if weight else 1.0)
        except ValueError:
            raise UsageError(f"--mix {text!r}: {part!r} is not steps:weight, {example}") from None
        if pair[0] < 1 or not pair[1] > 0:
            raise UsageError(f"--mix {text!r}: steps must be at least 1 and weights positive, {example}")
        mix.append(pair)
    return tuple(mix)


@dataclass(frozen=True)
class _Answer:
    steps: int | None
    """The steps asked for (None: the server's default)."""
    status: int | None
    """HTTP status; None: no answer (lost)."""
    latency_s: float
    ended: float
    images: int = 0
    """Images in the answer: > 0 only for a good one."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.images > 0


def check_server(http: Any, url: str) -> dict[str, Any]:
    """The server's `/health` body; `RunFailed` (one line naming `url`) unless a ready `cocodiff
    serve` answers there."""
    import httpx

    try:
        response = http.get(f"{url}/health", timeout=30)
    except httpx.HTTPError as error:
        raise RunFailed(f"bench serve: cannot reach {url}: {error or type(error).__name__}") from None
    try:
        body = response.json()
        status = body["status"]
    except (ValueError, KeyError, TypeError):
        raise RunFailed(f"bench serve: {url} is not a cocodiff server (GET /health answered {response.status_code} "
                        f"without its JSON)") from None
    if response.status_code != 200:
        raise RunFailed(f"bench serve: the server at {url} is not ready (GET /health: {response.status_code} {status})")
    return body


def _client(spec: ServeBenchSpec, http: Any, index: int, level: int, until: float, out: list[_Answer],
            unreachable: threading.Event) -> None:
    """One closed-loop client: request, wait for the answer, repeat until `until` (or until a
    connection is refused: then `unreachable` is set and every client stops)."""
    import httpx

    draw = random.Random(spec.seed * 1_000_003 + level * 1_009 + index)
    while time.monotonic() < until and not unreachable.is_set():
        steps = draw.choices([s for s, _ in spec.mix], [w for _, w in spec.mix])[0] if spec.mix else None
        body: dict[str, Any] = {"prompt": spec.prompt, "response_format": "b64_json", "seed": draw.randrange(2**31)}
        if spec.size is not None:
            body["size"] = spec.size
        if steps is not None:
            body["steps"] = steps
        started = time.monotonic()
        status, images = None, 0
        try:
            response = http.post(f"{spec.url}/v1/images/generations", json=body)
            status = response.status_code
            images = len(response.json()["data"]) if status == 200 else 0
        except httpx.ConnectError:  # never reached a server: not a lost request, the end of the run
            unreachable.set()
            return
        except httpx.TransportError:  # no answer: reset, closed, timed out
            pass
        except (ValueError, KeyError, TypeError):  # an answer, but not images: an error
            images = 0
        ended = time.monotonic()
        out.append(_Answer(steps, status, ended - started, ended, images))


def _ms(latencies: list[float], q: float) -> float | None:
    """The `q`-th percentile of `latencies` (seconds) in milliseconds; None without any."""
    import numpy as np

    return float(np.percentile(latencies, q) * 1e3) if latencies else None


def _batch_buckets(http: Any, url: str) -> dict[str, float] | None:
    """The server's cumulative batch-size histogram (`le` -> count), None if /metrics is unreadable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = http.get(f"{url}/metrics").text
    except Exception:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "cocodiff_batch_size":
            return {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    return None


def _batch_sizes(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, int] | None:
    """Batches run between two histogram readings, by bucket: "4" counts batches of 3 or 4 images
    when the buckets are 1, 2, 4, ...; "+Inf" those above the largest bucket. Empty buckets are left out."""
    if before is None or after is None:
        return None
    counts, below = {}, 0.0
    for le in sorted(after, key=float):
        total = after[le] - before.get(le, 0.0)  # cumulative: batches of at most `le` images
        counts[le if le == "+Inf" else f"{float(le):g}"] = int(total - below)
        below = total
    return {bucket: n for bucket, n in counts.items() if n}


def run_level(spec: ServeBenchSpec, concurrency: int, http: Any,
              unreachable: threading.Event | None = None) -> dict[str, Any]:
    """One concurrency level: its figures (see the module's docstring). A refused connection
    sets `unreachable` and ends the level early."""
    unreachable = unreachable or threading.Event()
    before = _batch_buckets(http, spec.url)
    answers: list[list[_Answer]] = [[] for _ in range(concurrency)]
    started = time.monotonic()
    until = started + spec.duration_s
    threads = [threading.Thread(target=_client, args=(spec, http, i, concurrency, until, answers[i], unreachable),
                                daemon=True)
               for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done = [a for per_client in answers for a in per_client]
    ok = [a for a in done if a.ok]
    latencies = [a.latency_s for a in ok]
    elapsed = max((a.ended for a in done), default=until) - started
    level: dict[str, Any] = {
        "concurrency": concurrency,
        "images_per_s": sum(a.images for a in ok) / elapsed if elapsed > 0 else 0.0,
        "p50_ms": _ms(latencies, 50),
        "p95_ms": _ms(latencies, 95),
        "p99_ms": _ms(latencies, 99),
        "errors": sum(1 for a in done if a.status is not None and not a.ok),
        "lost": sum(1 for a in done if a.status is None),
        "requests": len(done),
        "ok": len(ok),
        "errors_by_status": {str(s): n for s, n in sorted(Counter(a.status for a in done
                                                                  if a.status is not None and not a.ok).items())},
        "elapsed_s": elapsed,
        "batch_sizes": _batch_sizes(before, _batch_buckets(http, spec.url)),
    }
    if spec.mix:
        level["by_steps"] = {
            str(steps): {"requests": len(mine := [a for a in ok if a.steps == steps]),
                         "p50_ms": _ms([a.latency_s for a in mine], 50), "p99_ms": _ms([a.latency_s for a in mine], 99)}
            for steps, _ in spec.mix
        }
    return level


def bench_serve(spec: ServeBenchSpec) -> dict[str, Any]:
    """Every level of `spec`, one after another, against the server at `spec.url`; `RunFailed`
    if no cocodiff server answers there. If the server stops accepting connections during a
    level, the levels so far come back with `"error"`: the one line saying so."""
    import httpx

    limits = httpx.Limits(max_connections=max(spec.concurrency) + 2, max_keepalive_connections=max(spec.concurrency) + 2)
    levels, error, unreachable = [], None, threading.Event()
    with httpx.Client(timeout=spec.request_timeout_s, limits=limits) as http:
        health = check_server(http, spec.url)
        for concurrency in spec.concurrency:
            levels.append(run_level(spec, concurrency, http, unreachable))
            if unreachable.is_set():
                error = f"bench serve: {spec.url} refused a connection during the {concurrency}-client level; stopped there"
                break
    server = {key: health.get(key) for key in ("model", "plan", "ranks")}  # what answered: older servers say less
    return {"url": spec.url, "server": server, "duration_s": spec.duration_s, "prompt": spec.prompt, "size": spec.size,
            "mix": {str(steps): weight for steps, weight in spec.mix} or None, "levels": levels, "error": error}


def add_parser(kinds: argparse._SubParsersAction) -> None:
    serve = kinds.add_parser("serve", help="closed-loop clients against a running `cocodiff serve`: images/s, latency, "
                                           "errors and lost requests per concurrency")
    serve.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    serve.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts, one level each")
    serve.add_argument("--duration", type=float, default=60.0, help="seconds each level sends new requests")
    serve.add_argument("--mix", default=None, metavar="steps=S:W,...",
                       help="draw each request's steps by weight, e.g. steps=4:0.5,20:0.5 (default: the server's steps)")
    serve.add_argument("--prompt", default=ServeBenchSpec.prompt, help="every request's prompt")
    serve.add_argument("--size", default=None, help="WIDTHxHEIGHT of every image (default: the server's)")
    serve.add_argument("--request-timeout", type=float, default=300.0,
                       help="seconds without an answer after which a request counts as lost")
    serve.add_argument("--seed", type=int, default=0, help="seeds the clients' draws (steps and request seeds)")
    serve.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the figures as JSON")


def main(args: argparse.Namespace) -> int:
    from ..output.tables import print_table, write_json

    if not args.duration > 0 or not args.request_timeout > 0:
        raise UsageError(f"--duration {args.duration:g} and --request-timeout {args.request_timeout:g} must be positive")
    if not args.url.startswith(("http://", "https://")):
        raise UsageError(f"--url {args.url!r} is not an http:// or https:// URL, e.g. http://127.0.0.1:8000")
    spec = ServeBenchSpec(url=args.url.rstrip("/"), concurrency=parse_concurrency(args.concurrency),
                          duration_s=args.duration, mix=parse_mix(args.mix), prompt=args.prompt, size=args.size,
                          request_timeout_s=args.request_timeout, seed=args.seed)
    result = bench_serve(spec)
    show = lambda ms: "-" if ms is None else f"{ms:.0f}"  # noqa: E731
    rows = [
        (str(level["concurrency"]), f"{level['images_per_s']:.2f}", show(level["p50_ms"]), show(level["p95_ms"]),
         show(level["p99_ms"]), f"{level['ok']}/{level['requests']}", str(level["errors"]), str(level["lost"]),
         " ".join(f"{b}:{n}" for b, n in (level["batch_sizes"] or {}).items()) or "-")
        for level in result["levels"]
    ]
    mix = ", ".join(f"{s} steps x{w:g}" for s, w in spec.mix) if spec.mix else "the server's steps"
    print_table(f"bench serve: {spec.url}, {spec.duration_s:g} s per level, closed loop; {mix}; size "
                f"{spec.size or 'the server default'}",
                ["clients", "images/s", "p50 ms", "p95 ms", "p99 ms", "answered", "errors", "lost", "batches (images:count)"],
                rows)
    if spec.mix:
        print_table("latency per steps class (answered requests)", ["clients", "steps", "requests", "p50 ms", "p99 ms"],
                    [(str(level["concurrency"]), steps, str(c["requests"]), show(c["p50_ms"]), show(c["p99_ms"]))
                     for level in result["levels"] for steps, c in level["by_steps"].items()])
    write_json(args.json, result)
    if result["error"]:
        raise RunFailed(result["error"])
    lost = sum(level["lost"] for level in result["levels"])
    if lost:
        print(f"cocodiff bench serve: {lost} request(s) got no answer at all (lost); a server must answer every one")
    if not any(level["ok"] for level in result["levels"]):
        statuses = Counter()
        for level in result["levels"]:
            statuses.update(level["errors_by_status"])
        print("cocodiff bench serve: no request got its images (" + (", ".join(
            f"{n} answered {status}" for status, n in sorted(statuses.items())) or "none answered")
              + "): nothing was measured")
        return 1
    return 0 if lost == 0 else 1
