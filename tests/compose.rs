//! docker-compose.yml cannot be run here (no Docker engine), so this test checks that it
//! is consistent with the rest of the repository: every service it references exists, the
//! Envoy bootstrap it mounts reaches diana-quota and the upstream at the ports they listen
//! on, the embedded Diana policy is valid and has a global rule, the wasm path is where the
//! Dockerfile puts it, and diana-quota gets the flags the binary takes.

#![cfg(test)]

use serde_yaml::Value;
use std::path::Path;

fn load(path: &str) -> Value {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    let text = std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
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

#[test]
fn compose_file_is_consistent_with_the_repository() {
    let compose = load("docker-compose.yml");
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
            let text =
                std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(dockerfile))
                    .unwrap();
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
    let dockerfile =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docker/Dockerfile"))
            .unwrap();
    assert!(
        dockerfile.contains(&format!("release/diana-envoy.wasm {wasm_path}")),
        "Dockerfile does not put the trimmed diana-envoy.wasm at {wasm_path}"
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
