"""Gateway packaging: the Istio WasmPlugin (its pluginConfig as the JSON string Istio hands
the filter, run in a real Envoy), the OCI image layout from scripts/package-oci, and the
Kong filter metadata (kong/diana.meta.json: a JSON Schema of the Diana document).

Python packages from tests/e2e/requirements-extra.txt (installed by scripts/install-deps):
PyYAML to compare istio/pluginconfig.json with the manifest, jsonschema for the Kong schema
tests. A missing one fails those tests."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import harness
from harness import REPO, WASM, record, request, rule_metric, send_concurrent, statuses

PACKAGE_OCI = REPO / "scripts/package-oci"
MANIFEST = REPO / "istio/wasmplugin.yaml"
PLUGIN_CONFIG = REPO / "istio/pluginconfig.json"
KONG_META = REPO / "kong/diana.meta.json"

# Smallest valid WebAssembly module (magic + version): used when diana.wasm is not built.
EMPTY_MODULE = b"\x00asm\x01\x00\x00\x00"


# --------------------------------------------------------------------------- Istio config


def istio_json(value: object) -> str:
    """The configuration string Istio gives the filter for a WasmPlugin's pluginConfig.

    pluginConfig is a google.protobuf.Struct: every number is a double, and Istio renders
    the Struct as JSON (protojson), which prints integral doubles without a fraction
    (`5`, not `5.0`). Reproduce that, so the filter sees what it sees under Istio."""

    def struct(v: object) -> object:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, (int, float)):
            d = float(v)  # Struct number_value
            return int(d) if d.is_integer() else d
        if isinstance(v, list):
            return [struct(x) for x in v]
        if isinstance(v, dict):
            return {str(k): struct(x) for k, x in v.items()}
        raise TypeError(f"not representable in a protobuf Struct: {v!r}")

    return json.dumps(struct(value), separators=(",", ":"), ensure_ascii=False)


def plugin_config() -> dict:
    return json.loads(PLUGIN_CONFIG.read_text(encoding="utf-8"))


def test_pluginconfig_json_matches_the_wasmplugin_manifest():
    import yaml  # scripts/install-deps installs it (tests/e2e/requirements-extra.txt)
    manifest = yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))
    assert manifest["apiVersion"] == "extensions.istio.io/v1alpha1"
    assert manifest["kind"] == "WasmPlugin"
    spec = manifest["spec"]
    assert spec["phase"] == "AUTHN"
    assert spec["url"].startswith("oci://") and spec["url"].endswith("/diana:0.1.0"), spec["url"]
    assert isinstance(spec["pluginConfig"], dict), "pluginConfig must be a YAML object (a Struct), not a string"
    assert spec["pluginConfig"] == plugin_config(), "istio/pluginconfig.json is stale"


def test_istio_plugin_config_limits_exactly_in_envoy(start_envoy):
    """Envoy (4 workers) with the filter configured by the JSON string Istio would produce:
    /sample allows exactly 5 per minute across all workers, then 503. The seed's global
    rule points at an Istio cluster name that this Envoy does not have: it degrades to
    local enforcement, and no request fails because of it."""
    config = istio_json(plugin_config())
    assert '"rpu":5,' in config and ".0" not in config, config
    envoy = start_envoy(config, concurrency=4)

    # 8 requests at once on 8 connections (spread over the workers). The `/` rules admit
    # them all (device: 10 per second per client address; all: 50 per second).
    # Each request carries its own x-device-id, so the seed's per-device rule never decides.
    first = send_concurrent(envoy.port, 8, "/sample/item", lambda i: {"x-device-id": f"istio-{i}"})
    assert statuses(first) == {200: 5, 503: 3}, [(r.status, r.error) for r in first]
    limited = [r for r in first if r.status == 503]
    for r in limited:
        assert r.body == b"rate limited\n"
        assert r.header("x-ratelimit-limit") == "5", r.headers
        assert int(r.header("retry-after") or "0") >= 1, r.headers
    # Still limited for this minute, whatever the spelling of the path.
    for n, path in enumerate(("/sample", "//sample/x", "/%73ample")):
        r = request(envoy.port, path, {"x-device-id": f"istio-path-{n}"})
        assert r.status == 503, (path, r)
    # Other paths only meet the `/` rules.
    assert request(envoy.port, "/other", {"x-device-id": "istio-other"}).status == 200

    m = envoy.diana_metrics()
    record("istio pluginConfig: metrics", m)
    assert rule_metric(m, "allowed", "sample_per_minute") == 5, m
    assert rule_metric(m, "limited", "sample_per_minute") == 6, m
    log = envoy.log_text()
    assert "panicked" not in log and "Failed to load" not in log, envoy.log_tail()


# --------------------------------------------------------------------------- OCI layout


def run_package_oci(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PACKAGE_OCI), *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def module_for_packaging(tmp_path: Path) -> Path:
    """diana.wasm when it is built, else the smallest valid module (the layout is the same)."""
    if WASM.is_file():
        return WASM
    p = tmp_path / "empty.wasm"
    p.write_bytes(EMPTY_MODULE)
    return p


def read_blob(layout: Path, descriptor: dict) -> bytes:
    """A blob named by a descriptor; checks that it exists and has that digest and size."""
    algo, _, hexdigest = descriptor["digest"].partition(":")
    assert algo == "sha256", descriptor
    path = layout / "blobs" / "sha256" / hexdigest
    assert path.is_file(), f"missing blob {path}"
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == hexdigest, f"digest mismatch for {path}"
    assert len(data) == descriptor["size"], f"size mismatch for {path}: {len(data)} != {descriptor['size']}"
    return data


def open_layout(layout: Path, tag: str) -> dict:
    """oci-layout + index.json -> the manifest tagged `tag` (every blob checked)."""
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((layout / "index.json").read_text())
    assert index["schemaVersion"] == 2
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    tagged = [d for d in index["manifests"] if d.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag]
    assert len(tagged) == 1, index
    assert tagged[0]["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    manifest = json.loads(read_blob(layout, tagged[0]))
    assert manifest["schemaVersion"] == 2
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    # Every blob in the directory is referenced: nothing stale.
    referenced = {tagged[0]["digest"], manifest["config"]["digest"], *(l["digest"] for l in manifest["layers"])}
    on_disk = {"sha256:" + p.name for p in (layout / "blobs" / "sha256").iterdir()}
    assert on_disk == referenced, (on_disk, referenced)
    return manifest


def test_package_oci_compat_layout(tmp_path):
    wasm = module_for_packaging(tmp_path)
    out = tmp_path / "oci"
    res = run_package_oci("--wasm", str(wasm), "--out", str(out), "--tag", "0.1.0")
    assert res.returncode == 0, res.stderr
    assert f"skopeo copy oci:{out}:0.1.0 docker://" in res.stdout, res.stdout
    assert "oras cp --from-oci-layout" in res.stdout

    manifest = open_layout(out, "0.1.0")
    assert manifest["annotations"]["module.wasm.image/variant"] == "compat"
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    config = json.loads(read_blob(out, manifest["config"]))
    assert (config["architecture"], config["os"]) == ("wasm", "wasip1")
    assert len(manifest["layers"]) == 1
    layer = manifest["layers"][0]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    # As Istio's fetcher reads it: the last layer, gunzip, untar, plugin.wasm.
    tar_bytes = gzip.decompress(read_blob(out, layer))
    assert config["rootfs"] == {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar_bytes).hexdigest()]}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        names = tar.getnames()
        assert names == ["plugin.wasm"], names
        member = tar.extractfile("plugin.wasm")
        assert member is not None and member.read() == wasm.read_bytes()

    # Reproducible: a second run writes the same bytes.
    again = tmp_path / "oci2"
    assert run_package_oci("--wasm", str(wasm), "--out", str(again), "--tag", "0.1.0").returncode == 0
    assert (again / "index.json").read_bytes() == (out / "index.json").read_bytes()
    # Re-running into the same directory replaces the layout (no stale blobs).
    assert run_package_oci("--wasm", str(wasm), "--out", str(out), "--tag", "0.1.0").returncode == 0
    open_layout(out, "0.1.0")


def test_package_oci_oci_variant_layout(tmp_path):
    wasm = module_for_packaging(tmp_path)
    out = tmp_path / "oci"
    res = run_package_oci("--wasm", str(wasm), "--out", str(out), "--tag", "0.1.0", "--variant", "oci")
    assert res.returncode == 0, res.stderr
    manifest = open_layout(out, "0.1.0")
    assert manifest["config"]["mediaType"] == "application/vnd.module.wasm.config.v1+json"
    # Istio's fetcher: exactly two layers, one of them the raw module.
    types = [l["mediaType"] for l in manifest["layers"]]
    assert types == ["application/vnd.module.wasm.config.v1+json", "application/vnd.module.wasm.content.layer.v1+wasm"]
    assert read_blob(out, manifest["layers"][1]) == wasm.read_bytes()
    assert json.loads(read_blob(out, manifest["layers"][0]))["type"] == "envoy_proxy"


def test_package_oci_refuses_bad_input(tmp_path):
    not_wasm = tmp_path / "x.wasm"
    not_wasm.write_bytes(b"hello")
    res = run_package_oci("--wasm", str(not_wasm), "--out", str(tmp_path / "o"))
    assert res.returncode != 0 and "not a WebAssembly module" in res.stderr, res.stderr
    other = tmp_path / "precious"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    wasm = module_for_packaging(tmp_path)
    res = run_package_oci("--wasm", str(wasm), "--out", str(other))
    assert res.returncode != 0 and "refusing to overwrite" in res.stderr, res.stderr
    assert (other / "keep.txt").read_text() == "mine"
    res = run_package_oci("--wasm", str(tmp_path / "missing.wasm"))
    assert res.returncode == 1 and "build it first" in res.stderr


# --------------------------------------------------------------------------- Kong schema


SEED = {
    "Url": "/",
    "rules": [
        {"actor": "device", "unit": "second", "rpu": 10, "algo": "TB", "scope": "global"},
        {"actor": "all", "unit": "second", "rpu": 50, "algo": "W", "scope": "local"},
    ],
}

FULL = {
    "resources": [
        {"Url": "/", "rules": [{"name": "site", "rpu": 100, "burst": 200}]},
        {
            "url": "/sample",
            "rules": [
                {"actor": "tenant", "rpu": 5, "unit": "minutes", "algo": "sliding window", "slices": 6},
                {"actor": "account", "rpu": 2, "algo": "Leaky Bucket", "scope": "Global", "lease": 4, "dry_run": True},
                {"actor": "ip", "rpu": 1, "unit": "day", "algo": "w", "slots": 1024},
            ],
        },
    ],
    "actors": {
        "account": {"header": "x-account-id", "fallback": "skip"},
        "device": {"fallback": "shared"},
        "tenant": {"header": "X-Tenant-Id", "fallback": "IP"},
    },
    "response": {"status": 429, "body": "slow down\n", "headers": "all"},
    "global": {
        "cluster": "diana-quota.kong:8081",
        "authority": "diana-quota",
        "path": "/v1/acquire",
        "timeout_ms": 50,
        "lease": 1,
        "retry_seconds": 5,
    },
    "remote": {"cluster": "config.kong:80", "authority": "config", "path": "/diana.json", "poll_seconds": 10},
    "dry_run": False,
}

# (document, what is wrong) — each refused by the schema and by the filter.
# The secrets of the full form: the value, or where the gateway's environment holds it.
SECRETS = {
    "resources": [{"Url": "/", "rules": [{"rpu": 5, "scope": "global"}]}],
    "global": {"token": "t" * 40},
    "identity_key": "k" * 40,
}

BAD = [
    ({**SECRETS, "global": {"token": "short"}}, "a global.token shorter than 32 bytes"),
    ({"Url": "/", "rules": [{"rpu": 0}]}, "rpu 0"),
    ({"Url": "/", "rules": [{"rpu": 5, "colour": "red"}]}, "unknown rule key"),
    ({"Url": "/", "rules": [{"rpu": 5, "algo": "fastest"}]}, "unknown algorithm"),
    ({"Url": "/", "rules": [{"rpu": 5, "unit": "fortnight"}]}, "unknown unit"),
    ({"Url": "/", "rules": [{"rpu": 5, "scope": "planet"}]}, "unknown scope"),
    ({"Url": "/", "rules": [{"rpu": 5, "slices": 61}]}, "slices > 60"),
    ({"Url": "sample", "rules": [{"rpu": 5}]}, "Url without /"),
    ({"rules": [{"rpu": 5}]}, "no Url"),
    ({"resources": [SEED], "response": {"status": 200, "headers": "some"}}, "bad headers mode"),
    ({"resources": [SEED], "actors": {"all": {"header": "x"}}}, "redefines a reserved actor"),
    ({"resources": [SEED], "actors": {"tenant": {"fallback": "skip"}}}, "user actor without source"),
    ({"resources": [SEED], "remote": {"cluster": "c"}}, "remote without path"),
    ({"resources": [SEED], "global": {"path": "v1/acquire"}}, "global.path without /"),
    ({"resources": [SEED], "extra": 1}, "unknown section"),
]


def kong_validator():
    import jsonschema  # scripts/install-deps installs it
    meta = json.loads(KONG_META.read_text(encoding="utf-8"))
    assert set(meta) == {"config_schema"}, "Kong filter metadata holds config_schema"
    schema = meta["config_schema"]
    assert schema["$schema"] == "http://json-schema.org/draft-04/schema#", "Kong validates with draft 4"
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def diana_cli() -> Path:
    """The `diana` CLI that scripts/build made (harness.DIANA_BIN), the same build as the
    filter's: the same parser as diana.wasm."""
    assert harness.DIANA_BIN.is_file(), f"{harness.DIANA_BIN} missing: run scripts/build"
    return harness.DIANA_BIN


def diana_check(document: object) -> subprocess.CompletedProcess:
    """The filter's own verdict, through the `diana` CLI (same parser as diana.wasm)."""
    return subprocess.run(
        [str(diana_cli()), "check", "-"], input=json.dumps(document), capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "name,document",
    [("seed", SEED), ("full", FULL), ("list", [SEED, {**SEED, "Url": "/x"}]), ("secrets", SECRETS)],
)
def test_kong_schema_accepts_valid_documents(name, document):
    validator = kong_validator()
    problems = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(document)]
    assert not problems, problems
    verdict = diana_check(document)
    assert verdict.returncode == 0, f"the filter refuses the {name} document: {verdict.stderr}"


@pytest.mark.parametrize("document,why", BAD, ids=[why for _, why in BAD])
def test_kong_schema_refuses_what_the_filter_refuses(document, why):
    validator = kong_validator()
    assert not validator.is_valid(document), f"schema accepts a document with {why}"
    verdict = diana_check(document)
    assert verdict.returncode == 1, f"the filter accepts a document with {why}"
