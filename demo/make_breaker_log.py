#!/usr/bin/env python3
"""Writes demo/payments-outage.jsonl: forty seconds of /payments with what its upstream
answered and how long it took, as a request log for `diana simulate` with a circuit
breaker (see README, "Trying a policy on yesterday's traffic").

- 20 req/s on /payments from 50 devices, all along;
- the upstream answers 200 in 80-200 ms, except from second 10 to second 20: then three
  requests in four get a 503 (in 5-30 ms), and the fourth a 200 after 1.2-2 s.

Deterministic (fixed seed): running it again writes the same file.

    python3 demo/make_breaker_log.py [OUT]
"""

from __future__ import annotations

import datetime
import json
import random
import sys
from pathlib import Path

START = datetime.datetime(2026, 11, 21, 18, 0, 0, tzinfo=datetime.timezone.utc).timestamp()
SECONDS = 40
RATE = 20
OUTAGE = (10.0, 20.0)


def stamp(offset: float) -> str:
    t = datetime.datetime.fromtimestamp(START + offset, tz=datetime.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("payments-outage.jsonl")
    rng = random.Random(2026)
    lines = []
    for k in range(SECONDS * RATE):
        at = k / RATE
        status, duration = 200, rng.randint(80, 200)
        if OUTAGE[0] <= at < OUTAGE[1]:
            if k % 4:
                status, duration = 503, rng.randint(5, 30)
            else:
                duration = rng.randint(1200, 2000)
        lines.append(
            json.dumps(
                {
                    "ts": stamp(at),
                    "method": "POST",
                    "path": "/payments",
                    "headers": {"x-device-id": f"d{rng.randrange(50)}"},
                    "status": status,
                    "duration_ms": duration,
                }
            )
        )
    out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
