//! `diana check-nginx`: the repository's own nginx configurations pass, and each mistake
//! ngx_wasm_module does not let the filter catch at run time is named with its file:line
//! (fixtures under tests/fixtures/nginx/; each is a configuration `nginx -t` accepts, but
//! unterminated.conf).

#![cfg(test)]

mod common;

use common::{diana, repo_root, text};
use std::path::PathBuf;
use std::process::{Command, Output};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nginx")
}

fn check_nginx(conf: &str, extra: &[&str]) -> Output {
    let mut args = vec!["check-nginx", conf];
    args.extend_from_slice(extra);
    diana(&args, None)
}

/// The exit code of "problems found" and of "cannot be read or parsed".
const PROBLEMS: i32 = 1;
const UNREADABLE: i32 = 2;

/// (fixture, exit code, [(file:line a reported line names, what it says)])
type Case = (&'static str, i32, &'static [(&'static str, &'static str)]);

#[test]
fn each_mistake_is_named_with_its_file_and_line() {
    let cases: &[Case] = &[
        ("ok.conf", 0, &[]),
        ("star_zone.conf", 0, &[]),
        ("flag_in_server.conf", 0, &[]),
        ("include.conf", 0, &[]),
        ("harness.conf", 0, &[]),
        (
            "no_shm.conf",
            PROBLEMS,
            &[(
                "no_shm.conf:6",
                "the wasm block has no shm_kv zone for Diana's keys (diana/...): add `shm_kv diana 1m;` inside it",
            )],
        ),
        (
            "other_namespace.conf",
            PROBLEMS,
            &[(
                "other_namespace.conf:6",
                "no shm_kv zone for Diana's keys (diana/...) (only `shm_kv kong` (",
            )],
        ),
        (
            "too_small.conf",
            PROBLEMS,
            &[(
                "too_small.conf:9",
                "`shm_kv diana 16m` is smaller than the 37m the document needs",
            )],
        ),
        (
            "no_flag.conf",
            PROBLEMS,
            &[(
                "no_flag.conf:15",
                "location / runs `proxy_wasm diana` (",
            )],
        ),
        (
            "flag_off.conf",
            PROBLEMS,
            &[(
                "flag_off.conf:15",
                "`proxy_wasm_request_headers_in_access off;` (",
            )],
        ),
        (
            "include_no_shm.conf",
            PROBLEMS,
            &[(
                "conf.d-no-shm/wasm.conf:2",
                "the wasm block has no shm_kv zone",
            )],
        ),
        (
            "envoy_cluster.conf",
            PROBLEMS,
            &[(
                "envoy_cluster.conf:16",
                "global.cluster is `diana_quota`, an Envoy cluster name",
            )],
        ),
        (
            "unterminated.conf",
            UNREADABLE,
            &[(
                "unterminated.conf:16",
                "unterminated quoted string",
            )],
        ),
        (
            "include_missing.conf",
            UNREADABLE,
            &[("include_missing.conf:6", "cannot read included file")],
        ),
    ];
    for (fixture, code, expected) in cases {
        let path = fixtures().join(fixture);
        let out = check_nginx(path.to_str().unwrap(), &[]);
        let stdout = text(&out.stdout);
        let stderr = text(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(*code),
            "{fixture}: stdout: {stdout}\nstderr: {stderr}"
        );
        if *code == 0 {
            assert!(
                stdout.contains(": ok: module diana "),
                "{fixture}: {stdout}"
            );
            assert_eq!(stdout.lines().count(), 1, "{fixture}: {stdout}");
            continue;
        }
        // Problems on stdout, one line each; a configuration that cannot be read on stderr.
        let report = if *code == PROBLEMS { &stdout } else { &stderr };
        assert_eq!(
            report.lines().count(),
            expected.len(),
            "{fixture}: one line per problem: {report}"
        );
        for (at, says) in *expected {
            let line = report
                .lines()
                .find(|line| line.contains(&format!("{at}: ")))
                .unwrap_or_else(|| panic!("{fixture}: no line for {at}: {report}"));
            assert!(line.contains(says), "{fixture}: {line}\nshould say: {says}");
            // The path is the one the included file has, joined to the main file's directory.
            assert!(
                line.starts_with(fixtures().to_str().unwrap()),
                "{fixture}: {line}"
            );
        }
    }
}

#[test]
fn the_repository_example_passes_with_its_document_inline_and_given() {
    let conf = repo_root().join("nginx/nginx.conf");
    let document = repo_root().join("nginx/diana.json");
    for extra in [vec![], vec!["--document", document.to_str().unwrap()]] {
        let out = check_nginx(conf.to_str().unwrap(), &extra);
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "{extra:?}: {stdout}{}",
            text(&out.stderr)
        );
        assert!(
            stdout.contains("ok: module diana /opt/diana/diana.wasm; shm_kv diana 64m (needs 37m)"),
            "{stdout}"
        );
    }
}

#[test]
fn a_document_given_with_document_is_checked_instead() {
    // ok.conf's zone (4m) is too small for the repository's example document.
    let out = check_nginx(
        fixtures().join("ok.conf").to_str().unwrap(),
        &[
            "--document",
            repo_root().join("nginx/diana.json").to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(PROBLEMS));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("ok.conf:8: `shm_kv diana 4m` is smaller than the 37m"),
        "{stdout}"
    );
    // A refused document: the filter's own message, with the document's name.
    let out = diana(
        &[
            "check-nginx",
            fixtures().join("ok.conf").to_str().unwrap(),
            "--document",
            "-",
        ],
        Some("Url: /\nrules: [{rpu: 0}]\n"),
    );
    assert_eq!(out.status.code(), Some(PROBLEMS));
    assert!(
        text(&out.stdout).starts_with("-: refused by the filter: "),
        "{}",
        text(&out.stdout)
    );
}

/// What tests/e2e/harness.py's Nginx renders now (scripts/render_nginx.py), when python3
/// with PyYAML is here; harness.conf is a copy of it that always runs.
#[test]
fn what_the_end_to_end_harness_renders_passes() {
    let root = repo_root();
    let needed =
        common::check_json(&std::fs::read_to_string(root.join("envoy/demo-diana.yaml")).unwrap())
            ["nginx"]["shm_kv_bytes"]
            .as_u64()
            .unwrap()
            >> 20;
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path();
    let conf = dir.join("nginx.conf");
    let script = format!(
        "import sys; sys.path.insert(0, {scripts:?}); import render_nginx\n\
         doc = open({doc:?}).read()\n\
         open({conf:?}, 'w').write(render_nginx.render(listen_port=18000, upstream_port=18080, \
         diana_config=doc, wasm_path='/opt/diana/diana.wasm', prefix={dir:?}, quota_port=18081, \
         metrics_path='/__diana/metrics', shm_size='{needed}m', \
         wasmtime_cache_config='/etc/nginx/wasmtime-cache.toml'))\n",
        scripts = root.join("scripts").to_str().unwrap(),
        doc = root.join("envoy/demo-diana.yaml").to_str().unwrap(),
        conf = conf.to_str().unwrap(),
        dir = dir.to_str().unwrap(),
    );
    let rendered = Command::new("python3").args(["-c", &script]).output();
    match rendered {
        Ok(out) if out.status.success() => {}
        other => {
            eprintln!("skipped: python3 cannot render with scripts/render_nginx.py: {other:?}");
            return;
        }
    }
    let out = check_nginx(conf.to_str().unwrap(), &[]);
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
}
