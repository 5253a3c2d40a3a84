"""The variants that decide DESIGN §6's bars, one list for every focused measurement.

`bench/paired.py` (Envoy CPU time under wrk, interleaved rounds) and
`bench/instructions.py` (instructions per request under valgrind) measure the same
variants, judged by the same bars. (`bench/overhead.py`, the full section of
`scripts/bench`, keeps its own, larger list: its keys are those of the recorded results.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common import EMPTY_MODULE, NATIVE_MODULE, ROOT, native_local_ratelimit, native_module_filter, wasm_filter
from overhead import diana_doc, global_doc, local_rule

RELEASE = ROOT / "target/wasm32-wasip1/release"
EMPTY = ROOT / "bench/empty-filter/target/wasm32-wasip1/release"
QUOTA = Path(os.environ.get("DIANA_QUOTA_BIN", ROOT / "target/release/diana-quota")).resolve()
# DESIGN §6: local rules at least as cheap as the empty filter; a global rule with a lease
# at most 5 % dearer.
LOCAL_BAR = 1.0
GLOBAL_BAR = 1.05


@dataclass(frozen=True)
class Variant:
    label: str
    filters: list[dict]
    # The bar this variant is judged by: its throughput at least `at_least` times the empty
    # filter's (local rules), or its cost at most `cost_at_most` times (global rules).
    at_least: Optional[float] = None
    cost_at_most: Optional[float] = None
    # It calls diana-quota (started once, with Redis, for every such variant).
    calls_out: bool = False
    # The name of the breaker on its resource: every request measured must be one call of
    # it (bench/instructions.py checks `diana_breaker_calls.<name>`), so that the closed
    # breaker's path is what was counted.
    breaker: Optional[str] = None
    # Its requests go to an upstream (a plain Envoy answering 200, not measured) instead of
    # a direct_response: a request's total then has Envoy's proxying in it, as in
    # production, which a breaker's share is of.
    proxied: bool = False
    # The variant this one adds to (the same document without the breaker): its own cost
    # is the difference (bench/instructions.py prints it, and its share of the request).
    adds_to: Optional[str] = None


# A closed breaker on the resource of the local rule (DESIGN §4b, issue 40 item 7): both
# thresholds, so that a call reads the response's `:status` and the clock at its headers;
# never trips at these rates (every answer is a fast 200). Without `slow_ms` (failures
# only), the call's duration is not judged, and a good call is judged without the clock
# (`Engine::judged_without_clock`): the difference between the two is the clock read.
BREAKER = "bench_b"
BREAKER_BOTH = f"    breaker: {{name: {BREAKER}, failure_ratio: 0.5, slow_ms: 1000, slow_ratio: 0.5}}\n"
BREAKER_FAILURES = f"    breaker: {{name: {BREAKER}, failure_ratio: 0.5}}\n"


def with_breaker(doc: str, breaker: str) -> str:
    """`doc` (one resource, `diana_doc`) with `breaker` on its resource."""
    head, sep, rest = doc.partition("    rules:\n")
    if not sep:
        raise ValueError("with_breaker: a document of one resource with rules (overhead.diana_doc)")
    return head + breaker + sep + rest


def breaker_variants(prefix: str, label: str, base_key: str, filter_of) -> dict[str, Variant]:
    """Local TB with a closed breaker (both thresholds, and failures only), each measured
    against `base_key`, the same rule without it; `filter_of(doc)` is the filter. Then the
    same three proxied to an upstream (`<prefix>_proxied`, `<prefix>_breaker_proxied`,
    `<prefix>_breaker_failures_proxied`): the breaker's share of a proxied request."""
    doc = diana_doc([local_rule("TB")])
    out = {}
    for suffix, proxied, where in (("", False, ""), ("_proxied", True, ", proxied")):
        base = base_key + suffix
        if proxied:
            out[base] = Variant(f"{label}{where}", [filter_of(doc)], proxied=True)
        out[f"{prefix}_breaker{suffix}"] = Variant(
            f"{label} + closed breaker (failure_ratio, slow_ms){where}",
            [filter_of(with_breaker(doc, BREAKER_BOTH))], breaker=BREAKER, adds_to=base, proxied=proxied)
        out[f"{prefix}_breaker_failures{suffix}"] = Variant(
            f"{label} + closed breaker (failure_ratio only){where}",
            [filter_of(with_breaker(doc, BREAKER_FAILURES))], breaker=BREAKER, adds_to=base, proxied=proxied)
    return out


def variants(diana_wasm: Path, untrimmed_wasm: Optional[Path] = None) -> dict[str, Variant]:
    """Every variant, by key. `diana_wasm` is the module deployed on Envoy; with
    `untrimmed_wasm` (cargo's output with every SDK callback), local TB on it too."""
    diana = str(diana_wasm)
    out = {
        "nofilter": Variant("no filter", []),
        "lrl": Variant("Envoy local_ratelimit", [native_local_ratelimit()]),
        "empty": Variant("empty wasm filter (stock SDK)", [wasm_filter("empty", str(EMPTY / "empty_filter.wasm"))]),
        "empty_trim": Variant("empty wasm filter, trimmed like Diana",
                              [wasm_filter("empty", str(EMPTY / "empty_filter_trimmed.wasm"))]),
        "nomatch": Variant("Diana, no rule matches (reads :path)",
                           [wasm_filter("diana", diana, diana_doc([local_rule("TB")], url="/nomatch"))]),
    }
    for algo in ("W", "SW", "TB", "LB"):
        out[f"local_{algo}"] = Variant(f"Diana local {algo}",
                                       [wasm_filter("diana", diana, diana_doc([local_rule(algo)]))],
                                       at_least=LOCAL_BAR)
    out.update(breaker_variants("local_TB", "Diana local TB", "local_TB",
                                lambda doc: wasm_filter("diana", diana, doc)))
    if untrimmed_wasm is not None:
        out["untrimmed_TB"] = Variant("Diana local TB, untrimmed diana.wasm",
                                      [wasm_filter("diana", str(untrimmed_wasm), diana_doc([local_rule("TB")]))],
                                      at_least=LOCAL_BAR)
    for lease in (1, 100, "auto"):
        out[f"global_{lease}"] = Variant(f"Diana global W, lease {lease}",
                                         [wasm_filter("diana", diana, global_doc("W", lease))],
                                         cost_at_most=GLOBAL_BAR, calls_out=True)
    # Per minute: under valgrind Envoy serves ~300 requests a second, so a per-second
    # window's fixed costs (a fresh lease each second, the refill ahead's 1 ms ticks) fall
    # on ~40× fewer requests than at production rates; a minute's window spreads them as
    # production traffic would, leaving the per-request path and one callout per lease.
    for lease in (100, "auto"):
        doc = global_doc("W", lease).replace("rpu: 1000000, unit: second", "rpu: 100000000, unit: minute")
        out[f"global_{lease}_minute"] = Variant(f"Diana global W per minute, lease {lease}",
                                                [wasm_filter("diana", diana, doc)],
                                                cost_at_most=GLOBAL_BAR, calls_out=True)
    if EMPTY_MODULE.is_file():
        out["native_empty"] = Variant("empty native module (does nothing)", [native_module_filter("", EMPTY_MODULE)])
    if NATIVE_MODULE.is_file():
        # Diana as Envoy's dynamic module (crates/diana-envoy-native): the same documents.
        out["native_TB"] = Variant("Diana native module local TB",
                                   [native_module_filter(diana_doc([local_rule("TB")]))], at_least=LOCAL_BAR)
        out.update(breaker_variants("native_TB", "Diana native module local TB", "native_TB", native_module_filter))
        for lease in (100, "auto"):
            out[f"native_global_{lease}"] = Variant(f"Diana native module global W, lease {lease}",
                                                    [native_module_filter(global_doc("W", lease))],
                                                    cost_at_most=GLOBAL_BAR, calls_out=True)
    return out


def chosen(vs: dict[str, Variant], keys: list[str]) -> dict[str, Variant]:
    """The variants named in `keys` (all when empty), the empty filter always among them:
    every ratio is to it."""
    if not keys:
        return vs
    unknown = [k for k in keys if k not in vs]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(vs)}")
    # A breaker variant's cost is its difference to the variant it adds to: that one too.
    keys = keys + [vs[k].adds_to for k in keys if vs[k].adds_to]
    return {k: v for k, v in vs.items() if k == "empty" or k in keys}
