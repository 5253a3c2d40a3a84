"""Docs that cannot drift (issue 22, item 6): the shell examples of README.md and of the kit
READMEs run here, against the gateway they describe, and print what the docs say.

Convention, in the Markdown:

- A fenced `sh` block preceded by the line `<!-- doc-test: NAME -->` is *checked*: this
  file runs it with bash (`-e`: a command that fails fails the test) and compares output.
- In a checked block, a line `# A B C` right under a command is that command's output:
  the whitespace-separated words before a run of two spaces (what follows is commentary),
  compared with the words the command printed (`200\\n200\\n503` matches `# 200 200 503`).
- The documented ports (10000, 9901, 18080, 18081, 8080, 8081) are replaced by ports
  chosen at run time, so that the test runs beside others.

Every other `sh` block of those files must be listed in NOT_RUN with the reason it cannot
run here; a block that is neither marked nor listed, a listed block that is gone, or a
marked block that disappears fails the test (so a new example is a decision, not an
accident). `envoy/envoy.yaml`'s embedded document must parse to `envoy/demo-diana.yaml`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import yaml

import harness
from harness import (
    QUOTA_TOKEN,
    REPO,
    WASM,
    ManagedProcess,
    Quota,
    Upstream,
    envoy_binary,
    free_port,
    gateway_env,
    http_get,
    scripts_run,
    wait_for_fresh_minute,
)

DOCS = ["README.md", "nginx/README.md", "istio/README.md", "kong/README.md", "docker/README.md"]

# The checked blocks: if one loses its marker or its file, the test fails.
CHECKED = {
    ("README.md", "quickstart"),
    ("README.md", "render-envoy"),
}

# The `sh` blocks not run here, by file and a piece of their first line, with the reason.
NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "scripts/run    #"): "the commands of the suite itself: scripts/run is run by "
    "test_run_script.py (and behind the quickstart block below); scripts/test runs this file",
    ("README.md", "scripts/check                                  #"): "the test commands themselves "
    "(scripts/check, scripts/e2e), which scripts/test runs",
    ("README.md", "scripts/build                                   #"): "envoy/envoy.yaml on its "
    "fixed ports; test_envoy_yaml_answers_as_the_readme_says runs that bootstrap with the demo "
    "upstream and diana-quota, on ports of its own, and the quickstart block against it",
    ("README.md", "openssl rand -hex 32 > /etc/diana/quota.token"): "a deployment: writes under "
    "/etc and needs a Redis host named `redis`",
    ("README.md", "diana-quota --redis redis://127.0.0.1:6379 --token-file"): "a deployment of "
    "RLS with files under /etc; the RLS service is tested by test_rls.py and test_rlqs.py",
    ("README.md", "# HMAC-SHA256"): "signs the reader's own diana.yaml with the reader's key; "
    "signed documents are tested by test_remote.py",
    ("README.md", "python3 demo/make_hot_event_log.py"): "rewrites committed files "
    "(demo/hot-event.jsonl, docs/simulate-hot-event.svg); simulate is tested by test_simulate.py",
    ("README.md", "for i in $(seq 300); do curl -s -o /dev/null -H 'x-device-id: device-42'"): "the "
    "result is read in a browser; a flood through real gateways read in the page by headless "
    "Chromium is test_fleet_gateways.py",
    ("README.md", "python3 demo/make_breaker_log.py"): "rewrites committed files "
    "(demo/payments-outage.jsonl, docs/simulate-payments-outage.svg); simulate through the "
    "breakers is tested by crates/diana-cli/tests/simulate.rs, which checks the report's "
    "breakers section exactly",
    ("README.md", "diana check envoy/demo-diana.yaml          #"): "a synopsis with placeholders "
    "(POLICY LOG, [--kong]); its render-envoy line is run by the render-envoy block",
    ("nginx/README.md", "scripts/build-nginx"): "builds nginx (scripts/install-deps does, before "
    "the tests) and checks the reader's own my-policy.yaml; nginx runs in test_nginx_*.py",
    ("istio/README.md", "scripts/build                            #"): "pushes images to a "
    "registry (skopeo/oras/crane, docker build/push): no registry or Docker engine here; the "
    "OCI layout of scripts/package-oci is checked by test_istio.py",
    ("istio/README.md", 'TOKEN="$(openssl rand -hex 32)"'): "kubectl against a cluster: none "
    "here; the manifests are checked against Istio's schemas by test_istio_schema.py",
    ("istio/README.md", "sed 's|istio-injection: enabled|"): "kubectl against a cluster: none here",
    ("kong/README.md", "cargo build --release --target wasm32-wasip1 -p diana"): "installs into "
    "/opt/diana for a Kong that is not installed here (Kong 3.4-3.10); the schema is checked "
    "by test_istio.py's Kong test",
    ("kong/README.md", "curl -sX POST localhost:8001/routes"): "Kong's Admin API: no Kong here",
    ("docker/README.md", "docker compose up --build"): "no Docker engine here; scripts/compose-test "
    "runs the same docker-compose.yml with podman and the same requests",
}

# Documented port -> the name of the run-time port that replaces it.
PORT_NAMES = {
    "10000": "gateway",
    "9901": "admin",
    "18080": "upstream",
    "18081": "quota",
    "8080": "upstream",
    "8081": "quota",
}

MARKER = re.compile(r"^\s*<!-- doc-test: ([a-z0-9-]+) -->\s*$")
FENCE_OPEN = re.compile(r"^(\s*)```sh\s*$")


@dataclass
class Block:
    file: str
    line: int  # of the opening fence, from 1
    name: Optional[str]  # the doc-test marker's name, if any
    text: str


def blocks_of(file: str) -> list[Block]:
    lines = (REPO / file).read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opened = FENCE_OPEN.match(lines[i])
        if not opened:
            i += 1
            continue
        indent = opened.group(1)
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        found.append(Block(file, i + 1, marker.group(1) if marker else None, "\n".join(body) + "\n"))
        i = j + 1
    return found


def checked_block(file: str, name: str) -> Block:
    matches = [b for b in blocks_of(file) if b.name == name]
    assert len(matches) == 1, f"{file}: {len(matches)} `sh` blocks marked `<!-- doc-test: {name} -->`, expected 1"
    return matches[0]


# --------------------------------------------------------------------------- the inventory


def test_every_shell_block_is_checked_or_says_why_not():
    seen_checked = set()
    used_reasons = set()
    undecided = []
    for file in DOCS:
        for block in blocks_of(file):
            if block.name is not None:
                assert (file, block.name) in CHECKED, f"{file}:{block.line}: marker `{block.name}` unknown to test_docs.py"
                seen_checked.add((file, block.name))
                continue
            first = block.text.splitlines()[0] if block.text.strip() else ""
            keys = [key for key in NOT_RUN if key[0] == file and first.startswith(key[1])]
            if len(keys) != 1:
                undecided.append(f"{file}:{block.line}: {first!r}")
            else:
                used_reasons.add(keys[0])
    assert not undecided, (
        "`sh` blocks neither checked (<!-- doc-test: NAME --> above the fence, and a test here) "
        "nor listed in test_docs.NOT_RUN with the reason they cannot run:\n  " + "\n  ".join(undecided)
    )
    assert CHECKED <= seen_checked, f"checked blocks gone from the docs: {sorted(CHECKED - seen_checked)}"
    stale = set(NOT_RUN) - used_reasons
    assert not stale, f"NOT_RUN entries whose block is gone: {sorted(stale)}"


def test_envoy_yaml_embeds_the_demo_document():
    """envoy/envoy.yaml carries the Diana document as a string; it must be the one
    scripts/run loads (issue 22: it lacked `sample_global` and `/llm`)."""
    bootstrap = yaml.safe_load((REPO / "envoy/envoy.yaml").read_text())
    wasm_filters = [
        f
        for listener in bootstrap["static_resources"]["listeners"]
        for chain in listener["filter_chains"]
        for network in chain["filters"]
        for f in network["typed_config"].get("http_filters", [])
        if f["name"] == "envoy.filters.http.wasm"
    ]
    assert len(wasm_filters) == 1, wasm_filters
    embedded = wasm_filters[0]["typed_config"]["config"]["configuration"]["value"]
    demo = yaml.safe_load((REPO / "envoy/demo-diana.yaml").read_text())
    assert yaml.safe_load(embedded) == demo


def test_expected_output_lines_are_parsed_as_documented():
    """The convention itself: a `# ...` line under a command is its output, up to two spaces."""
    steps = steps_of("echo a\nfor i in 1 2; do echo $i; done\n# 1 2   (two lines)\necho b\n")
    assert [(s.command.strip(), s.expected) for s in steps] == [
        ("echo a", None),
        ("for i in 1 2; do echo $i; done", ["1", "2"]),
        ("echo b", None),
    ]


# --------------------------------------------------------------------------- running a block


@dataclass
class Step:
    command: str  # one logical command line (continuations joined with their newlines)
    expected: Optional[list[str]]  # the words the docs show it printing, if they show any


def steps_of(text: str) -> list[Step]:
    steps: list[Step] = []
    pending = ""
    for line in text.splitlines():
        if pending:
            pending += line + "\n"
            if not line.endswith("\\"):
                steps.append(Step(pending, None))
                pending = ""
            continue
        if line.startswith("# ") and steps and steps[-1].expected is None and steps[-1].command.strip():
            shown = re.split(r"\s{2,}", line[2:].strip())[0]
            steps[-1].expected = shown.split()
            continue
        if line.endswith("\\"):
            pending = line + "\n"
            continue
        steps.append(Step(line + "\n", None))
    assert not pending, f"unfinished continuation: {pending!r}"
    return steps


def substitute_ports(text: str, ports: dict[str, int]) -> str:
    def replace(match: re.Match) -> str:
        return str(ports[PORT_NAMES[match.group(0)]])

    return re.sub(r"(?<![0-9])(" + "|".join(PORT_NAMES) + r")(?![0-9])", replace, text)


def script_of(steps: list[Step]) -> str:
    """The block as one bash script, each command with an expected output between markers."""
    out = []
    for index, step in enumerate(steps):
        if step.expected is None:
            out.append(step.command)
        else:
            out.append(f"echo '@@doc-test {index} start@@'\n{step.command}echo '@@doc-test {index} end@@'\n")
    return "".join(out)


def tool_dir(into: Path) -> Path:
    """`envoy` and `diana` as the docs call them: the suite's Envoy (with
    --disable-hot-restart, so that it runs beside the other tests' Envoys) and the built
    `diana`."""
    bin_dir = into / "bin"
    bin_dir.mkdir()
    (bin_dir / "envoy").write_text(f'#!/bin/sh\nexec {envoy_binary()} --disable-hot-restart "$@"\n')
    (bin_dir / "diana").write_text(f'#!/bin/sh\nexec {harness.DIANA_BIN} "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def run_block(block: Block, ports: dict[str, int], log_dir: Path, timeout: float = 180.0) -> None:
    """Runs the block (ports substituted) with bash -e in a scratch directory that sees the
    repository's `envoy/`, `demo/` and the build under test as `target/release`
    (harness.documented_tree), then compares each shown output. The
    block's background jobs are in bash's process group, stopped by its id at the end."""
    steps = steps_of(substitute_ports(block.text, ports))
    assert any(step.expected for step in steps), f"{block.file}:{block.line}: a checked block shows no output"
    work = harness.documented_tree(Path(tempfile.mkdtemp(prefix=f"doc-{block.name}-", dir=log_dir)))
    bin_dir = tool_dir(work)
    script = work / "block.sh"
    script.write_text(script_of(steps))
    output = work / "output.txt"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '')}")
    env.pop(harness.TOKEN_ENV, None)
    with open(output, "wb") as sink:
        proc = subprocess.Popen(
            ["bash", "-e", str(script)],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its process group holds the block's background jobs
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # whatever the block left running
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.wait(timeout=10)
    text = output.read_text(errors="replace")
    where = f"{block.file}:{block.line} (`{block.name}`), run in {work}"
    assert code == 0, f"{where}: bash exited with {code}:\n{text}"
    for index, step in enumerate(steps):
        if step.expected is None:
            continue
        found = re.search(rf"@@doc-test {index} start@@\n(.*?)@@doc-test {index} end@@", text, re.S)
        assert found, f"{where}: no output for {step.command!r}:\n{text}"
        printed = found.group(1).split()
        assert printed == step.expected, (
            f"{where}: {step.command.strip()!r} printed {' '.join(printed)!r}, "
            f"the docs show {' '.join(step.expected)!r}"
        )


# --------------------------------------------------------------------------- the checked blocks


def test_readme_quickstart_against_scripts_run(log_dir):
    """The README's first requests, against `scripts/run` as the README starts it."""
    ports = {"gateway": free_port(), "admin": free_port(), "upstream": free_port(), "quota": free_port()}
    assert len(set(ports.values())) == 4
    env = {
        "DIANA_PORT": str(ports["gateway"]),
        "DIANA_ADMIN_PORT": str(ports["admin"]),
        "DIANA_UPSTREAM_PORT": str(ports["upstream"]),
        "DIANA_QUOTA_PORT": str(ports["quota"]),
        "DIANA_RUN_FOR": "300",
    }
    with scripts_run(log_dir, env):
        wait_for_fresh_minute(10)  # /sample's rule is a fixed window on the epoch minute
        run_block(checked_block("README.md", "quickstart"), ports, log_dir)


def test_envoy_yaml_answers_as_the_readme_says(procs, log_dir):
    """envoy/envoy.yaml as the README's "Deploying in Envoy" runs it (the demo upstream and
    diana-quota beside it), on ports of its own: the quickstart's requests answer the same,
    and its global rule is decided by diana-quota."""
    assert WASM.is_file(), f"{WASM} missing: run scripts/build"
    ports = {"gateway": free_port(), "admin": free_port(), "upstream": free_port(), "quota": free_port()}
    config_port = free_port()
    assert len(set(ports.values()) | {config_port}) == 5
    text = (REPO / "envoy/envoy.yaml").read_text()
    for documented, port in (
        ("10000", ports["gateway"]),
        ("9901", ports["admin"]),
        ("18080", ports["upstream"]),
        ("18081", ports["quota"]),
        ("18082", config_port),
    ):
        text, count = re.subn(rf"port_value: {documented}\b", f"port_value: {port}", text)
        assert count == 1, f"envoy/envoy.yaml: `port_value: {documented}` found {count} times"
    bootstrap = log_dir / "envoy.yaml"
    bootstrap.write_text(text)
    procs.add(Upstream(log_dir, port=ports["upstream"]).start())
    procs.add(Quota(log_dir, port=ports["quota"], tokens=(QUOTA_TOKEN,)).start())
    envoy = procs.add(
        ManagedProcess(
            "envoy",
            [envoy_binary(), "-c", bootstrap, "--concurrency", "2", "--disable-hot-restart"],
            log_dir / "envoy.log",
            env=gateway_env(QUOTA_TOKEN),
            # the wasm path in envoy.yaml is relative to the repository root: a tree where
            # it is the module under test
            cwd=harness.documented_tree(log_dir / "tree"),
        ).start()
    )
    envoy.wait_ready(lambda: http_get(ports["admin"], "/ready", timeout=1.0)[0] == 200, 90, "ready")
    wait_for_fresh_minute(10)
    run_block(checked_block("README.md", "quickstart"), ports, log_dir)
    time.sleep(harness.METRICS_LAG_S)
    _, body, _ = http_get(ports["admin"], "/stats?filter=diana_global")
    stats = dict(line.rsplit(": ", 1) for line in body.decode().splitlines() if ": " in line)
    assert int(stats["wasmcustom.diana_global_callouts"]) >= 5, stats
    assert int(stats["wasmcustom.diana_global_errors"]) == 0, stats


def test_readme_render_envoy_runs_a_gateway(log_dir):
    """The README's `diana render-envoy` example, with what else must run beside it."""
    assert harness.DIANA_BIN.is_file(), f"{harness.DIANA_BIN} missing: run scripts/build"
    ports = {"gateway": free_port(), "admin": free_port(), "upstream": free_port(), "quota": free_port()}
    assert len(set(ports.values())) == 4
    run_block(checked_block("README.md", "render-envoy"), ports, log_dir)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v"]))
