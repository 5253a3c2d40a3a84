"""shm_kv as it really is (DESIGN §1): ngx_wasm_module finds a key by its CRC32 alone (two
keys with the same CRC32 share one entry) and a full zone evicts its least recently used
entries. Diana's records carry a check of their own key, so a record that belongs to
another key is treated like a slot held by someone else; an evicted record is created
again, race-free; and `diana check` says how large the zone must be never to evict.

The identities and keys are computed here the way crates/diana-core computes them
(the keyed identity hash of a document's `identity_key`, `SlotAddress::of`; tests/e2e/forge.py),
so that the test can aim at colliding keys."""

from __future__ import annotations

import json
import subprocess
import zlib

import forge
from harness import DIANA_BIN, Nginx, errors, record, request, send_concurrent, statuses

DIANA = DIANA_BIN
# The deployment's identity key: with it, the test (like any holder of the key, and nobody
# else) can compute where an identity lands.
IDENTITY_KEY = "shm-test-identity-key-0123456789abcdef"
KEY = forge.identity_key(IDENTITY_KEY)


def first_slot(value: str, slots: int) -> int:
    name = b"x-device-id"
    h = forge.siphash13(KEY, b"\x02" + len(name).to_bytes(8, "little") + name + value.encode())
    return forge.candidates(h, slots)[0]


def plan(document: str) -> dict:
    p = subprocess.run([str(DIANA), "check", "--json", "-"], input=document, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def start(procs, upstream, document: str, shm_size: str, name: str = "nginx") -> Nginx:
    return procs.add(
        Nginx(procs.log_dir, diana_config=document, upstream_port=upstream.port, shm_size=shm_size, name=name)
    ).start()


def test_keys_with_the_same_crc32_do_not_share_a_counter(procs, upstream):
    # Two per-device rules on two resources, with slot tables of different sizes. Their
    # keys `diana/<table>/<slot>` share a CRC32 (and so one shm_kv entry on nginx) only
    # for some pairs of rules: CRC32 is linear, and decimal slot numbers vary in few bits.
    # Some pairs of rules have thousands of colliding slot pairs (one in 50 to 200): look among
    # candidate rules `/y<k>` for one.
    big, other = 1 << 20, (1 << 20) - 3
    CANDIDATES = 400
    x_rule = f"  - Url: /x\n    rules: [{{name: x, actor: device, algo: W, unit: hour, rpu: 3, slots: {big}}}]\n"

    def y_rule(k: int) -> str:
        return f"  - Url: /y{k}\n    rules: [{{name: y{k}, actor: device, algo: W, unit: hour, rpu: 3, slots: {other}}}]\n"

    candidates_doc = f"identity_key: {IDENTITY_KEY}\nresources:\n" + x_rule + "".join(y_rule(k) for k in range(CANDIDATES))
    ids = {rule["name"]: rule["table"] for resource in plan(candidates_doc)["resources"] for rule in resource["rules"]}
    x_keys = {zlib.crc32(f"diana/{ids['x']}/{slot}".encode()): slot for slot in range(big)}
    pairs: dict[int, int] = {}
    # /y204 collides with /x (found by this search); it is tried first to keep the test
    # short, and the search goes on if ids ever change. Every colliding pair of the first
    # such rule is kept: the identities are then found among thousands of targets.
    for k in [204] + [k for k in range(CANDIDATES) if k != 204]:
        for slot in range(other):
            crc = zlib.crc32(f"diana/{ids[f'y{k}']}/{slot}".encode())
            if crc in x_keys:
                pairs[x_keys[crc]] = slot
        if pairs:
            break
    assert pairs, f"no pair of rules with colliding keys among {CANDIDATES} candidates"
    document = f"identity_key: {IDENTITY_KEY}\nresources:\n" + x_rule + y_rule(k)
    partner = {y: x for x, y in pairs.items()}

    # alice's first slot on /x and bob's on /y<k> hold keys with one CRC32.
    on_x: dict[int, str] = {}
    on_y: dict[int, str] = {}
    found = None
    for i in range(5_000_000):
        value = f"crc-{i}"
        x = first_slot(value, big)
        if x in pairs:
            on_x[x] = value
            if pairs[x] in on_y:
                found = (x, pairs[x])
                break
        y = first_slot(value, other)
        if y in partner:
            on_y[y] = value
            if partner[y] in on_x:
                found = (partner[y], y)
                break
    assert found, f"no identities on colliding slots ({len(pairs)} pairs)"
    x_slot, y_slot = found
    alice, bob = on_x[x_slot], on_y[y_slot]
    gw = start(procs, upstream, document, "8m")
    first = [request(gw.port, "/x", {"x-device-id": alice}).status for _ in range(4)]
    second = [request(gw.port, f"/y{k}", {"x-device-id": bob}).status for _ in range(4)]
    again = request(gw.port, "/x", {"x-device-id": alice}).status
    record(
        "nginx: colliding shm_kv keys",
        f"x slot {x_slot} and y{k} slot {y_slot} share CRC32; alice on /x {first}, bob on /y{k} {second}, "
        f"alice again {again}",
    )
    # Each is limited on a counter of its own: bob's charges never land in alice's record
    # (nor the reverse), and nobody gets more than 3.
    assert first == [200, 200, 200, 503], first
    assert second == [200, 200, 200, 503], second
    assert again == 503


def test_a_tiny_zone_evicts_without_failing_and_counters_start_over(procs, upstream):
    document = "Url: /\nrules:\n  - {name: dev, actor: device, algo: W, unit: hour, rpu: 2}\n"
    gw = start(procs, upstream, document, "32k")
    # Far more identities than a 32 KiB zone holds (a record takes 256 bytes).
    resps = send_concurrent(gw.port, 400, "/", lambda i: {"x-device-id": f"tiny-{i}"})
    resps += send_concurrent(gw.port, 400, "/", lambda i: {"x-device-id": f"tiny-{i + 400}"})
    assert not errors(resps), errors(resps)
    st = statuses(resps)
    # Distinct identities: each is admitted (or shares a busy counter), never a 5xx.
    assert set(st) <= {200, 503}, st
    # The newest identity still has its limit.
    fresh = [request(gw.port, "/", {"x-device-id": "tiny-last"}).status for _ in range(3)]
    # The first ones were evicted: their counters start over (DESIGN §1: survive eviction).
    evicted = [request(gw.port, "/", {"x-device-id": "tiny-0"}).status for _ in range(3)]
    record("nginx: shm_kv 32k, 800 identities", f"{st}; newest {fresh}; the first again {evicted}")
    assert fresh == [200, 200, 503], fresh
    assert evicted == [200, 200, 503], evicted
    assert gw.crash_lines() == []


def test_the_zone_diana_check_asks_for_never_evicts(procs, upstream):
    slots = 8000
    document = (
        f"identity_key: {IDENTITY_KEY}\nresources:\n  - Url: /\n"
        f"    rules: [{{name: dev, actor: device, algo: SW, unit: hour, rpu: 1, slots: {slots}}}]\n"
    )
    size = plan(document)["nginx"]["shm_kv_bytes"]
    # One identity per first slot, nearly every slot: no two share a counter, so each is
    # limited on its own, and the table is nearly full.
    taken: dict[int, str] = {}
    for i in range(6 * slots):
        value = f"size-{i}"
        taken.setdefault(first_slot(value, slots), value)
    ids = list(taken.values())

    def passes(gw) -> tuple[dict, dict]:
        first = send_concurrent(gw.port, len(ids), "/", lambda i: {"x-device-id": ids[i]})
        second = send_concurrent(gw.port, len(ids), "/", lambda i: {"x-device-id": ids[i]})
        assert not errors(first + second), errors(first + second)
        return statuses(first), statuses(second)

    sized = start(procs, upstream, document, f"{size >> 10}k", "nginx-sized")
    first, second = passes(sized)
    small = start(procs, upstream, document, f"{size >> 12}k", "nginx-quarter")
    first_small, second_small = passes(small)
    record(
        "nginx: zone sizing (SW, slots 8000)",
        f"`diana check`: {size >> 20} MiB; {len(ids)} identities; second pass {second} (sized), "
        f"{second_small} (a quarter of it)",
    )
    # Sized as `diana check` says: every counter is still there for the second pass.
    assert second == {503: len(ids)}, (first, second)
    # The test can tell: at a quarter of the size counters were evicted and started over.
    assert second_small.get(200, 0) > 0, (first_small, second_small)
