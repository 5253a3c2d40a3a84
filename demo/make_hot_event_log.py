#!/usr/bin/env python3
"""Writes demo/hot-event.jsonl: twenty seconds of a small Weitter hot event, as a request
log for `diana simulate` (see README, "Trying a policy on yesterday's traffic").

- normal timeline reads: 10 req/s on /timeline/<user> from 200 devices, all along;
- a scraper: one device reading /timeline/ at 8 req/s, all along;
- the hot post: /hot/trending flooded at 100 req/s from 3,000 devices, seconds 6 to 14;
- two bursts of 12 posts (POST /post) at seconds 3 and 16.

Deterministic (fixed seed): running it again writes the same file.

    python3 demo/make_hot_event_log.py [OUT]
"""

from __future__ import annotations

import datetime
import json
import random
import sys
from pathlib import Path

START = datetime.datetime(2026, 11, 21, 18, 0, 0, tzinfo=datetime.timezone.utc).timestamp()
SECONDS = 20


def stamp(offset: float) -> str:
    t = datetime.datetime.fromtimestamp(START + offset, tz=datetime.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("hot-event.jsonl")
    rng = random.Random(2026)
    requests: list[tuple[float, str, str, str]] = []
    for _ in range(10 * SECONDS):
        requests.append((rng.uniform(0, SECONDS), "GET", f"/timeline/u{rng.randrange(5000)}", f"d{rng.randrange(200)}"))
    for k in range(8 * SECONDS):
        requests.append((k / 8 + rng.uniform(0, 0.01), "GET", "/timeline/", "scraper-1"))
    for k in range(100 * 8):
        requests.append((6 + k / 100, "GET", "/hot/trending", f"d{1000 + rng.randrange(3000)}"))
    for burst in (3.2, 16.2):
        for k in range(12):
            requests.append((burst + k * 0.01, "POST", "/post", f"d{rng.randrange(200)}"))
    requests.sort()
    with out.open("w") as f:
        for offset, method, path, device in requests:
            line = {"ts": stamp(offset), "method": method, "path": path, "headers": {"x-device-id": device}}
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    print(f"{out}: {len(requests)} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
