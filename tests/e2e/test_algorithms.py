"""Exact admitted counts for every algorithm, on a real Envoy running 4 worker threads and a
real nginx running 2 worker processes: local scope is per *process* (shared data + CAS;
nginx's shm_kv), so 80 requests spread over the workers admit exactly rpu, not
workers x rpu (DESIGN §4 "Scope local")."""

from __future__ import annotations

import time

import pytest

from harness import errors, record, request, send_concurrent, statuses, wait_for_fresh_minute

BURST = 80
RPU = 20


def _spread_check(gw, resps) -> dict[str, int]:
    per_worker = gw.spread(resps)
    assert len(per_worker) >= 2, f"requests did not reach several workers, the test proves nothing: {per_worker}"
    return per_worker


@pytest.mark.parametrize("algo", ["W", "SW", "TB"])
def test_exact_admitted_count_across_workers(start_gateway, algo):
    gw = start_gateway(
        f"""\
Url: /
rules:
  - name: all_{algo.lower()}
    actor: all
    algo: {algo}
    unit: minute
    rpu: {RPU}
"""
    )
    if algo == "W":
        wait_for_fresh_minute(10)  # the fixed window is the epoch minute: don't straddle it
    t0 = time.monotonic()
    first = send_concurrent(gw.port, BURST, "/", lambda i: {"x-device-id": f"dev-{i}"})
    second = send_concurrent(gw.port, RPU, "/")
    elapsed = time.monotonic() - t0
    per_worker = _spread_check(gw, first + second)
    assert not errors(first + second), errors(first + second)

    s1, s2 = statuses(first), statuses(second)
    record(f"{gw.label}: admitted[{algo}, rpu {RPU}/minute, {BURST} concurrent + {RPU}]", f"{s1} then {s2} in {elapsed:.2f}s")
    print(f"{algo}: first burst {s1}, second burst {s2}, {elapsed:.2f}s, connections per worker {per_worker}")
    assert set(s1) <= {200, 503} and set(s2) <= {200, 503}, (s1, s2)
    # TB refills continuously: one token per 60/RPU = 3 s.
    refill = int(elapsed // (60 / RPU)) if algo == "TB" else 0
    assert s1.get(200, 0) == RPU or (refill and RPU <= s1.get(200, 0) <= RPU + refill), s1
    assert s1.get(200, 0) + s2.get(200, 0) <= RPU + refill, (s1, s2)
    if refill == 0:
        assert s1 == {200: RPU, 503: BURST - RPU}
        assert s2 == {503: RPU}


def test_leaky_bucket_paces_and_rejects_overflow(start_envoy):
    """LB unit second rpu 10 burst 5: one leaves at once, 5 wait (one every 100 ms), the
    rest are rejected at once. (Envoy: nginx cannot hold a request, see
    test_leaky_bucket_on_nginx_rejects_with_retry_after.)"""
    envoy = start_envoy(
        """\
Url: /
rules:
  - name: all_lb
    actor: all
    algo: LB
    unit: second
    rpu: 10
    burst: 5
"""
    )
    n = 14
    resps = send_concurrent(envoy.port, n, "/", timeout=15)
    _spread_check(envoy, resps)
    assert not errors(resps), errors(resps)
    st = statuses(resps)
    admitted = sorted((r for r in resps if r.status == 200), key=lambda r: r.t_done)
    rejected = [r for r in resps if r.status != 200]
    t_start = min(r.t_sent for r in resps)
    done_ms = [round((r.t_done - t_start) * 1000) for r in admitted]
    gaps = [b - a for a, b in zip(done_ms, done_ms[1:])]
    rej_ms = sorted(round(r.latency * 1000) for r in rejected)
    record("admitted[LB, rpu 10/s burst 5, 14 concurrent]", f"{st}; admitted at {done_ms} ms; gaps {gaps} ms; "
           f"rejected after {rej_ms} ms")  # fmt: skip
    print(f"LB: {st}; admitted at {done_ms} ms (gaps {gaps}); rejected latencies {rej_ms} ms")

    assert st == {200: 6, 503: n - 6}, st
    # paced at one per 100 ms: gaps ~100 ms each, ~500 ms from first to last
    for g in gaps:
        assert 55 <= g <= 250, f"admitted requests not spaced ~100 ms apart: {done_ms}"
    assert 420 <= done_ms[-1] - done_ms[0] <= 900, done_ms
    # the overflow is rejected at once, not after waiting in the queue
    assert max(rej_ms) < 300, rej_ms
    for r in rejected:
        assert r.body == b"rate limited\n"


def test_leaky_bucket_on_nginx_rejects_with_retry_after(procs, upstream):
    """nginx cannot resume a request from the tick (DESIGN §1): a local leaky bucket admits
    what may pass now and rejects what would have waited, with Retry-After, reserving
    nothing; the pace is kept (one per 100 ms)."""
    from harness import Nginx  # noqa: PLC0415

    gw = procs.add(
        Nginx(
            procs.log_dir,
            diana_config="Url: /\nrules:\n  - {name: all_lb, actor: all, algo: LB, unit: second, rpu: 10, burst: 5}\n",
            upstream_port=upstream.port,
        )
    ).start()
    first = send_concurrent(gw.port, 6, "/")
    assert not errors(first), errors(first)
    assert statuses(first) == {200: 1, 503: 5}, statuses(first)
    rejected = [r for r in first if r.status == 503]
    assert all(r.header("retry-after") == "1" for r in rejected), [r.headers for r in rejected]
    # Nothing was reserved by the rejected: 100 ms later exactly one passes again.
    time.sleep(0.12)
    second = send_concurrent(gw.port, 4, "/")
    assert statuses(second) == {200: 1, 503: 3}, statuses(second)
    # Paced: one request every 100 ms passes, all of them.
    paced = []
    for _ in range(5):
        time.sleep(0.11)
        paced.append(request(gw.port, "/").status)
    record("nginx: LB rpu 10/s burst 5", f"6 at once {statuses(first)}; 4 at once 120 ms later {statuses(second)}; one per 110 ms {paced}")
    assert paced == [200] * 5, paced
    assert gw.crash_lines() == [], gw.crash_lines()
