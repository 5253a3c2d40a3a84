"""Memory stays bounded under a flood of distinct identities (DESIGN §4: a fixed-size slot
table per rule, because Envoy never frees shared-data keys and an attacker controls
header values; on nginx, shm_kv is a zone of fixed size that evicts).

300,000 distinct x-device-id values through a per-device TB rule with `slots: 65536`:
the gateway's RSS (nginx: master + workers) is read after the first 100,000 (the table is
full by then) and after the remaining 200,000; the growth in the second phase must be
small. The gateway answers by itself (Envoy: a direct_response route; nginx: a second
server block), so the numbers measure the gateway + the filter only."""

from __future__ import annotations

import os

from harness import record, request, wrk_flood

FIRST = int(os.environ.get("DIANA_FLOOD_FIRST", "100000"))
SECOND = int(os.environ.get("DIANA_FLOOD_SECOND", "200000"))
MAX_GROWTH_BYTES = 30 << 20
MAX_GROWTH_RATIO = 0.15

CONFIG = """\
resources:
  - Url: /
    rules:
      - name: flood_device
        actor: device
        algo: TB
        unit: second
        rpu: 10
        slots: 65536
"""


def test_rss_bounded_under_distinct_device_flood(start_gateway, log_dir):
    gw = start_gateway(CONFIG, direct_response=(200, "ok\n"), upstream_port=None, shm_size="32m")
    for i in range(50):  # warm every worker's VM
        request(gw.port, "/", {"x-device-id": f"warm-{i}"})
    rss0 = gw.rss()

    r1 = wrk_flood(gw.port, FIRST, prefix="p1", work_dir=log_dir / "phase1", max_seconds=150)
    rss1 = gw.rss()
    r2 = wrk_flood(gw.port, SECOND, prefix="p2", work_dir=log_dir / "phase2", max_seconds=240)
    rss2 = gw.rss()

    assert gw.alive(), "the gateway died during the flood"
    follow = request(gw.port, "/", {"x-device-id": "after-flood"})
    growth = rss2 - rss1
    ratio = growth / rss1
    mib = 1 << 20
    summary = (
        f"RSS start {rss0 / mib:.1f} MiB; after {r1.requests} requests ({FIRST} distinct ids) {rss1 / mib:.1f} MiB "
        f"({r1.requests / r1.seconds:.0f} req/s); after {r2.requests} more ({SECOND} new ids) {rss2 / mib:.1f} MiB "
        f"({r2.requests / r2.seconds:.0f} req/s); growth in phase 2 {growth / mib:+.1f} MiB ({ratio:+.1%}); "
        f"non-2xx {r1.non_2xx}+{r2.non_2xx}, socket errors {r1.socket_errors}+{r2.socket_errors}"
    )
    m = gw.diana_metrics()
    summary += "; filter metrics " + ", ".join(
        f"{k}={v}" for k, v in m.items() if v and ("flood_device" in k or "slot" in k or "store" in k)
    )
    print(summary)
    record(f"{gw.label}: memory (300k distinct device ids, slots 65536)", summary)

    assert r1.requests >= FIRST and r2.requests >= SECOND, (r1.output, r2.output)
    assert r1.socket_errors == 0 and r2.socket_errors == 0, (r1.output, r2.output)
    assert follow.status in (200, 503), follow
    assert growth < MAX_GROWTH_BYTES or ratio < MAX_GROWTH_RATIO, summary
