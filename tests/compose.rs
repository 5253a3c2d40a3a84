//! docker-compose.yml runs for real in `scripts/compose-test` (podman-compose, images built
//! locally); these tests check, without any container engine, that it stays consistent with
//! the rest of the repository: every service it references exists, the Envoy bootstrap it
//! mounts reaches diana-quota and the upstream at the ports they listen on, the embedded
//! Diana policy is valid and has a global rule, the wasm path is where the Dockerfile puts
//! it, diana-quota gets the flags the binary takes — and that every image comes from a
//! variable whose default is an official image (what `docker compose up --build` uses),
//! which docker/Dockerfile declares and scripts/compose-test sets.

#![cfg(test)]

use serde_yaml::Value;
use std::path::Path;

fn read(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

fn load(path: &str) -> Value {
    parse(path, &read(path))
}

fn parse(path: &str, text: &str) -> Value {
    serde_yaml::from_str(text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The `${NAME:-default}` references of a compose file, in order: (NAME, default).
/// Every reference must have a default, so that `docker compose up` needs no variable.
fn variables(text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        let end = rest[start..]
            .find('}')
            .unwrap_or_else(|| panic!("unclosed ${{ in {}", &rest[start..]))
            + start;
        let reference = &rest[start + 2..end];
        let (name, default) = reference.split_once(":-").unwrap_or_else(|| {
            panic!("${{{reference}}} has no default (write ${{NAME:-default}})")
        });
        found.push((name.to_string(), default.to_string()));
        rest = &rest[end + 1..];
    }
    found
}

/// The compose file as Docker users get it: every variable at its default.
fn with_defaults(text: &str) -> String {
    let mut out = text.to_string();
    for (name, default) in variables(text) {
        out = out.replace(&format!("${{{name}:-{default}}}"), &default);
    }
    out
}

/// The value of one `${NAME:-default}` reference, when `value` is exactly one.
fn variable_of(value: &str) -> Option<(String, String)> {
    let vars = variables(value);
    match vars.as_slice() {
        [(name, default)] if value == format!("${{{name}:-{default}}}") => {
            Some((name.clone(), default.clone()))
        }
        _ => None,
    }
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_sequence()
        .map(|s| {
            s.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// (address, port) of an Envoy cluster's single endpoint.
fn endpoint(bootstrap: &Value, cluster: &str) -> (String, u64) {
    let clusters = bootstrap["static_resources"]["clusters"]
        .as_sequence()
        .unwrap();
    let c = clusters
        .iter()
        .find(|c| c["name"].as_str() == Some(cluster))
        .unwrap_or_else(|| panic!("cluster {cluster} missing"));
    let address = &c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        ["socket_address"];
    (
        address["address"].as_str().unwrap().to_string(),
        address["port_value"].as_u64().unwrap(),
    )
}

/// `ARG NAME=default` lines of the Dockerfile before its first FROM (the global build args).
fn dockerfile_args(dockerfile: &str) -> Vec<(String, String)> {
    dockerfile
        .lines()
        .take_while(|l| !l.starts_with("FROM "))
        .filter_map(|l| l.strip_prefix("ARG "))
        .map(|a| {
            let (name, default) = a
                .split_once('=')
                .unwrap_or_else(|| panic!("ARG {a} has no default"));
            (name.to_string(), default.to_string())
        })
        .collect()
}

#[test]
fn compose_file_is_consistent_with_the_repository() {
    let compose = parse(
        "docker-compose.yml",
        &with_defaults(&read("docker-compose.yml")),
    );
    let services = compose["services"].as_mapping().unwrap();
    let names: Vec<&str> = services.keys().filter_map(Value::as_str).collect();
    for expected in ["redis", "diana-quota", "upstream", "envoy"] {
        assert!(
            names.contains(&expected),
            "service {expected} missing: {names:?}"
        );
    }
    for (name, service) in services {
        for dependency in strings(&service["depends_on"]) {
            assert!(
                names.contains(&dependency.as_str()),
                "{name:?} depends on unknown {dependency}"
            );
        }
        if let Some(dockerfile) = service["build"]["dockerfile"].as_str() {
            let text = read(dockerfile);
            let target = service["build"]["target"].as_str().unwrap();
            assert!(
                text.contains(&format!(" AS {target}")),
                "{dockerfile} has no stage {target}"
            );
        }
        for volume in strings(&service["volumes"]) {
            let source = volume.split(':').next().unwrap();
            assert!(
                Path::new(env!("CARGO_MANIFEST_DIR")).join(source).exists(),
                "volume source {source} missing"
            );
        }
    }

    // diana-quota: the flags of DESIGN §2, listening where Envoy's cluster points.
    let quota = strings(&compose["services"]["diana-quota"]["command"]);
    let listen = quota
        .iter()
        .position(|a| a == "--listen")
        .map(|i| quota[i + 1].clone())
        .unwrap();
    let redis = quota
        .iter()
        .position(|a| a == "--redis")
        .map(|i| quota[i + 1].clone())
        .unwrap();
    assert!(redis.starts_with("redis://redis:"), "{redis}");
    let quota_port: u64 = listen.rsplit(':').next().unwrap().parse().unwrap();

    let bootstrap = load("docker/envoy.yaml");
    assert_eq!(
        endpoint(&bootstrap, "diana_quota"),
        ("diana-quota".to_string(), quota_port)
    );
    let upstream = strings(&compose["services"]["upstream"]["command"]);
    let upstream_port: u64 = upstream
        .iter()
        .position(|a| a == "--port")
        .map(|i| upstream[i + 1].parse().unwrap())
        .unwrap();
    assert_eq!(
        endpoint(&bootstrap, "upstream"),
        ("upstream".to_string(), upstream_port)
    );
    let envoy = strings(&compose["services"]["envoy"]["command"]);
    assert!(envoy.contains(&"/etc/envoy/envoy.yaml".to_string()));

    // Envoy's ports: the README's 10000 (listener) and 9901 (admin), on 127.0.0.1 only.
    let listener_port = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
        ["port_value"]
        .as_u64()
        .unwrap();
    let admin_port = bootstrap["admin"]["address"]["socket_address"]["port_value"]
        .as_u64()
        .unwrap();
    assert_eq!(
        strings(&compose["services"]["envoy"]["ports"]),
        [
            format!("127.0.0.1:10000:{listener_port}"),
            format!("127.0.0.1:9901:{admin_port}")
        ]
    );

    // The filter: loaded from where the Dockerfile copies it, with a valid policy that has
    // a global rule calling the cluster defined above.
    let filters = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"]
        .as_sequence()
        .unwrap();
    let wasm = &filters
        .iter()
        .find(|f| f["name"].as_str() == Some("envoy.filters.http.wasm"))
        .unwrap()["typed_config"]["config"];
    let wasm_path = wasm["vm_config"]["code"]["local"]["filename"]
        .as_str()
        .unwrap();
    let dockerfile = read("docker/Dockerfile");
    assert!(
        dockerfile.contains(&format!(
            "COPY --from=artifacts /out/diana-envoy.wasm {wasm_path}"
        )),
        "the Dockerfile's envoy stage does not put the trimmed diana-envoy.wasm at {wasm_path}"
    );
    assert!(
        dockerfile.contains("target/release/diana-trim target/wasm32-wasip1/release/diana.wasm target/wasm32-wasip1/release/diana-envoy.wasm"),
        "the Dockerfile's build stage does not trim the module for Envoy"
    );
    let policy =
        diana_core::config::parse_policy(wasm["configuration"]["value"].as_str().unwrap()).unwrap();
    assert!(policy
        .resources
        .iter()
        .flat_map(|r| &r.rules)
        .any(|r| r.scope == diana_core::config::Scope::Global));
    assert_eq!(
        endpoint(&bootstrap, &policy.global.cluster).0,
        "diana-quota"
    );
}

#[test]
fn every_image_is_a_variable_defaulting_to_an_official_image() {
    let compose = load("docker-compose.yml");
    let dockerfile = read("docker/Dockerfile");
    let args = dockerfile_args(&dockerfile);
    let official = |image: &str| !image.starts_with("localhost/") && image.contains(':');

    for (service, variable) in [
        ("redis", "DIANA_REDIS_IMAGE"),
        ("upstream", "DIANA_PYTHON_IMAGE"),
    ] {
        let image = compose["services"][service]["image"].as_str().unwrap();
        let (name, default) = variable_of(image)
            .unwrap_or_else(|| panic!("{service}: image {image} is not ${{VAR:-default}}"));
        assert_eq!(name, variable, "{service}");
        assert!(official(&default), "{service}: {default}");
    }

    // Built services: every build argument is a global ARG of the Dockerfile, given by a
    // variable whose default is the Dockerfile's own.
    for service in ["diana-quota", "envoy"] {
        let build_args = compose["services"][service]["build"]["args"]
            .as_mapping()
            .unwrap_or_else(|| panic!("{service} has no build args"));
        for (arg, value) in build_args {
            let arg = arg.as_str().unwrap();
            let value = value.as_str().unwrap();
            let (_, default) = variable_of(value)
                .unwrap_or_else(|| panic!("{service}: {arg}: {value} is not ${{VAR:-default}}"));
            let declared = args
                .iter()
                .find(|(name, _)| name == arg)
                .unwrap_or_else(|| panic!("{service}: docker/Dockerfile has no ARG {arg}"));
            assert_eq!(declared.1, default, "{service}: {arg}");
            if arg.ends_with("_IMAGE") {
                assert!(official(&default), "{service}: {arg}: {default}");
                assert!(
                    dockerfile.contains(&format!("FROM ${{{arg}}}")),
                    "docker/Dockerfile does not build FROM ${{{arg}}}"
                );
            }
        }
    }
    // Every stage an image comes from is such an argument: no FROM names an image itself.
    for from in dockerfile.lines().filter(|l| l.starts_with("FROM ")) {
        let image = from.split_whitespace().nth(1).unwrap();
        assert!(
            image.starts_with("${") || image == "scratch",
            "docker/Dockerfile: {from}"
        );
    }

    // ARTIFACTS names a stage: `build` (default, cargo in RUST_IMAGE) or `host` (what
    // scripts/build wrote, let through by .dockerignore).
    assert!(args.contains(&("ARTIFACTS".to_string(), "build".to_string())));
    assert!(dockerfile.contains("FROM ${ARTIFACTS} AS artifacts"));
    for stage in ["build", "host"] {
        assert!(
            dockerfile.contains(&format!(" AS {stage}\n")),
            "docker/Dockerfile has no stage {stage}"
        );
    }
    // The host stage copies what `scripts/build --profile $PROFILE` wrote: PROFILE is
    // `release` by default, `quick` in the test command (Cargo.toml's two profiles).
    assert!(args.contains(&("PROFILE".to_string(), "release".to_string())));
    let dockerignore = read(".dockerignore");
    let build = read("scripts/build");
    assert!(
        build.contains("out=target/$profile\n"),
        "scripts/build: {build}"
    );
    assert!(
        build.contains("wout=target/wasm32-wasip1/$profile\n"),
        "scripts/build: {build}"
    );
    for (file, written) in [
        ("target/${PROFILE}/diana-quota", "$out/diana-quota"),
        (
            "target/wasm32-wasip1/${PROFILE}/diana-envoy.wasm",
            "$wout/diana-envoy.wasm",
        ),
    ] {
        assert!(
            dockerfile.contains(file),
            "the host stage does not copy {file}"
        );
        assert!(
            build.contains(written),
            "scripts/build does not write {written}"
        );
        for profile in ["release", "quick"] {
            let file = file.replace("${PROFILE}", profile);
            assert!(
                dockerignore.contains(&format!("!{file}")),
                ".dockerignore leaves out {file}"
            );
        }
    }
}

#[test]
fn the_compose_test_sets_every_variable() {
    let text = read("docker-compose.yml");
    let script = read("scripts/compose-test");
    let mut names: Vec<String> = variables(&text).into_iter().map(|(n, _)| n).collect();
    names.sort();
    names.dedup();
    assert!(names.len() >= 8, "{names:?}");
    for name in &names {
        assert!(name.starts_with("DIANA_"), "{name}");
        assert!(
            script.contains(&format!(" {name}=")) || script.contains(&format!("\n{name}=")),
            "scripts/compose-test does not set {name}"
        );
    }
    // The host ports keep the README's defaults.
    let vars = variables(&text);
    assert!(vars.contains(&("DIANA_PORT".to_string(), "10000".to_string())));
    assert!(vars.contains(&("DIANA_ADMIN_PORT".to_string(), "9901".to_string())));
}
