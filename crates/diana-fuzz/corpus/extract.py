#!/usr/bin/env python3
"""Rebuilds corpus/config/ from the repository: every Diana document written in a test
(Rust string literals that are not format! templates), in the README and docs (yaml/json
code blocks), and in the fixture and host configuration files. Run from the repo root:
    python3 crates/diana-fuzz/corpus/extract.py
The fuzzer mutates these documents; which ones parse does not matter (errors are inputs
too), only that together they cover every form and section of the document."""
import hashlib, json, pathlib, re, sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
OUT = ROOT / "crates/diana-fuzz/corpus/config"
KEYWORDS = ("rpu", "Url", "resources", "rules", "actors", "response", "metrics")

def rust_literals(text):
    """(offset, value) of every "..." and r#"..."# literal."""
    i = 0
    while i < len(text):
        m = re.compile(r'r(#*)"|"').search(text, i)
        if not m:
            return
        start = m.start()
        if m.group(0).startswith("r"):
            hashes = m.group(1)
            end = text.find('"' + hashes, m.end())
            if end < 0:
                return
            yield start, text[m.end():end]
            i = end + 1 + len(hashes)
            continue
        # a char literal like '"' is not a string start
        if start > 0 and text[start - 1] == "'" and text[start + 1:start + 2] == "'":
            i = start + 2
            continue
        j = m.end()
        buf = []
        while j < len(text) and text[j] != '"':
            if text[j] == "\\":
                nxt = text[j + 1]
                if nxt == "\n":
                    j += 2
                    while j < len(text) and text[j] in " \t\n":
                        j += 1
                    continue
                esc = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", '"': '"', "'": "'"}
                if nxt in esc:
                    buf.append(esc[nxt]); j += 2; continue
                if nxt == "x":
                    buf.append(chr(int(text[j + 2:j + 4], 16))); j += 4; continue
                if nxt == "u":
                    close = text.index("}", j)
                    buf.append(chr(int(text[j + 3:close], 16))); j = close + 1; continue
                buf.append(nxt); j += 2; continue
            buf.append(text[j]); j += 1
        yield start, "".join(buf)
        i = j + 1

def from_rust(path):
    text = path.read_text()
    for start, value in rust_literals(text):
        before = text[max(0, start - 40):start]
        if re.search(r"format!\(\s*$", before):
            continue
        if any(k in value for k in KEYWORDS) and ("\n" in value or value.lstrip().startswith(("{", "["))):
            yield value

def from_markdown(path):
    for m in re.finditer(r"```(yaml|json)\n(.*?)```", path.read_text(), re.S):
        if any(k in m.group(2) for k in KEYWORDS):
            yield m.group(2)

def main():
    docs = []
    for path in sorted(ROOT.glob("crates/*/src/**/*.rs")) + sorted(ROOT.glob("src/**/*.rs")) + sorted(ROOT.glob("crates/*/tests/*.rs")):
        docs += list(from_rust(path))
    for path in sorted(ROOT.glob("*.md")) + sorted(ROOT.glob("docs/*.md")) + sorted(ROOT.glob("*/README.md")):
        docs += list(from_markdown(path))
    for name in ["tests/fixtures/seed.yaml", "nginx/diana.json"]:
        docs.append((ROOT / name).read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        old.unlink()
    seen = set()
    for doc in docs:
        digest = hashlib.sha256(doc.encode()).hexdigest()[:16]
        if digest in seen:
            continue
        seen.add(digest)
        ext = "json" if doc.lstrip().startswith(("{", "[")) else "yaml"
        (OUT / f"{digest}.{ext}").write_text(doc)
    print(f"{len(seen)} documents in {OUT.relative_to(ROOT)}", file=sys.stderr)

main()
