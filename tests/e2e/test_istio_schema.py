"""The Istio kit (istio/) against Istio's own CRD schemas, and as a mesh operator meets it.

No cluster: every object istio/README.md has the operator apply is read from the manifests,
and each Istio object (WasmPlugin, ServiceEntry) is validated against the CRD's
`openAPIV3Schema` of each Istio release kept in istio/schemas/ (1.19.0, the stated floor,
and 1.30.3; 1.18.0's WasmPlugin to show the floor is real), the way the API server does
with strict field validation (kubectl's default):

- a field the schema does not declare is refused, unless the node has
  `x-kubernetes-preserve-unknown-fields` (pluginConfig);
- `x-kubernetes-int-or-string`, `nullable`, `x-kubernetes-list-type` (set, map with its
  `x-kubernetes-list-map-keys`) are honoured;
- `x-kubernetes-validations` (CEL, Istio >= 1.22) cannot be evaluated without a CEL engine:
  each rule an object reaches must be one of the rules below, translated into Python by
  hand; a rule the test does not know fails the test instead of passing silently. Any other
  `x-kubernetes-*` extension, or a schema keyword the converter does not know, fails too.

Kubernetes core objects (Namespace, Service, Deployment, NetworkPolicy) get a structural
check only, not Kubernetes' OpenAPI schema: a known apiVersion/kind, metadata.name (a DNS
name), a namespace where the kind is namespaced, valid labels; plus the wiring the kit
depends on (selectors, ports, Secrets, the Redis URL, probes, Istio port names).

The operator-facing checks: the version floor stated in istio/README.md (and the manifests'
comments) is the release where every field used exists (failStrategy: 1.19); examples
(istio/examples/) are validated but not applied; the namespace is labelled for sidecar
injection, and the README's substitution for revision-based installs (`istio.io/rev`)
gives a valid namespace; every Secret the applied objects read is created by the README;
the WasmPlugin's global.cluster is a Service of the applied set whose pods count in a Redis
of the applied set.

Python packages: PyYAML and jsonschema (tests/e2e/requirements-extra.txt)."""

from __future__ import annotations

import copy
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest

from harness import REPO, record

import jsonschema
import yaml
from jsonschema import Draft7Validator, FormatChecker, ValidationError

ISTIO = REPO / "istio"
README = ISTIO / "README.md"
SCHEMAS = ISTIO / "schemas"
EXAMPLES = ISTIO / "examples"

# Istio kinds, by API group, and whether their objects can be exported to other namespaces.
ISTIO_GROUPS = {"extensions.istio.io", "networking.istio.io", "security.istio.io", "telemetry.istio.io"}
EXPORTABLE = {"ServiceEntry", "DestinationRule", "VirtualService"}
# Istio's root namespace: what is there (and exported) applies to the whole mesh.
ROOT_NAMESPACE = "istio-system"

# The Kubernetes kinds the kit may use (structural check only), and whether namespaced.
CORE_KINDS = {
    ("v1", "Namespace"): False,
    ("v1", "Service"): True,
    ("v1", "Secret"): True,
    ("v1", "ConfigMap"): True,
    ("apps/v1", "Deployment"): True,
    ("networking.k8s.io/v1", "NetworkPolicy"): True,
}

# The Istio release where each WasmPlugin spec field appeared (istio/api's
# kubernetes/customresourcedefinitions.gen.yaml on release branches 1.12 to 1.30).
WASMPLUGIN_FIELD_SINCE = {
    "selector": (1, 12), "url": (1, 12), "sha256": (1, 12), "imagePullPolicy": (1, 12),
    "imagePullSecret": (1, 12), "pluginConfig": (1, 12), "pluginName": (1, 12),
    "phase": (1, 12), "priority": (1, 12), "verificationKey": (1, 12),
    "vmConfig": (1, 14), "match": (1, 16), "failStrategy": (1, 19),
    "type": (1, 20), "targetRef": (1, 20), "targetRefs": (1, 22),
}


# --------------------------------------------------------------------------- CEL rules

def _url_scheme_ok(url: str) -> bool:
    # isURL(self) ? url(self).getScheme() in [...] : url("http://" + self).getScheme() in [...]
    # Exact for "scheme://…" and for scheme-less references (which get "http").
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", url)
    scheme = m.group(1).lower() if m else "http"
    return scheme in ("", "http", "https", "oci", "file")


def _count(items: list, pred: Callable[[object], bool]) -> int:
    return sum(1 for x in items if pred(x))


# Every CEL rule of the stored schemas that the kit's objects or this test's negative cases
# reach, as a Python predicate on `self`. Compared as exact strings.
CEL_RULES: dict[str, Callable[[object], bool]] = {
    # WasmPlugin
    '(has(self.selector) ? 1 : 0) + (has(self.targetRef) ? 1 : 0) + (has(self.targetRefs) ? 1 : 0) <= 1':
        lambda s: _count(["selector", "targetRef", "targetRefs"], lambda k: k in s) <= 1,
    'self.all(key, !key.contains("*"))': lambda s: all("*" not in k for k in s),
    'self.all(key, key.size() != 0)': lambda s: all(len(k) != 0 for k in s),
    '!self.contains("*")': lambda s: "*" not in s,
    'self.size() == 0': lambda s: len(s) == 0,
    'isURL(self) ? (url(self).getScheme() in ["", "http", "https", "oci", "file"]) : (isURL("http://" + self) &&\n'
    'url("http://" + self).getScheme() in ["", "http", "https", "oci", "file"])': _url_scheme_ok,
    '(has(self.valueFrom) ? self.valueFrom : "") != "HOST" || !has(self.value)':
        lambda s: s.get("valueFrom", "") != "HOST" or "value" not in s,
    # ServiceEntry
    '(has(self.workloadSelector) ? 1 : 0) + (has(self.endpoints) ? 1 : 0) <= 1':
        lambda s: _count(["workloadSelector", "endpoints"], lambda k: k in s) <= 1,
    '!((has(self.addresses) ? self.addresses : []).exists(k, k.contains("/")) && '
    '!((has(self.resolution) ? self.resolution : "NONE") in ["STATIC", "NONE"]))':
        lambda s: not (any("/" in a for a in s.get("addresses", []))
                       and s.get("resolution", "NONE") not in ("STATIC", "NONE")),
    '((has(self.resolution) ? self.resolution : "NONE") == "NONE") ? !has(self.endpoints) : true':
        lambda s: "endpoints" not in s if s.get("resolution", "NONE") == "NONE" else True,
    '((has(self.resolution) ? self.resolution : "") == "DNS_ROUND_ROBIN") ? '
    '((has(self.endpoints) ? self.endpoints : []).size() <= 1) : true':
        lambda s: len(s.get("endpoints", [])) <= 1 if s.get("resolution", "") == "DNS_ROUND_ROBIN" else True,
    'has(self.address) || has(self.network)': lambda s: "address" in s or "network" in s,
    '(has(self.address) ? self.address : "").startsWith("unix://") ? !has(self.ports) : true':
        lambda s: "ports" not in s if s.get("address", "").startswith("unix://") else True,
    'self.startsWith("unix://") ? (self.substring(7, 8) == "/" || self.substring(7, 8) == "@") : true':
        lambda s: s[7:8] in ("/", "@") if s.startswith("unix://") else True,
    'self.startsWith("unix://") ? !self.endsWith("/") : true':
        lambda s: not s.endswith("/") if s.startswith("unix://") else True,
    'self.all(key, size(key) < 63 && key.matches("^[a-zA-Z0-9](?:[-a-zA-Z0-9]*[a-zA-Z0-9])?$"))':
        lambda s: all(len(k) < 63 and re.search(r"^[a-zA-Z0-9](?:[-a-zA-Z0-9]*[a-zA-Z0-9])?$", k) for k in s),
    '0 < self && self <= 65535': lambda s: 0 < s <= 65535,
    'self != "*"': lambda s: s != "*",
    'self.all(l1, self.exists_one(l2, l1.number == l2.number))':
        lambda s: all(_count(s, lambda l2, l1=l1: l2.get("number") == l1.get("number")) == 1 for l1 in s),
    # The same rules as Istio 1.20-1.24 spelled them (not stored here; for a schema of
    # those releases put in istio/schemas/).
    "isURL(self) ? (url(self).getScheme() in ['', 'http', 'https', 'oci', 'file']) : (isURL('http://' + self) && "
    "url('http://' +self).getScheme() in ['', 'http', 'https', 'oci', 'file'])": _url_scheme_ok,
    "(has(self.valueFrom) ? self.valueFrom : '') != 'HOST' || !has(self.value)":
        lambda s: s.get("valueFrom", "") != "HOST" or "value" not in s,
    "!self.contains('*')": lambda s: "*" not in s,
    "self.all(key, !key.contains('*'))": lambda s: all("*" not in k for k in s),
    "(has(self.selector)?1:0)+(has(self.targetRef)?1:0)+(has(self.targetRefs)?1:0)<=1":
        lambda s: _count(["selector", "targetRef", "targetRefs"], lambda k: k in s) <= 1,
    "self != '*'": lambda s: s != "*",
    "!(has(self.addresses) && self.addresses.exists(k, k.contains('/')) && (has(self.resolution) && "
    "self.resolution != 'STATIC' && self.resolution != 'NONE'))":
        lambda s: not (any("/" in a for a in s.get("addresses", []))
                       and "resolution" in s and s["resolution"] not in ("STATIC", "NONE")),
    "(!has(self.resolution) || self.resolution == 'NONE') ? !has(self.endpoints) : true":
        lambda s: "endpoints" not in s if s.get("resolution", "NONE") == "NONE" else True,
    "(has(self.resolution) && self.resolution == 'DNS_ROUND_ROBIN') ? "
    "(!has(self.endpoints) || size(self.endpoints) == 1) : true":
        lambda s: "endpoints" not in s or len(s["endpoints"]) == 1 if s.get("resolution") == "DNS_ROUND_ROBIN" else True,
    "(has(self.workloadSelector)?1:0)+(has(self.endpoints)?1:0)<=1":
        lambda s: _count(["workloadSelector", "endpoints"], lambda k: k in s) <= 1,
}


# --------------------------------------------------------------------------- the validator

class UnsupportedSchema(Exception):
    """A schema keyword or extension this validator does not implement."""


# Keywords that mean the same in a Kubernetes structural schema and in JSON Schema draft 7.
PLAIN_KEYWORDS = {
    "type", "enum", "required", "minimum", "maximum", "minLength", "maxLength", "pattern",
    "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties", "format",
    "multipleOf",
}
DROPPED_KEYWORDS = {"description", "title", "default", "example", "externalDocs"}
KEPT_EXTENSIONS = {"x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys"}


def to_json_schema(node: dict, structural: bool = True, where: str = "#") -> dict:
    """A Kubernetes structural schema node as JSON Schema (draft 7), as strict as the API
    server with strict field validation. `structural` is false inside anyOf/oneOf/allOf/not
    (value validations: they do not decide which fields exist)."""
    out: dict = {}
    for key, value in node.items():
        at = f"{where}/{key}"
        if key in DROPPED_KEYWORDS:
            continue
        if key in PLAIN_KEYWORDS:
            out[key] = value
        elif key == "properties":
            out[key] = {name: to_json_schema(sub, structural, f"{at}/{name}") for name, sub in value.items()}
        elif key == "items":
            out[key] = to_json_schema(value, structural, at)
        elif key == "additionalProperties":
            out[key] = to_json_schema(value, structural, at) if isinstance(value, dict) else value
        elif key in ("anyOf", "oneOf", "allOf"):
            out[key] = [to_json_schema(sub, False, f"{at}/{i}") for i, sub in enumerate(value)]
        elif key == "not":
            out[key] = to_json_schema(value, False, at)
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            # OpenAPI 3.0: a boolean beside minimum/maximum; draft 7: the bound itself.
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            if value is True:
                out[key] = node[bound]
            elif value is not False:
                raise UnsupportedSchema(f"{at}: {value!r}")
        elif key in KEPT_EXTENSIONS:
            out[key] = value
        elif key in ("nullable", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields"):
            pass  # below
        else:
            raise UnsupportedSchema(f"{at}: keyword not implemented by this validator")
    if "exclusiveMinimum" in out:
        out.pop("minimum", None)
    if "exclusiveMaximum" in out:
        out.pop("maximum", None)
    if node.get("x-kubernetes-int-or-string"):
        if "type" in node:
            raise UnsupportedSchema(f"{where}: x-kubernetes-int-or-string with a type")
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    preserve = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    if structural and node.get("type") == "object" and not preserve and "additionalProperties" not in node:
        # Not declared and not preserved: the API server prunes it, or with strict field
        # validation (kubectl's default) refuses it. Refuse.
        out["additionalProperties"] = False
    return out


def _cel(validator, rules, instance, schema) -> Iterator[ValidationError]:
    types = schema.get("type")
    if types is not None and not any(validator.is_type(instance, t) for t in ([types] if isinstance(types, str) else types)):
        return  # the API server runs CEL only on values of the right type; "type" reports it
    if instance is None:
        return  # a null in a nullable field: no rule runs
    for rule in rules:
        check = CEL_RULES.get(rule["rule"])
        if check is None:
            yield ValidationError(f"CEL rule not implemented by this test (add it to CEL_RULES): {rule['rule']!r}")
            continue
        try:
            ok = check(instance)
        except (AttributeError, KeyError, TypeError) as e:  # CEL: "no such key" and the like
            yield ValidationError(f"{rule.get('message', 'CEL rule')}: cannot be evaluated ({e}) ({rule['rule']!r})")
            continue
        if not ok:
            yield ValidationError(f"{rule.get('message', 'CEL rule failed')} ({rule['rule']!r})")


def _list_type(validator, list_type, instance, schema) -> Iterator[ValidationError]:
    if not isinstance(instance, list) or list_type == "atomic":
        return
    if list_type == "set":
        seen: list = []
        for item in instance:
            if item in seen:
                yield ValidationError(f"duplicate entry in a list of type set: {item!r}")
            seen.append(item)
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen_keys: set = set()
        for item in instance:
            k = tuple(repr(item.get(name)) for name in keys) if isinstance(item, dict) else (repr(item),)
            if k in seen_keys:
                yield ValidationError(f"duplicate entry in a list of type map (keys {keys}): {k}")
            seen_keys.add(k)
    else:
        yield ValidationError(f"x-kubernetes-list-type {list_type!r} not implemented by this test")


FORMATS = FormatChecker(formats=())


@FORMATS.checks("int32")
def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


@FORMATS.checks("uint32")
def _uint32(value: object) -> bool:
    return not isinstance(value, int) or 0 <= value < 2**32


@FORMATS.checks("date-time")
def _date_time(value: object) -> bool:
    return not isinstance(value, str) or bool(
        re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", value)
    )


KubeValidator = jsonschema.validators.extend(
    Draft7Validator,
    validators={"x-kubernetes-validations": _cel, "x-kubernetes-list-type": _list_type},
)


def object_schema(crd_version: dict) -> dict:
    """The JSON Schema of a whole object of this CRD version (metadata checked apart)."""
    schema = to_json_schema(crd_version["schema"]["openAPIV3Schema"])
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"type": "string"}
    props["kind"] = {"type": "string"}
    props["metadata"] = {"type": "object"}
    return schema


def validation_errors(schema: dict, instance: object) -> list[str]:
    validator = KubeValidator(schema, format_checker=FORMATS)
    return sorted(
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in validator.iter_errors(instance)
    )


# --------------------------------------------------------------------------- stored CRDs

@dataclass(frozen=True)
class Release:
    version: tuple[int, int, int]
    path: Path
    crds: dict  # kind -> the CRD document

    @property
    def name(self) -> str:
        return ".".join(map(str, self.version))


def load_releases() -> list[Release]:
    releases = []
    for path in sorted(SCHEMAS.glob("istio-*.yaml")):
        m = re.fullmatch(r"istio-(\d+)\.(\d+)\.(\d+)\.yaml", path.name)
        assert m, f"{path}: name must be istio-X.Y.Z.yaml"
        docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
        assert all(d["kind"] == "CustomResourceDefinition" for d in docs), path
        releases.append(Release(tuple(int(x) for x in m.groups()), path, {d["spec"]["names"]["kind"]: d for d in docs}))
    return sorted(releases, key=lambda r: r.version)


RELEASES = load_releases()


def crd_version(release: Release, obj: dict) -> Optional[dict]:
    """The served CRD version of `obj`'s apiVersion in this release (None: kind not stored)."""
    crd = release.crds.get(obj["kind"])
    if crd is None:
        return None
    group, _, version = obj["apiVersion"].partition("/")
    assert group == crd["spec"]["group"], (obj["apiVersion"], crd["spec"]["group"])
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            assert v.get("served"), f"{obj['apiVersion']} {obj['kind']} is not served by Istio {release.name}"
            return v
    pytest.fail(f"Istio {release.name} has no {obj['apiVersion']} {obj['kind']}")


def validate_istio_object(release: Release, obj: dict) -> Optional[list[str]]:
    """The errors of `obj` against this release's CRD (None when the kind is not stored)."""
    v = crd_version(release, obj)
    if v is None:
        return None
    errors = validation_errors(object_schema(v), obj)
    scope = release.crds[obj["kind"]]["spec"]["scope"]
    if scope == "Namespaced" and not obj.get("metadata", {}).get("namespace"):
        errors.append("metadata.namespace: required for a namespaced kind")
    if v.get("deprecated"):
        errors.append(f"{obj['apiVersion']} is deprecated in Istio {release.name}: {v.get('deprecationWarning')}")
    return errors


# --------------------------------------------------------------------------- the kit

@dataclass
class Doc:
    path: Path
    obj: dict

    @property
    def label(self) -> str:
        m = self.obj.get("metadata", {})
        return f"{self.path.relative_to(REPO)}: {self.obj.get('kind')} {m.get('namespace', '')}/{m.get('name')}"


def load_docs(path: Path, text: Optional[str] = None) -> list[Doc]:
    text = path.read_text(encoding="utf-8") if text is None else text
    return [Doc(path, d) for d in yaml.safe_load_all(text) if d is not None]


def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def shell_commands(markdown: str) -> list[str]:
    """The commands of the ```sh blocks (continuation lines joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", markdown, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


@dataclass(frozen=True)
class Applied:
    path: Path
    sed: Optional[tuple[str, str]]  # a `sed 's|A|B|'` the README pipes the file through
    command: str


def segments(command: str) -> list[list[str]]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    for token in lexer:
        if token in ("|", "&&", ";", "||"):
            out.append([])
        else:
            out[-1].append(token)
    return [s for s in out if s]


def readme_applies() -> list[Applied]:
    """Every istio/ file a `kubectl apply` in istio/README.md applies, with the sed it goes
    through when piped."""
    applied = []
    for command in shell_commands(readme_text()):
        segs = segments(command)
        for i, seg in enumerate(segs):
            if seg[:2] != ["kubectl", "apply"]:
                continue
            files = [seg[j + 1] for j, t in enumerate(seg[:-1]) if t in ("-f", "--filename")]
            for f in files:
                if f != "-":
                    applied.append(Applied(REPO / f, None, command))
                    continue
                source = segs[i - 1] if i > 0 else []
                if source[:1] == ["sed"]:
                    m = re.fullmatch(r"s\|([^|]*)\|([^|]*)\|", source[1])
                    assert m, f"unexpected sed expression in {command!r}"
                    applied.append(Applied(REPO / source[2], (m.group(1), m.group(2)), command))
                else:  # `kubectl create … -o yaml | kubectl apply -f -`: no file
                    assert source[:2] == ["kubectl", "create"], f"what does {command!r} apply?"
    return applied


def readme_patches() -> list[tuple[str, str, Path]]:
    """(namespace, deployment, patch file) of every `kubectl … patch deployment … --patch-file`."""
    out = []
    for command in shell_commands(readme_text()):
        for seg in segments(command):
            if seg[:1] == ["kubectl"] and "patch" in seg and "--patch-file" in seg:
                ns = seg[seg.index("-n") + 1] if "-n" in seg else "default"
                target = seg[seg.index("patch") + 1:seg.index("patch") + 3]
                assert target[0] == "deployment", seg
                out.append((ns, target[1], REPO / seg[seg.index("--patch-file") + 1]))
    return out


def readme_secrets() -> dict[tuple[str, str], set[str]]:
    """(namespace, name) -> keys of every `kubectl -n NS create secret generic NAME --from-literal=KEY=…`."""
    out: dict[tuple[str, str], set[str]] = {}
    for command in shell_commands(readme_text()):
        for seg in segments(command):
            if seg[:1] == ["kubectl"] and "secret" in seg and "create" in seg:
                ns = seg[seg.index("-n") + 1] if "-n" in seg else "default"
                name = seg[seg.index("generic") + 1]
                keys = {t.split("=", 2)[1] for t in seg if t.startswith("--from-literal=")}
                out.setdefault((ns, name), set()).update(keys)
    return out


def applied_docs(with_sed: bool = False) -> list[Doc]:
    """The objects of the README's plain `kubectl apply` (with_sed: the variant that pipes
    files through sed, for revision-based installs, with the other files as they are)."""
    applies = readme_applies()
    seds = {a.path: a.sed for a in applies if a.sed}
    docs = []
    for path in sorted({a.path for a in applies}):
        text = path.read_text(encoding="utf-8")
        if with_sed and path in seds:
            old, new = seds[path]
            text = text.replace(old, new)
        docs.extend(load_docs(path, text))
    return docs


def example_docs() -> list[Doc]:
    return [d for p in sorted(EXAMPLES.glob("*.yaml")) for d in load_docs(p)]


def is_istio(obj: dict) -> bool:
    return obj.get("apiVersion", "").split("/")[0] in ISTIO_GROUPS


def floor_stated() -> tuple[int, int]:
    floors = set(re.findall(r"Istio (?:≥|>=) ?(\d+)\.(\d+)", readme_text()))
    assert len(floors) == 1, f"istio/README.md must state one version floor, found {floors}"
    (major, minor), = floors
    return int(major), int(minor)


# --------------------------------------------------------------------------- the tests


def test_the_schemas_are_istios_releases_with_their_source():
    names = [r.name for r in RELEASES]
    assert len(RELEASES) >= 2, names
    notes = (SCHEMAS / "README.md").read_text(encoding="utf-8")
    assert "Apache" in notes
    for r in RELEASES:
        head = r.path.read_text(encoding="utf-8").split("apiVersion:", 1)[0]
        assert re.search(r"istio/api kubernetes/customresourcedefinitions\.gen\.yaml at tag v?" + re.escape(r.name), head), head
        commit = re.search(r"commit ([0-9a-f]{40})", head)
        assert commit and commit.group(1) in notes, f"{r.path.name}: commit not named in istio/schemas/README.md"
        for kind, crd in r.crds.items():
            assert crd["spec"]["names"]["kind"] == kind
            assert crd["spec"]["group"] in ISTIO_GROUPS


def test_the_kit_applies_existing_files_and_no_example():
    applies = readme_applies()
    assert applies, "istio/README.md applies nothing"
    for a in applies:
        assert a.path.is_file(), f"{a.command!r}: {a.path} does not exist"
        assert a.path.parent == ISTIO, f"{a.command!r}: applies {a.path.relative_to(REPO)}"
        assert "example" not in a.path.name
    # Every manifest in istio/ is either applied or the gateway patch: nothing forgotten.
    top = {p for p in ISTIO.glob("*.yaml")}
    used = {a.path for a in applies} | {p for _, _, p in readme_patches()}
    assert top == used, f"manifests neither applied nor patched: {sorted(str(p) for p in top - used)}"
    # The example exists, is named in the README, and is nowhere applied.
    examples = sorted(EXAMPLES.glob("*.yaml"))
    assert examples, "istio/examples/ is empty"
    for p in examples:
        assert f"examples/{p.name}" in readme_text(), f"istio/README.md does not mention {p.name}"
        assert p.read_text(encoding="utf-8").startswith("# EXAMPLE"), p


def test_nothing_applied_is_exported_mesh_wide_or_points_at_an_example_host():
    for d in applied_docs():
        obj = d.obj
        assert obj["kind"] != "ServiceEntry", f"{d.label}: the kit needs no ServiceEntry (examples/ has one)"
        assert "example.internal" not in yaml.safe_dump(obj), d.label
        if obj["kind"] in EXPORTABLE:
            assert obj["spec"].get("exportTo"), f"{d.label}: exported to every namespace"
    for d in example_docs():
        if d.obj["kind"] in EXPORTABLE and d.obj["metadata"].get("namespace") == ROOT_NAMESPACE:
            assert d.obj["spec"].get("exportTo") == ["."], f"{d.label}: in the root namespace, exported mesh-wide"


def istio_docs() -> list[Doc]:
    return [d for d in applied_docs() + example_docs() if is_istio(d.obj)]


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.name)
def test_istio_objects_against_each_stored_release(release: Release):
    """From the stated floor on, Istio accepts every object; below it, it refuses the kit
    (else the floor would be too high)."""
    below_floor = release.version[:2] < floor_stated()
    checked, refused = 0, []
    for d in istio_docs():
        errors = validate_istio_object(release, d.obj)
        if errors is None:
            continue  # this kind is not stored for this release
        checked += 1
        if below_floor:
            refused += [f"{d.label}: {e}" for e in errors]
        else:
            assert errors == [], f"Istio {release.name} refuses {d.label}:\n  " + "\n  ".join(errors)
    assert checked >= (1 if below_floor else 2), checked
    if below_floor:
        assert refused, f"Istio {release.name}, below the stated floor, accepts the whole kit: the floor is too high"
    record(f"istio schema {release.name}: objects validated", f"{checked} ({len(refused)} refusals)" if below_floor else checked)


def test_the_version_floor_is_the_release_that_has_every_field():
    floor = floor_stated()
    # The README and the manifests' comments say the same.
    for p in [README, *ISTIO.glob("*.yaml")]:
        for m in re.findall(r"Istio (?:≥|>=) ?(\d+)\.(\d+)", p.read_text(encoding="utf-8")):
            assert (int(m[0]), int(m[1])) == floor, f"{p.relative_to(REPO)} says Istio >= {m[0]}.{m[1]}, the README {floor}"
    plugins = [d for d in applied_docs() if d.obj["kind"] == "WasmPlugin"]
    assert plugins
    needed = max(WASMPLUGIN_FIELD_SINCE[f] for d in plugins for f in d.obj["spec"])
    assert "failStrategy" in plugins[0].obj["spec"] and needed == (1, 19), needed
    assert floor == needed, f"stated floor {floor}, but the fields used need {needed}"
    # The floor's own schema is stored, and so is the one below it, which must refuse.
    at_floor = [r for r in RELEASES if r.version[:2] == floor]
    below = [r for r in RELEASES if r.version[:2] < floor]
    assert at_floor, f"no stored schema for Istio {floor}"
    assert below, "no stored schema below the floor to show it is real"
    for r in below:
        for d in plugins:
            errors = validate_istio_object(r, d.obj)
            assert errors and any("failStrategy" in e for e in errors), (r.name, errors)


def test_the_validator_is_strict():
    """The validator refuses what Istio refuses (else the tests above prove nothing)."""
    plugin = next(d.obj for d in applied_docs() if d.obj["kind"] == "WasmPlugin")
    entry = next(d.obj for d in example_docs() if d.obj["kind"] == "ServiceEntry")
    newest = RELEASES[-1]
    floor = next(r for r in RELEASES if r.version[:2] == floor_stated())

    def refused(release: Release, obj: dict, mutate: Callable[[dict], None], expect: str) -> None:
        bad = copy.deepcopy(obj)
        mutate(bad)
        errors = validate_istio_object(release, bad)
        assert errors, f"Istio {release.name} schema accepted a broken object"
        assert any(expect in e for e in errors), (release.name, expect, errors)

    for release in (floor, newest):
        refused(release, plugin, lambda o: o["spec"].__setitem__("failStratgy", "FAIL_OPEN"), "Additional properties")
        refused(release, plugin, lambda o: o["spec"]["vmConfig"]["env"][0].__setitem__("from", "HOST"), "Additional properties")
        refused(release, plugin, lambda o: o["spec"].__setitem__("priority", "high"), "is not of type")
        refused(release, plugin, lambda o: o["spec"].__setitem__("phase", "BEFORE_AUTHN"), "is not one of")
        refused(release, plugin, lambda o: o["spec"].__setitem__("failStrategy", "OPEN"), "is not one of")
        refused(release, plugin, lambda o: o["spec"]["selector"].__setitem__("matchLabels", ["istio"]), "is not of type")
        refused(release, plugin, lambda o: o.__setitem__("extra", 1), "Additional properties")
        refused(release, plugin, lambda o: o["metadata"].pop("namespace"), "metadata.namespace")
        refused(release, entry, lambda o: o["spec"].__setitem__("resolution", "DNS_ONLY"), "is not one of")
        refused(release, entry, lambda o: o["spec"]["ports"][0].__setitem__("number", "8081"), "is not of type")
        refused(release, entry, lambda o: o["spec"].__setitem__("exportTo", "."), "is not of type")
    # pluginConfig is x-kubernetes-preserve-unknown-fields: anything goes inside it...
    ok = copy.deepcopy(plugin)
    ok["spec"]["pluginConfig"]["anything"] = {"nested": [1, "two", {"three": None}]}
    assert validate_istio_object(newest, ok) == []
    # ...but it must be an object (a string is what Istio's older examples used).
    refused(newest, plugin, lambda o: o["spec"].__setitem__("pluginConfig", "{}"), "is not of type")
    # priority is nullable (an int32): null passes, 2**31 does not.
    ok = copy.deepcopy(plugin)
    ok["spec"]["priority"] = None
    assert validate_istio_object(newest, ok) == []
    refused(newest, plugin, lambda o: o["spec"].__setitem__("priority", 2**31), "int32")
    # Istio 1.30's CEL rules, as translated.
    refused(newest, plugin, lambda o: o["spec"]["vmConfig"]["env"][0].__setitem__("value", "x"), "only be set when valueFrom is INLINE")
    refused(newest, plugin, lambda o: o["spec"].__setitem__("url", "ftp://registry/diana:0.1.0"), "url must have schema")
    gateway_ref = {"kind": "Gateway", "group": "gateway.networking.k8s.io", "name": "gw"}
    refused(newest, plugin, lambda o: o["spec"].__setitem__("targetRefs", [gateway_ref]), "only one of targetRefs or selector")
    refused(newest, plugin, lambda o: o["spec"]["selector"]["matchLabels"].__setitem__("app", "*"), "wildcard")
    refused(newest, entry, lambda o: o["spec"]["ports"].append(dict(o["spec"]["ports"][0], name="again")), "cannot be duplicated")
    refused(newest, entry, lambda o: o["spec"].__setitem__("hosts", ["*"]), "cannot be wildcard")
    refused(newest, entry, lambda o: o["spec"]["ports"][0].__setitem__("number", 70000), "between 1-65535")


def test_the_validator_implements_kubernetes_extensions_and_refuses_unknown_ones():
    int_or_string = to_json_schema({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]})
    assert validation_errors(int_or_string, 8080) == [] and validation_errors(int_or_string, "http") == []
    assert validation_errors(int_or_string, 1.5) and validation_errors(int_or_string, True)
    bare = to_json_schema({"x-kubernetes-int-or-string": True})  # the anyOf is implied
    assert validation_errors(bare, 7) == [] and validation_errors(bare, ["x"])

    preserved = to_json_schema({"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                                "properties": {"a": {"type": "integer"}}})
    assert validation_errors(preserved, {"a": 1, "b": {"c": []}}) == []
    assert validation_errors(preserved, {"a": "1"})
    closed = to_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert validation_errors(closed, {"a": 1}) == [] and validation_errors(closed, {"a": 1, "b": 2})
    empty = to_json_schema({"type": "object"})
    assert validation_errors(empty, {}) == [] and validation_errors(empty, {"x": 1})
    # Value validations (oneOf of required) do not close the object.
    one_of = to_json_schema({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                             "oneOf": [{"required": ["a"]}, {"required": ["b"]}]})
    assert validation_errors(one_of, {"a": "x"}) == [] and validation_errors(one_of, {"a": "x", "b": "y"})

    as_set = to_json_schema({"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set"})
    assert validation_errors(as_set, ["a", "b"]) == [] and validation_errors(as_set, ["a", "a"])
    as_map = to_json_schema({"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                             "items": {"type": "object", "properties": {"name": {"type": "string"}, "v": {"type": "integer"}}}})
    assert validation_errors(as_map, [{"name": "a", "v": 1}, {"name": "b", "v": 1}]) == []
    assert validation_errors(as_map, [{"name": "a", "v": 1}, {"name": "a", "v": 2}])

    nullable_enum = to_json_schema({"type": "string", "enum": ["A"], "nullable": True})
    assert validation_errors(nullable_enum, None) == [] and validation_errors(nullable_enum, "B")

    unknown_rule = to_json_schema({"type": "string", "x-kubernetes-validations": [{"rule": "self.size() > 3", "message": "m"}]})
    assert any("not implemented by this test" in e for e in validation_errors(unknown_rule, "abcd"))
    for node in ({"type": "object", "x-kubernetes-embedded-resource": True}, {"type": "string", "x-unknown": 1},
                 {"type": "object", "properties": {"a": {"type": "string", "$ref": "#/x"}}}):
        with pytest.raises(UnsupportedSchema):
            to_json_schema(node)


# ----------------------------------------------------------------- core objects and wiring

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
# Istio's protocol selection by port name prefix (or appProtocol).
ISTIO_PORT_PREFIXES = ("http", "http2", "https", "grpc", "grpc-web", "tcp", "tls", "mongo", "mysql", "redis", "udp")


def structural_errors(obj: dict) -> list[str]:
    errors = []
    for key in ("apiVersion", "kind", "metadata"):
        if key not in obj:
            errors.append(f"{key} missing")
    meta = obj.get("metadata", {})
    name = meta.get("name", "")
    if not (len(name) <= 253 and DNS_SUBDOMAIN.fullmatch(name)):
        errors.append(f"metadata.name {name!r} is not a DNS subdomain")
    if obj.get("kind") in ("Namespace", "Service") and not (len(name) <= 63 and DNS_LABEL.fullmatch(name)):
        errors.append(f"metadata.name {name!r} is not a DNS label")
    for k, v in meta.get("labels", {}).items():
        prefix, _, label = k.rpartition("/")
        if (prefix and not DNS_SUBDOMAIN.fullmatch(prefix)) or not (len(label) <= 63 and LABEL_NAME.fullmatch(label)):
            errors.append(f"label key {k!r}")
        if not isinstance(v, str) or not (v == "" or (len(v) <= 63 and LABEL_NAME.fullmatch(v))):
            errors.append(f"label {k}: value {v!r}")
    if is_istio(obj):
        return errors
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key not in CORE_KINDS:
        errors.append(f"unknown kind {key}")
    elif CORE_KINDS[key] and not DNS_LABEL.fullmatch(meta.get("namespace", "")):
        errors.append("metadata.namespace missing")
    elif not CORE_KINDS[key] and "namespace" in meta:
        errors.append("metadata.namespace on a cluster-scoped kind")
    if obj.get("kind") == "Secret":
        errors.append("a Secret in a manifest: secrets are created by istio/README.md's commands, never committed")
    return errors


def test_core_objects_are_well_formed_and_namespaces_exist():
    docs = applied_docs() + example_docs()
    namespaces = {d.obj["metadata"]["name"] for d in docs if d.obj["kind"] == "Namespace"} | {ROOT_NAMESPACE}
    for d in docs:
        errors = structural_errors(d.obj)
        assert errors == [], f"{d.label}: {errors}"
        ns = d.obj["metadata"].get("namespace")
        assert ns is None or ns in namespaces, f"{d.label}: namespace {ns} is neither Istio's nor created by the kit"
    record("istio kit: objects checked", len(docs))


def by_kind(docs: list[Doc], kind: str) -> list[dict]:
    return [d.obj for d in docs if d.obj["kind"] == kind]


def containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


def env_value(container: dict, name: str) -> Optional[dict]:
    return next((e for e in container.get("env", []) if e["name"] == name), None)


def expand(container: dict, text: str, before: Optional[str] = None) -> str:
    """Kubernetes' $(VAR) expansion; every reference must be defined (for env values: earlier)."""
    env = container.get("env", [])
    names = [e["name"] for e in env]
    if before is not None:
        names = names[:names.index(before)]

    def sub(m: re.Match) -> str:
        assert m.group(1) in names, f"$({m.group(1)}) in {text!r} is not defined (before it) in {container['name']}"
        return "<" + m.group(1) + ">"
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def service_backend(docs: list[Doc], host: str, port: int) -> tuple[dict, dict, dict]:
    """`name.ns.svc.cluster.local`, port -> (Service, Deployment, container) of the applied set."""
    m = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local", host)
    assert m, host
    name, ns = m.groups()
    services = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == name and s["metadata"]["namespace"] == ns]
    assert len(services) == 1, f"no Service {ns}/{name} in what istio/README.md applies"
    svc = services[0]
    ports = [p for p in svc["spec"]["ports"] if p["port"] == port]
    assert len(ports) == 1, f"Service {ns}/{name} has no port {port}"
    selector = svc["spec"]["selector"]
    deployments = [d for d in by_kind(docs, "Deployment") if d["metadata"]["namespace"] == ns
                   and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert len(deployments) == 1, f"Service {ns}/{name} selects {len(deployments)} Deployments"
    dep = deployments[0]
    target = ports[0].get("targetPort", port)
    serving = [c for c in containers(dep) if any(p["containerPort"] == target for p in c.get("ports", []))]
    assert len(serving) == 1, f"no container of {ns}/{dep['metadata']['name']} declares port {target}"
    return svc, dep, serving[0]


def test_deployments_services_and_probes_fit_together():
    docs = applied_docs()
    for dep in by_kind(docs, "Deployment"):
        spec = dep["spec"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items(), dep["metadata"]
        for c in containers(dep):
            assert c.get("readinessProbe"), f"{dep['metadata']['name']}/{c['name']}: no readiness probe"
            for arg in c.get("args", []) + c.get("command", []):
                expand(c, arg)
            for e in c.get("env", []):
                if "value" in e:
                    expand(c, e["value"], before=e["name"])
    for svc in by_kind(docs, "Service"):
        for p in svc["spec"]["ports"]:
            assert p.get("appProtocol") or p["name"].split("-")[0] in ISTIO_PORT_PREFIXES, \
                f"Service {svc['metadata']['name']} port {p['port']}: Istio would sniff the protocol (name it tcp-…/http…)"
        # every Service has its pods
        host = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
        for p in svc["spec"]["ports"]:
            service_backend(docs, host, p["port"])


def secret_refs(docs: list[Doc]) -> Iterator[tuple[str, str, Optional[str], str]]:
    """(namespace, secret, key or None for a whole-Secret volume, where) of every reference."""
    for d in docs:
        obj = d.obj
        if obj.get("kind") != "Deployment":
            continue
        ns = obj["metadata"]["namespace"]
        pod = obj["spec"]["template"]["spec"]
        for c in pod["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    yield ns, ref["name"], ref["key"], f"{obj['metadata']['name']}/{c['name']} env {e['name']}"
        for v in pod.get("volumes", []):
            if "secret" in v:
                yield ns, v["secret"]["secretName"], None, f"{obj['metadata']['name']} volume {v['name']}"


def test_every_secret_read_is_created_by_the_readme():
    created = readme_secrets()
    refs = list(secret_refs(applied_docs()))
    for ns, deployment, patch in readme_patches():
        patch_obj = yaml.safe_load(patch.read_text(encoding="utf-8"))
        fake = {"kind": "Deployment", "metadata": {"name": deployment, "namespace": ns}, "spec": patch_obj["spec"]}
        refs += list(secret_refs([Doc(patch, fake)]))
    assert refs
    for ns, name, key, where in refs:
        assert (ns, name) in created, f"{where} reads Secret {ns}/{name}, which istio/README.md never creates"
        assert key is None or key in created[(ns, name)], f"{where}: Secret {ns}/{name} is created without key {key}"


def test_one_apply_gives_a_global_limit_counted_in_redis():
    """The WasmPlugin's global.cluster is a Service of the applied set, whose pods count in a
    Redis of the applied set, with the password from the same Secret; the credential wiring
    (gateway-token.yaml, vmConfig.env, --token-file) is the documented contract."""
    docs = applied_docs()
    plugin = by_kind(docs, "WasmPlugin")[0]
    config = plugin["spec"]["pluginConfig"]
    assert any(r.get("scope") == "global" for res in config["resources"] for r in res["rules"])
    m = re.fullmatch(r"outbound\|(\d+)\|\|(.+)", config["global"]["cluster"])
    assert m, config["global"]["cluster"]
    port, host = int(m.group(1)), m.group(2)
    assert config["global"]["authority"] == host
    svc, quota, container = service_backend(docs, host, port)
    svc_port = next(p for p in svc["spec"]["ports"] if p["port"] == port)
    assert svc_port.get("appProtocol") == "http" or svc_port["name"].startswith("http"), svc_port

    args = container["args"]
    assert args[args.index("--listen") + 1].endswith(f":{svc_port.get('targetPort', port)}")
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The credential: --token-file in a volume of Secret diana-quota-token.
    token_file = Path(args[args.index("--token-file") + 1])
    mount = next(vm for vm in container["volumeMounts"] if token_file.parent == Path(vm["mountPath"]))
    volume = next(v for v in quota["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "diana-quota-token" and token_file.name == "token"
    assert {"name": "DIANA_QUOTA_TOKEN", "valueFrom": "HOST"} in plugin["spec"]["vmConfig"]["env"]
    (ns, deployment, patch), = readme_patches()
    assert (ns, deployment, patch.name) == (plugin["metadata"]["namespace"], "istio-ingressgateway", "gateway-token.yaml")
    proxy = yaml.safe_load(patch.read_text(encoding="utf-8"))["spec"]["template"]["spec"]["containers"][0]
    assert proxy["name"] == "istio-proxy"
    assert env_value(proxy, "DIANA_QUOTA_TOKEN")["valueFrom"]["secretKeyRef"] == {"name": "diana-quota-token", "key": "token"}

    # Redis: several replicas share counters only through it.
    redis_url = env_value(container, "DIANA_QUOTA_REDIS")
    url = redis_url["value"] if redis_url else args[args.index("--redis") + 1] if "--redis" in args else None
    assert url, f"diana-quota has no Redis: its {quota['spec']['replicas']} replicas would each count in memory, apart"
    url = expand(container, url, before="DIANA_QUOTA_REDIS" if redis_url else None)
    m = re.fullmatch(r"redis://(?::<([A-Z_]+)>@)?([^:/]+):(\d+)(/\d+)?", url)
    assert m, f"diana-quota's Redis URL {url!r}"
    password_var, redis_host, redis_port = m.group(1), m.group(2), int(m.group(3))
    assert password_var, "diana-quota reaches Redis without a password"
    _, redis_dep, redis = service_backend(docs, redis_host, redis_port)
    assert redis_dep["spec"]["replicas"] == 1 and redis_dep["spec"]["strategy"]["type"] == "Recreate"
    password_ref = env_value(container, password_var)["valueFrom"]["secretKeyRef"]
    pass_arg = redis["args"][redis["args"].index("--requirepass") + 1]
    redis_var = re.fullmatch(r"\$\(([A-Z_]+)\)", pass_arg).group(1)
    assert env_value(redis, redis_var)["valueFrom"]["secretKeyRef"] == password_ref, "Redis and diana-quota use other passwords"
    probe = " ".join(redis["readinessProbe"]["exec"]["command"])
    assert "ping" in probe and "PONG" in probe, probe  # redis-cli exits 0 on NOAUTH
    assert redis_var == "REDISCLI_AUTH", "the probe's redis-cli authenticates with REDISCLI_AUTH"
    # Only diana-quota may reach Redis (SECURITY.md), where NetworkPolicy is enforced.
    policies = [p for p in by_kind(docs, "NetworkPolicy")
                if p["spec"]["podSelector"]["matchLabels"].items() <= redis_dep["spec"]["template"]["metadata"]["labels"].items()]
    assert len(policies) == 1, policies
    (rule,) = policies[0]["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": quota["spec"]["selector"]["matchLabels"]}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": redis_port}]


@pytest.mark.parametrize("variant", ["istio-injection", "istio.io/rev"])
def test_namespaces_are_labelled_for_injection_and_revisions_are_explained(variant: str):
    text = readme_text()
    assert "istio.io/rev" in text and "revision" in text.lower()
    docs = applied_docs(with_sed=variant == "istio.io/rev")
    namespaces = by_kind(docs, "Namespace")
    assert namespaces, "the kit creates no namespace"
    for ns in namespaces:
        labels = ns["metadata"].get("labels", {})
        present = [k for k in ("istio-injection", "istio.io/rev") if k in labels]
        assert present == [variant], f"namespace {ns['metadata']['name']}: labels {labels} (exactly one of the two)"
        if variant == "istio-injection":
            assert labels["istio-injection"] == "enabled"
    if variant == "istio.io/rev":
        assert any(a.sed for a in readme_applies()), "no revision-based apply in istio/README.md"
        # The substituted manifests are otherwise the same objects, and still valid.
        plain = [d.obj for d in applied_docs()]
        for a, b in zip(plain, (d.obj for d in docs)):
            if a["kind"] != "Namespace":
                assert a == b
        for d in docs:
            labels = d.obj["metadata"].get("labels", {})
            if labels.get("istio.io/rev") == "<rev>":
                labels["istio.io/rev"] = "prod-stable"  # the README's placeholder, filled in
            assert structural_errors(d.obj) == [], d.label
