"""LLM token budgets charged from the usage an answer reports in its body (issue 42; README
"LLM budgets: usage from the answer, weights, calendar periods" and "Reservations"), on
every binding, with the fake LLM upstream (llm_upstream.py) behind the gateway.

Every rule below is a budget of 10,000 tokens an hour per account (`W`), each request
reserving `x-max-tokens` (or the request body's `max_tokens`) up front and settled with
the usage its answer reports. What a test spent is read back exactly with two probes on
the same account: a request reserving exactly what should be left is admitted and one
reserving a token more is rejected. A probe is answered with usage 0 (the provider's JSON
shape), so an admitted probe gives its reservation back and leaves the budget as it was.

- Each provider, each shape (JSON, SSE, and Gemini's JSON array), with and without
  `weights: {input: 1, output: 4}`: the spend is the reported usage (input + output, or
  input + 4 × output), where the input counts Anthropic's cache tokens and the output
  Gemini's thinking tokens.
- `response_cost: {json: usage.total_tokens}`; a reservation read from the request body.
- 20 concurrent streams on one budget: at least the 10 reservations that fit are admitted,
  and the final spend is the sum of what the admitted streams reported.
- Faults: an answer without usage, with the usage's JSON broken, or cut mid-body keeps its
  reservation, and the client gets every byte the upstream sent, unchanged; a 5 MiB answer
  passes whole and its usage at the end is charged.

The gateways are shared by the module's tests (one per binding and pytest worker): each
test has accounts of its own.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import pytest

from harness import Exchange, LlmUpstream, exchange, record

BUDGET = 10_000
RESERVE_HEADER = "reserve: {header: x-max-tokens, default: 500, min: 1, max: 10000}"
RESERVE_BODY = "reserve: {json: max_tokens, default: 500, min: 1, max: 10000}"
WEIGHTS = "weights: {input: 1, output: 4}"

# Route prefix -> (rule name, response_cost). The fake answers a provider's path under any
# prefix, so each rule has a prefix of its own in front of the provider's real path.
ROUTES = {
    "/openai": ("openai", f"usage: openai, {RESERVE_HEADER}"),
    "/anthropic": ("anthropic", f"usage: anthropic, {RESERVE_HEADER}"),
    "/gemini": ("gemini", f"usage: gemini, {RESERVE_HEADER}"),
    "/weighted/openai": ("weighted_openai", f"usage: openai, {WEIGHTS}, {RESERVE_HEADER}"),
    "/weighted/anthropic": ("weighted_anthropic", f"usage: anthropic, {WEIGHTS}, {RESERVE_HEADER}"),
    "/weighted/gemini": ("weighted_gemini", f"usage: gemini, {WEIGHTS}, {RESERVE_HEADER}"),
    "/total": ("total", f"json: usage.total_tokens, {RESERVE_HEADER}"),
    "/body-reserve": ("body_reserve", f"usage: openai, {RESERVE_BODY}"),
}
DOC = (
    "resources:\n"
    + "".join(
        f"  - Url: {url}\n"
        f"    rules:\n"
        f"      - {{name: {name}, actor: account, algo: W, unit: hour, rpu: {BUDGET}, response_cost: {{{cost}}}}}\n"
        for url, (name, cost) in ROUTES.items()
    )
    + "response: {status: 429}\n"
)


@dataclass(frozen=True)
class Shape:
    name: str
    provider: str  # the route: openai | anthropic | gemini
    path: str  # the provider's path, after the route's prefix
    body: dict


GEMINI = "/v1beta/models/gemini-2.5-flash"
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000}
RESPONSES = {"model": "gpt-4.1", "input": "hi"}
MESSAGES = {"model": "claude-sonnet-4-5", "max_tokens": 4000, "messages": [{"role": "user", "content": "hi"}]}
CONTENTS = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
OPENAI_SSE = Shape("openai-sse", "openai", "/v1/chat/completions",
                   {**CHAT, "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
SHAPES = [
    Shape("openai-json", "openai", "/v1/chat/completions", CHAT),
    OPENAI_SSE,
    Shape("responses-json", "openai", "/v1/responses", RESPONSES),
    Shape("responses-sse", "openai", "/v1/responses", {**RESPONSES, "stream": True}),
    Shape("anthropic-json", "anthropic", "/v1/messages", MESSAGES),
    Shape("anthropic-sse", "anthropic", "/v1/messages", {**MESSAGES, "stream": True}),
    Shape("gemini-json", "gemini", f"{GEMINI}:generateContent", CONTENTS),
    Shape("gemini-sse", "gemini", f"{GEMINI}:streamGenerateContent?alt=sse", CONTENTS),
    Shape("gemini-array", "gemini", f"{GEMINI}:streamGenerateContent", CONTENTS),
]
BY_NAME = {s.name: s for s in SHAPES}
# The probes' shape on each route: the provider's JSON answer.
PROBE_SHAPE = {
    "/openai": BY_NAME["openai-json"],
    "/anthropic": BY_NAME["anthropic-json"],
    "/gemini": BY_NAME["gemini-json"],
    "/weighted/openai": BY_NAME["openai-json"],
    "/weighted/anthropic": BY_NAME["anthropic-json"],
    "/weighted/gemini": BY_NAME["gemini-json"],
    "/total": BY_NAME["openai-json"],
    "/body-reserve": BY_NAME["openai-json"],
}
IDS = [s.name for s in SHAPES]


@pytest.fixture(scope="module")
def llm(_module_gateways) -> LlmUpstream:
    """The fake LLM upstream of the module's gateways on this binding: one of the module's
    processes (its log goes with a failing test's report; stopped by PID after the last
    test)."""
    procs, _ = _module_gateways
    return procs.add(LlmUpstream(procs.log_dir)).start()


@pytest.fixture
def gw(shared_gateway, llm):
    return shared_gateway(DOC, upstream_port=llm.port)


@pytest.fixture
def account(request) -> Callable[[str], str]:
    """account(tag) -> an account id no other test uses."""
    salt = secrets.token_hex(3)
    return lambda tag="": f"{request.node.name}-{tag}-{salt}"


def fresh_hour(need_s: float) -> None:
    """The budgets are hour windows aligned to the epoch: a test that needs `need_s`
    seconds starts in the next hour if fewer are left in this one (rare: at most `need_s`
    of waiting, once an hour)."""
    left = 3600 - time.time() % 3600
    if left < need_s:
        time.sleep(left + 0.5)


def call(
    port: int,
    route: str,
    shape: Shape,
    account: Optional[str],
    *,
    reserve: Optional[int] = None,
    body_reserve: Optional[int] = None,
    usage: tuple[int, int] = (0, 0),
    fault: str = "",
    knobs: Optional[dict[str, str]] = None,
    connected: Optional[Callable[[], object]] = None,
    timeout: float = 30.0,
) -> Exchange:
    """One call of `shape` under `route` (on a gateway's port, or on the fake's own port
    for the bytes it sends), its usage (input, output) and fault chosen in x-fake-*
    headers; `reserve` in x-max-tokens, `body_reserve` as the body's max_tokens."""
    headers = {"content-type": "application/json", "x-fake-input": str(usage[0]), "x-fake-output": str(usage[1])}
    if account is not None:
        headers["x-account-id"] = account
    if reserve is not None:
        headers["x-max-tokens"] = str(reserve)
    if fault:
        headers["x-fake-fault"] = fault
    headers.update(knobs or {})
    body = dict(shape.body)
    if body_reserve is not None:
        body["max_tokens"] = body_reserve
    return exchange(port, "POST", route + shape.path, headers, json.dumps(body).encode(),
                    timeout=timeout, connected=connected)  # fmt: skip


def probe(gw, route: str, account: str, tokens: int) -> Exchange:
    """A request reserving `tokens`, answered with usage 0 (it gives them back)."""
    shape = PROBE_SHAPE[route]
    if route == "/body-reserve":
        return call(gw.port, route, shape, account, body_reserve=tokens)
    return call(gw.port, route, shape, account, reserve=tokens)


def tokens_left(gw, route: str, account: str) -> int:
    """What the account's budget has left, by bisection with probes (for a failure's
    message: what was spent instead)."""
    lo, hi = 0, BUDGET  # lo: known to fit (0 always does); hi + 1: known not to
    if probe(gw, route, account, BUDGET).status == 200:
        return BUDGET
    hi = BUDGET - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if probe(gw, route, account, mid).status == 200:
            lo = mid
        else:
            hi = mid - 1
    return lo


def assert_spent(gw, route: str, account: str, spent: int, what: str) -> int:
    """The account's budget on `route` has exactly `spent` tokens spent: a reservation of
    what is left passes, one of a token more does not. The answers that settle the spend
    have ended when this is called; a settlement the host runs just after the last byte
    (on its log step) gets two more tries, half a second apart. Returns the tokens left."""
    left = BUDGET - spent
    assert 0 < left < BUDGET, f"test design: {spent} must leave between 1 and {BUDGET - 1} tokens"
    seen = []
    for attempt in range(3):
        if attempt:
            time.sleep(0.5)
        over = probe(gw, route, account, left + 1)  # first: a rejection takes nothing
        exact = probe(gw, route, account, left)
        seen.append((over.status, exact.status))
        if (over.status, exact.status) == (429, 200):
            assert exact.complete, f"the probe's answer was cut: {exact}"
            return left
        if None in (over.status, exact.status):
            break
    actual = tokens_left(gw, route, account)
    pytest.fail(
        f"{gw.label} {route}: {what}: expected {spent} spent ({left} left), but {BUDGET - actual} were "
        f"({actual} left, measured by bisection after these probes, each answered with usage 0): "
        f"probes (reserve {left + 1}, reserve {left}) -> {seen}"
    )


def same_bytes(through: Exchange, direct: Exchange) -> None:
    """The client got exactly what the upstream sent (de-chunked: a proxy may re-chunk)."""
    if through.body != direct.body:
        a, b = through.body, direct.body
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        pytest.fail(
            f"the gateway changed the body: {len(a)} bytes through it, {len(b)} from the upstream; "
            f"first difference at byte {at}: {a[max(0, at - 40) : at + 40]!r} vs {b[max(0, at - 40) : at + 40]!r}"
        )


# ------------------------------------------------------------------------------ usage

# Chosen so that the unweighted cost (1,500) is below the reservation (2,000: tokens given
# back) and the weighted one (1,200 + 4 × 300 = 2,400) above it (tokens owed), and so that
# a reader that left out Anthropic's cache tokens or Gemini's thinking tokens is off.
USAGE = (1200, 300)
DETAIL = {"x-fake-cache-read": "200", "x-fake-cache-write": "100", "x-fake-reasoning": "50"}
RESERVE = 2000


@pytest.mark.parametrize("weighted", [False, True], ids=["total", "weighted"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_the_reported_usage_is_charged_exactly(gw, llm, account, shape: Shape, weighted: bool):
    fresh_hour(30)
    route = ("/weighted/" if weighted else "/") + shape.provider
    who = account()
    through = call(gw.port, route, shape, who, reserve=RESERVE, usage=USAGE, knobs=DETAIL)
    direct = call(llm.port, route, shape, None, usage=USAGE, knobs=DETAIL)
    assert (through.status, through.complete, through.error) == (200, True, None), through
    same_bytes(through, direct)
    i, o = USAGE
    spent = i + 4 * o if weighted else i + o
    left = assert_spent(gw, route, who, spent, f"{shape.name} reporting input {i}, output {o}")
    record(
        f"{gw.label}: LLM usage, {shape.name}, {'weights 1/4' if weighted else 'total'}",
        f"reserved {RESERVE}, reported input {i} output {o} -> spent {spent} ({left} left: exact)",
    )


@pytest.mark.parametrize("shape", [BY_NAME["openai-json"], OPENAI_SSE], ids=["json", "sse"])
def test_a_json_path_is_charged(gw, llm, account, shape: Shape):
    """`response_cost: {json: usage.total_tokens}`: the number at that path (of a stream's
    last event that has it)."""
    fresh_hour(30)
    who = account()
    through = call(gw.port, "/total", shape, who, reserve=RESERVE, usage=(700, 600))
    direct = call(llm.port, "/total", shape, None, usage=(700, 600))
    assert (through.status, through.complete) == (200, True), through
    same_bytes(through, direct)
    assert_spent(gw, "/total", who, 1300, "usage.total_tokens 1300")


def test_a_reservation_read_from_the_request_body(gw, account, module_host):
    """`reserve: {json: max_tokens, ...}`: Envoy's dynamic module holds the request until
    its body is read and reserves the body's max_tokens (an answer without usage keeps it:
    3,000); the proxy-wasm hosts (Envoy's wasm filter, nginx) decide at the headers, before
    any body reaches the filter, and reserve the default, 500. Either way the usage settles
    it."""
    fresh_hour(30)
    chat = BY_NAME["openai-json"]
    kept, settled = account("kept"), account("settled")
    r = call(gw.port, "/body-reserve", chat, kept, body_reserve=3000, usage=(1, 1), fault="no-usage")
    assert (r.status, r.complete) == (200, True), r
    if module_host == "envoy-native":
        assert_spent(gw, "/body-reserve", kept, 3000, "max_tokens 3000, no usage in the answer")
    else:
        # Every request reserves the default here, the probes too: count how many more
        # reservations of 500 fit, each kept (no usage): 9,500 left is 19.
        assert _defaults_that_fit(gw.port, kept) == 19
    r = call(gw.port, "/body-reserve", OPENAI_SSE, settled, body_reserve=3000, usage=(900, 800))
    assert (r.status, r.complete) == (200, True), r
    if module_host == "envoy-native":
        assert_spent(gw, "/body-reserve", settled, 1700, "max_tokens 3000, usage 900 + 800")
    else:
        # 1,700 spent: 8,300 left, 16 reservations of 500.
        assert _defaults_that_fit(gw.port, settled) == 16


def _defaults_that_fit(port: int, who: str) -> int:
    """How many requests reserving the default (500) are admitted on `who`'s budget of
    /body-reserve before one is refused, each keeping its reservation (no usage)."""
    chat = BY_NAME["openai-json"]
    for n in range(BUDGET // 500 + 1):
        r = call(port, "/body-reserve", chat, who, body_reserve=1, fault="no-usage")
        if r.status != 200:
            assert r.status == 429, r
            return n
    raise AssertionError(f"more than {BUDGET // 500} reservations of 500 fit a budget of {BUDGET}")


# ------------------------------------------------------------------------------ concurrency


def _stream_usage(body: bytes) -> Optional[tuple[int, int]]:
    """(prompt, completion) of an OpenAI stream's usage chunk, if it has one."""
    for block in reversed(body.decode("utf-8", "replace").split("\n\n")):
        if block.startswith("data: {"):
            usage = json.loads(block[len("data: ") :]).get("usage")
            if usage:
                return usage["prompt_tokens"], usage["completion_tokens"]
    return None


def test_concurrent_streams_spend_exactly_what_they_reported(gw, account):
    """20 OpenAI streams at once (100 events, 20 ms apart: 2 s each) on one account's budget
    of 10,000, each reserving 1,000: the 10 reservations that fit pass whatever the order
    (an 11th only if another stream settled first), the rest are rejected, and once they
    have all ended the budget is charged exactly what the admitted streams reported."""
    fresh_hour(90)
    who = account()
    n = 20
    usage = [(100 + 7 * i, 200 + 13 * i) for i in range(n)]  # 300 to 680 tokens: each below 1,000
    barrier = threading.Barrier(n)

    def together() -> None:
        try:
            barrier.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass

    def one(i: int) -> Exchange:
        knobs = {"x-fake-events": "100", "x-fake-delay-ms": "20"}
        return call(gw.port, "/openai", OPENAI_SSE, who, reserve=1000, usage=usage[i], knobs=knobs,
                    connected=together, timeout=60)  # fmt: skip

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(one, range(n)))
    seconds = time.monotonic() - t0
    admitted = [i for i, r in enumerate(results) if r.status == 200]
    rejected = [i for i, r in enumerate(results) if r.status == 429]
    assert len(admitted) + len(rejected) == n, [r for r in results if r.status not in (200, 429)]
    for i in admitted:
        r = results[i]
        assert r.complete and r.body.rstrip().endswith(b"data: [DONE]"), (i, r)
        assert _stream_usage(r.body) == usage[i], (i, _stream_usage(r.body))
    reported = sum(usage[i][0] + usage[i][1] for i in admitted)
    left = BUDGET - reported
    record(
        f"{gw.label}: 20 concurrent OpenAI streams (100 events), budget 10,000, reserve 1,000 each",
        f"admitted {len(admitted)}, rejected {len(rejected)} in {seconds:.1f} s; "
        f"reported {reported} -> {left} left",
    )
    assert len(admitted) >= 10, f"only {len(admitted)} admitted: 10 reservations of 1,000 fit in 10,000"
    assert reported <= BUDGET
    assert_spent(gw, "/openai", who, reported, f"{len(admitted)} streams reporting {reported} in all")


# ------------------------------------------------------------------------------ faults

FAULT_RESERVE = 1500
FAULT_USAGE = (400, 300)  # what a reader that found usage anyway would charge: 700, not 1,500


@pytest.mark.parametrize("fault", ["no-usage", "malformed", "cut"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_an_answer_without_readable_usage_keeps_the_reservation(gw, llm, account, shape: Shape, fault: str):
    """No usage, the usage's JSON broken, or the answer cut before its usage: nothing says
    the call cost less than its reservation, which stays charged; and the client gets
    every byte the upstream sent, unchanged (cut: up to the cut)."""
    fresh_hour(30)
    who = account()
    through = call(gw.port, "/" + shape.provider, shape, who, reserve=FAULT_RESERVE, usage=FAULT_USAGE, fault=fault)
    direct = call(llm.port, "/" + shape.provider, shape, None, usage=FAULT_USAGE, fault=fault)
    assert through.status == 200, through
    assert direct.complete == (fault != "cut"), direct
    if fault != "cut":
        assert through.complete, through
    same_bytes(through, direct)
    assert_spent(gw, "/" + shape.provider, who, FAULT_RESERVE, f"{shape.name}, fault {fault}")
    if fault == "cut":
        record(
            f"{gw.label}: LLM answer cut mid-body, {shape.name}",
            f"{len(through.body)} bytes passed of {len(direct.body)} sent; the client saw the end "
            f"{'as a normal end (!)' if through.complete else 'as a cut'}; reservation {FAULT_RESERVE} kept",
        )


def test_an_openai_stream_without_include_usage_keeps_the_reservation(gw, account):
    """Without `stream_options.include_usage` OpenAI sends no usage: the reservation stands
    (README: use stream_options.include_usage)."""
    fresh_hour(30)
    who = account()
    bare = Shape("openai-sse-bare", "openai", "/v1/chat/completions", {**CHAT, "stream": True})
    r = call(gw.port, "/openai", bare, who, reserve=FAULT_RESERVE, usage=FAULT_USAGE)
    assert (r.status, r.complete) == (200, True), r
    assert b'"usage"' not in r.body
    assert_spent(gw, "/openai", who, FAULT_RESERVE, "a stream without include_usage")


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_a_huge_answer_passes_whole_and_its_usage_is_charged(gw, llm, account, shape: Shape):
    """5 MiB of content (5,120 events of 1 KiB in a stream), the usage at the very end:
    the client gets all of it, unchanged, and the usage is charged."""
    fresh_hour(60)
    who = account()
    usage = (1234, 2345)
    t0 = time.monotonic()
    through = call(gw.port, "/" + shape.provider, shape, who, reserve=5000, usage=usage, fault="huge", timeout=120)
    seconds = time.monotonic() - t0
    direct = call(llm.port, "/" + shape.provider, shape, None, usage=usage, fault="huge", timeout=120)
    assert (through.status, through.complete, through.error) == (200, True, None), through
    assert len(direct.body) >= 5 * 1024 * 1024
    same_bytes(through, direct)
    assert_spent(gw, "/" + shape.provider, who, 1234 + 2345, f"{shape.name}, 5 MiB, usage at the end")
    record(
        f"{gw.label}: huge LLM answer, {shape.name}",
        f"{len(through.body) / 1048576:.1f} MiB through in {seconds:.2f} s, usage {1234 + 2345} charged",
    )
