"""Resource hierarchy and path matching (DESIGN §4 "Matching"): `/` is checked before
`/sample`, the first denial ends the evaluation, and no spelling of a path escapes its
limit. Paths are sent byte for byte (http.client, no normalisation; Envoy's own
normalize_path / merge_slashes are off in the rendered bootstrap)."""

from __future__ import annotations

import pytest

from harness import KeepAlive, errors, record, request, send_concurrent, statuses, wait_for_fresh_minute

HIERARCHY_ALL = """\
resources:
  - Url: /
    rules:
      - {name: root, actor: all, algo: W, unit: minute, rpu: 5}
  - Url: /sample
    rules:
      - {name: sample, actor: all, algo: W, unit: minute, rpu: 3}
"""


def test_sample_stops_at_3_and_root_counts_only_what_was_admitted(start_gateway):
    gw = start_gateway(HIERARCHY_ALL)
    wait_for_fresh_minute(10)
    sample = [request(gw.port, "/sample", {"x-device-id": f"d{i}"}) for i in range(4)]
    rest = [request(gw.port, "/other") for _ in range(3)]
    s_sample, s_rest = [r.status for r in sample], [r.status for r in rest]
    record(f"{gw.label}: hierarchy / rpu 5, /sample rpu 3", f"/sample x4 -> {s_sample}; then / x3 -> {s_rest}")
    # /sample admits 3; the 4th is denied by /sample, and / gives back what it had taken
    assert s_sample == [200, 200, 200, 503], sample
    assert sample[3].header("x-ratelimit-limit") in (None, "3"), sample[3].headers
    # / has counted the 3 admitted requests of its 5: two more pass (a rejected request
    # consumes nothing)
    assert s_rest == [200, 200, 503], rest
    assert rest[1].header("x-ratelimit-limit") in (None, "5"), rest[1].headers


def test_concurrent_sample_requests_across_workers(start_gateway):
    gw = start_gateway(HIERARCHY_ALL)
    wait_for_fresh_minute(10)
    resps = send_concurrent(gw.port, 20, "/sample/x")
    assert not errors(resps)
    assert statuses(resps) == {200: 3, 503: 17}
    # / counted the 3 admitted only, whatever the order the workers raced in: 2 are left
    assert [request(gw.port, "/").status for _ in range(3)] == [200, 200, 503]


def test_denial_by_root_does_not_charge_sample(start_gateway):
    gw = start_gateway(
        """\
resources:
  - Url: /
    rules:
      - {name: root_dev, actor: device, algo: W, unit: minute, rpu: 5}
  - Url: /sample
    rules:
      - {name: sample_all, actor: all, algo: W, unit: minute, rpu: 3}
"""
    )
    wait_for_fresh_minute(10)
    a = {"x-device-id": "device-a"}
    first = [request(gw.port, "/home", a).status for _ in range(5)]
    denied = [request(gw.port, "/sample", a) for _ in range(4)]  # denied by / : must not charge /sample
    b = [request(gw.port, "/sample", {"x-device-id": "device-b"}).status for _ in range(4)]
    record(f"{gw.label}: first denial ends evaluation", f"A /home {first}, A /sample {[r.status for r in denied]}, B /sample {b}")
    assert first == [200] * 5
    assert [r.status for r in denied] == [503] * 4
    assert denied[0].header("x-ratelimit-limit") in (None, "5"), denied[0].headers
    # had A's denied requests charged /sample, B would get fewer than 3
    assert b == [200, 200, 200, 503]


SPELLINGS = ["/sample", "//sample", "/sample/./x", "/x/../sample", "/%73ample", "/sample?q=1", "/sample/", "/sample/x"]
PATHS = """\
resources:
  - Url: /
    rules:
      - {name: root, actor: all, algo: TB, unit: hour, rpu: 100000}
  - Url: /sample
    rules:
      - {name: sample_dev, actor: device, algo: TB, unit: hour, rpu: 1}
"""


def test_every_spelling_is_charged_to_sample(start_gateway):
    gw = start_gateway(PATHS)
    results = {}
    for i, spelling in enumerate(SPELLINGS):
        dev = {"x-device-id": f"spelling-{i}"}
        with KeepAlive(gw.port) as ka:
            first = ka.send(spelling, dev)
            canonical = ka.send("/sample", dev)
        results[spelling] = (first.status, canonical.status)
    record(f"{gw.label}: path spellings (first, then canonical /sample)", results)
    for spelling, (first, canonical) in results.items():
        assert first == 200, (spelling, results)
        assert canonical == 503, f"{spelling!r} was not charged to /sample: {results}"


@pytest.mark.parametrize("other", ["/samples", "/sampl", "/x/sample", "/sample.json"])
def test_prefix_matches_on_segment_boundaries_only(start_gateway, other):
    gw = start_gateway(PATHS)
    dev = {"x-device-id": "boundary"}
    statuses_seen = [request(gw.port, other, dev).status for _ in range(3)]
    after = request(gw.port, "/sample", dev).status
    assert statuses_seen == [200, 200, 200], statuses_seen
    assert after == 200, f"{other!r} was charged to /sample"
