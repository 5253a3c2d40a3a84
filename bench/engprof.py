"""Where the time goes, native side: instruction counts of diana-core's Engine::evaluate
(bench/engine-profile, the filter's Rust logic compiled natively) under
`valgrind --tool=callgrind`, per policy: (Ir with N evaluations − Ir with 0) ÷ N, and how
much of it is the in-memory shared-data host (the native stand-in for Envoy's shared
data), string formatting (`format!`), and the algorithm itself.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from common import ROOT, say

BIN = ROOT / "bench/engine-profile/target/release/engine-profile"
N = 20000

POLICIES = {
    "no rule matches": ("/nomatch", "{name: bench, rpu: 1000000000, unit: second, algo: TB}"),
    "TB": ("/", "{name: bench, rpu: 1000000000, unit: second, algo: TB}"),
    "W": ("/", "{name: bench, rpu: 1000000000, unit: second, algo: W}"),
    "SW": ("/", "{name: bench, rpu: 1000000000, unit: second, algo: SW}"),
    "LB": ("/", "{name: bench, rpu: 1000000000, unit: second, algo: LB}"),
    "TB, actor ip": ("/", "{name: bench, rpu: 1000000000, unit: second, algo: TB, actor: ip}"),
}

PARTS = {
    "shared data (MemoryHost get+set)": [r"MemoryHost as diana_core::store::SharedData>::get \[",
                                         r"MemoryHost as diana_core::store::SharedData>::set \["],
    "format! (alloc::fmt::format)": [r"^\s*[\d,]+ \([\d. ]+%\)\s+\S*alloc/src/fmt\.rs:alloc::fmt::format::format_inner \["],
    "algorithm (Algorithm::acquire)": [r"as diana_core::algo::Algorithm>::acquire \["],

}


def ir(out_file: Path) -> int:
    text = subprocess.run(["callgrind_annotate", "--auto=no", str(out_file)], capture_output=True, text=True, cwd="/").stdout
    m = re.search(r"([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", text)
    return int(m.group(1).replace(",", "")) if m else 0


def inclusive(out_file: Path) -> str:
    return subprocess.run(["callgrind_annotate", "--auto=no", "--inclusive=yes", str(out_file)],
                          capture_output=True, text=True, cwd="/").stdout


def run(logdir: Path) -> dict[str, Any]:
    logdir = logdir.resolve()
    if not shutil.which("valgrind") or not BIN.is_file():
        return {"skipped": "valgrind or bench/engine-profile not available"}
    rows = []
    for name, (url, rule) in POLICIES.items():
        pol = logdir / f"profile-{re.sub(r'[^a-z0-9]+', '_', name.lower())}.yaml"
        pol.write_text(f"resources:\n  - Url: {url}\n    rules:\n      - {rule}\n")
        counts = {}
        for n in (0, N):
            out = logdir / f"{pol.stem}.{n}.callgrind"
            subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", str(BIN), str(pol), str(n), "/"],
                           capture_output=True, text=True, timeout=600)
            counts[n] = out
        total = (ir(counts[N]) - ir(counts[0])) / N
        inc = inclusive(counts[N])
        parts = {}
        for part, patterns in PARTS.items():
            s = 0
            for pat in patterns:
                # the function's own summary line (largest inclusive count), not call sites
                vals = [int(line.split()[0].replace(",", "")) for line in inc.splitlines()
                        if re.match(r"^\s*[\d,]+ \([\d. ]+%\)\s+\S", line) and re.search(pat, line)]
                s += max(vals, default=0)
            parts[part] = s / N
        rows.append({"policy": name, "rule": rule, "url": url, "ir_per_request": total, "parts": parts})
        say(f"profile: {name:<16} {total:>7.0f} instructions per evaluate; "
            + ", ".join(f"{k.split(' (')[0]} {v:.0f}" for k, v in parts.items()))
    return {"n": N, "rows": rows, "command": f"valgrind --tool=callgrind bench/engine-profile/target/release/engine-profile POLICY.yaml {N} /"}
