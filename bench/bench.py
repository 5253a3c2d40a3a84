#!/usr/bin/env python3
"""The benchmark driver behind scripts/bench (see BENCHMARKS.md, "How to run").

Runs the sections in order — overhead (+ wasm runtime probe), accuracy, diana-quota alone,
degrade, Weitter hot event, cascade (a slow dependency, without and with a breaker) — each
in its own try block so that one failing section still leaves the others' figures; writes
.tmp/bench/<stamp>/results.json, the report and the Weitter and cascade charts. Every
process it starts is stopped by PID in a finally block (and on SIGINT/SIGTERM).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, Procs, envoy_bin, envoy_version, machine_info, say  # noqa: E402

SECTIONS = ["overhead", "accuracy", "quota", "degrade", "weitter", "cascade"]
# Run only when named in BENCH_SECTIONS: rls, Envoy's ratelimit filter → diana-quota's RLS
# against → Limitador alone, in detail (bench/rls.py; docs/rls.md).
OPTIONAL_SECTIONS = ["rls"]
# Run alone (BENCH_SECTIONS=cascade, or with rls), these are focused measurements: their
# report goes under .tmp/bench/<stamp>/, BENCHMARKS.md is left as it is.
FOCUSED_SECTIONS = OPTIONAL_SECTIONS + ["cascade"]


def env_int(name: str, default: int) -> int:
    v = os.environ.get(name, "")
    return int(v) if v.strip() else default


def main() -> int:
    quick = os.environ.get("QUICK", "0") not in ("", "0", "false", "no")
    cfg = {
        "quick": quick,
        "rounds": env_int("BENCH_ROUNDS", 1 if quick else 5),
        "duration": env_int("BENCH_DURATION", 3 if quick else 10),
        "warmup": 1 if quick else 3,
        "accuracy_duration": 3 if quick else 10,
        "quota_rounds": 1 if quick else 3,
        # the "where the time goes" variants, host-call probe and callgrind profile
        "extra": os.environ.get("BENCH_EXTRA", "0" if quick else "1") != "0",
    }
    sections = [s.strip() for s in os.environ.get("BENCH_SECTIONS", ",".join(SECTIONS)).split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS) - set(OPTIONAL_SECTIONS)
    if unknown:
        raise SystemExit(f"unknown BENCH_SECTIONS: {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(SECTIONS + OPTIONAL_SECTIONS)})")
    # The rls section alone is a focused comparison, not a full report: it never rewrites
    # BENCHMARKS.md (its report goes under .tmp/bench/<stamp>/ unless BENCH_OUT says where).
    only_rls = set(sections) <= set(OPTIONAL_SECTIONS)
    focused = set(sections) <= set(FOCUSED_SECTIONS)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    logdir = ROOT / ".tmp" / "bench" / stamp
    logdir.mkdir(parents=True, exist_ok=True)
    if os.environ.get("BENCH_OUT"):
        out_md = Path(os.environ["BENCH_OUT"]).resolve()
        chart_dir = out_md.parent / "docs" / "bench" if not quick else logdir
    elif quick or focused:
        out_md, chart_dir = logdir / "BENCHMARKS.md", logdir
    else:
        out_md, chart_dir = ROOT / "BENCHMARKS.md", ROOT / "docs" / "bench"

    diana_wasm = Path(os.environ.get("DIANA_WASM", ROOT / "target/wasm32-wasip1/release/diana-envoy.wasm")).resolve()
    untrimmed_wasm = (ROOT / "target/wasm32-wasip1/release/diana.wasm").resolve()
    quota_bin = Path(os.environ.get("DIANA_QUOTA_BIN", ROOT / "target/release/diana-quota")).resolve()
    empty_wasm = (ROOT / "bench/empty-filter/target/wasm32-wasip1/release/empty_filter.wasm").resolve()
    empty_trimmed_wasm = empty_wasm.with_name("empty_filter_trimmed.wasm")
    probe_wasm = (ROOT / "bench/probe-filter/target/wasm32-wasip1/release/probe_filter.wasm").resolve()
    # The peer (Envoy's ratelimit filter → Limitador): optional, skipped when not built.
    limitador_bin = (ROOT / "bench/limitador-rls/target/release/limitador-rls").resolve()
    # The empty filter is the overhead section's floor; the others do without it.
    needed = [(diana_wasm, "the Diana filter")] + ([(empty_wasm, "the empty filter")] if "overhead" in sections else [])
    for p, what in needed:
        if not p.is_file() and not only_rls:
            raise SystemExit(f"{what} not found at {p} (run scripts/bench without BENCH_NO_BUILD)")
    if not quota_bin.is_file():
        say(f"diana-quota not found at {quota_bin}: the global parts are skipped")
        quota_bin_opt = None
    else:
        quota_bin_opt = quota_bin

    envoy = envoy_bin()
    os.environ["DIANA_ENVOY"] = envoy
    res: dict = {
        "command": os.environ.get("BENCH_COMMAND", "scripts/bench"),
        # The command that runs exactly these sections (a section's own figures say it).
        "sections_command": (os.environ.get("BENCH_COMMAND", "scripts/bench") if sections == SECTIONS else
                             f"BENCH_SECTIONS={','.join(sections)} {os.environ.get('BENCH_COMMAND', 'scripts/bench')}"),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "config": cfg, "sections": sections, "machine": machine_info(), "envoy_version": envoy_version(envoy),
        "binaries": {"diana_wasm": str(diana_wasm),
                     "diana_wasm_bytes": diana_wasm.stat().st_size if diana_wasm.is_file() else None,
                     "untrimmed_wasm_bytes": untrimmed_wasm.stat().st_size if untrimmed_wasm.is_file() else None,
                     "empty_wasm_bytes": empty_wasm.stat().st_size if empty_wasm.is_file() else None,
                     "diana_quota": str(quota_bin_opt),
                     "limitador_rls": str(limitador_bin) if limitador_bin.is_file() else None},
        "errors": {},
    }
    say(f"Envoy {res['envoy_version']}, {res['machine']['nproc']} CPUs ({res['machine']['cpu_model']}); "
        f"sections {', '.join(sections)}; logs in {logdir.relative_to(ROOT)}")

    procs = Procs(logdir)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    t_start = time.monotonic()
    try:
        for section in sections:
            t0 = time.monotonic()
            say(f"=== {section}")
            try:
                if section == "overhead":
                    import overhead
                    res["runtimes"] = overhead.probe_runtimes(procs, empty_wasm, diana_wasm)
                    res["overhead"] = overhead.run(procs, cfg, diana_wasm, empty_wasm, quota_bin_opt,
                                                   untrimmed_wasm=untrimmed_wasm,
                                                   empty_trimmed_wasm=empty_trimmed_wasm,
                                                   limitador_bin=limitador_bin if limitador_bin.is_file() else None)
                    procs.stop_all()
                    if cfg["extra"] and probe_wasm.is_file():
                        res["hostcalls"] = overhead.run_hostcalls(procs, cfg, probe_wasm)
                    if cfg["extra"]:
                        import engprof
                        res["engine_profile"] = engprof.run(logdir)
                elif section == "accuracy":
                    import accuracy
                    res["accuracy"] = accuracy.run(procs, cfg, diana_wasm, quota_bin_opt)
                elif section == "quota":
                    if quota_bin_opt is None:
                        raise RuntimeError("diana-quota was not built")
                    import quota
                    res["quota"] = quota.run(procs, cfg, quota_bin_opt)
                elif section == "degrade":
                    if quota_bin_opt is None:
                        raise RuntimeError("diana-quota was not built")
                    import degrade
                    res["degrade"] = degrade.run(procs, cfg, diana_wasm, quota_bin_opt)
                elif section == "weitter":
                    import weitter
                    res["weitter"] = weitter.run(procs, cfg, diana_wasm)
                elif section == "cascade":
                    import cascade
                    res["cascade"] = cascade.run(procs, cfg, diana_wasm)
                elif section == "rls":
                    import rls
                    res["rls"] = rls.run(procs, cfg, quota_bin_opt,
                                         limitador_bin if limitador_bin.is_file() else None)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # keep the other sections' figures
                traceback.print_exc()
                res["errors"][section] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            finally:
                procs.stop_all()
            res.setdefault("section_seconds", {})[section] = round(time.monotonic() - t0, 1)
            say(f"=== {section} done in {time.monotonic() - t0:.0f} s")
    except KeyboardInterrupt:
        say("interrupted; stopping everything")
        procs.stop_all()
        return 130
    finally:
        procs.stop_all()

    res["elapsed_min"] = (time.monotonic() - t_start) / 60
    res["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    if not quick:
        res["full_run_estimate"] = f"{res['elapsed_min']:.0f} min"
    (logdir / "results.json").write_text(json.dumps(res, indent=1))

    import report

    def write_chart(name: str, svg: str) -> str:
        """Writes a chart beside the others; its path as the report links it."""
        chart_dir.mkdir(parents=True, exist_ok=True)
        path = chart_dir / name
        path.write_text(svg)
        say(f"chart: {path}")
        return os.path.relpath(path, out_md.parent)

    chart_rel = cascade_rel = None
    if res.get("weitter"):
        import chart
        chart_rel = write_chart("weitter-hot-event.svg", chart.weitter_svg(res["weitter"]))
    if res.get("cascade"):
        import cascade
        cascade_rel = write_chart("cascade.svg", cascade.cascade_svg(res["cascade"]))
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(report.render(res, chart_rel, cascade_rel))
    say(f"report: {out_md} (raw results {logdir / 'results.json'}); took {res['elapsed_min']:.1f} min")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
