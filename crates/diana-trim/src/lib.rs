//! Trimming the proxy-wasm callbacks Diana does not implement out of `diana.wasm`.
//!
//! The Rust SDK exports every `proxy_on_*` callback, so a host enters the VM for each of
//! them on every request, response body chunk and trailer, even though Diana's default
//! handlers do nothing. Envoy (proxy-wasm-cpp-host) checks each export and skips an
//! absent callback, so removing the ones Diana does not need removes those VM entries:
//! `proxy_on_log`, `proxy_on_done`, the body, trailer and metadata callbacks, the
//! network-filter and gRPC callbacks. Exports that are not callbacks (memory, the
//! allocator, the ABI marker, `_initialize`) are left alone, and the code only reachable
//! from the removed callbacks is dropped with them.
//!
//! ngx_wasm_module calls `proxy_on_done` and `proxy_on_log` without checking that they
//! exist, so nginx and Kong get the untrimmed module.
//!
//! Reading bodies has a price on every request, whether a rule reads them or not: the host
//! enters the VM for each body chunk. So there are two trimmed modules: one without any
//! body callback ([`Keep::Headers`], `diana-envoy.wasm`), for documents whose rules read no
//! body, and one that keeps the answer's body and trailer callbacks ([`Keep::Bodies`],
//! `diana-envoy-bodies.wasm`), for documents with `response_cost.usage | json`. `diana
//! render-envoy` loads the second where the document needs it.

use std::collections::BTreeSet;

/// The callbacks Diana implements, with what each is for. Any other `proxy_on_*` export
/// goes.
pub const KEPT_CALLBACKS: &[&str] = &[
    // The SDK's context bookkeeping: creating and freeing root and HTTP contexts (the
    // HTTP context's `Drop` also forgets a leaky-bucket waiter).
    "proxy_on_context_create",
    "proxy_on_delete",
    // Reading and validating the configuration.
    "proxy_on_vm_start",
    "proxy_on_configure",
    // Resuming leaky-bucket waiters, polling the config center.
    "proxy_on_tick",
    // The decision.
    "proxy_on_request_headers",
    // `X-RateLimit-*` headers on admitted responses (`headers: all`).
    "proxy_on_response_headers",
    // Answers from diana-quota and from the config center.
    "proxy_on_http_call_response",
    // Not a callback: the host allocates returned buffers through it.
    "proxy_on_memory_allocate",
];

/// The callbacks the module for documents that read answers keeps besides
/// [`KEPT_CALLBACKS`]: each chunk of an answer's body goes to the usage reader; trailers end
/// a body. (No request body: a paused request gets none on proxy-wasm, so `reserve.json`
/// reserves its default there.)
pub const BODY_CALLBACKS: &[&str] = &["proxy_on_response_body", "proxy_on_response_trailers"];

/// Which module to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// [`KEPT_CALLBACKS`] only: no body reaches the VM.
    Headers,
    /// [`KEPT_CALLBACKS`] and [`BODY_CALLBACKS`].
    Bodies,
}

impl Keep {
    fn keeps(self, name: &str) -> bool {
        KEPT_CALLBACKS.contains(&name) || (self == Keep::Bodies && BODY_CALLBACKS.contains(&name))
    }

    fn required(self) -> impl Iterator<Item = &'static str> {
        let bodies: &[&'static str] = match self {
            Keep::Headers => &[],
            Keep::Bodies => BODY_CALLBACKS,
        };
        KEPT_CALLBACKS.iter().chain(bodies).copied()
    }
}

/// What trimming did.
#[derive(Debug, PartialEq, Eq)]
pub struct Trimmed {
    /// The trimmed module.
    pub wasm: Vec<u8>,
    /// The callback exports removed, sorted.
    pub removed: Vec<String>,
}

/// Why a module cannot be trimmed (or its exports listed).
#[derive(Debug, thiserror::Error)]
pub enum TrimError {
    /// Not WebAssembly walrus can read (walrus's reason).
    #[error("not a readable wasm module: {0}")]
    Unreadable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Callbacks Diana implements are not exported: not a Diana module, or the SDK changed
    /// and [`KEPT_CALLBACKS`] needs a look.
    #[error(
        "not a Diana module built with the proxy-wasm SDK: missing export(s) {}",
        .missing.join(", ")
    )]
    MissingCallbacks { missing: Vec<&'static str> },
}

/// The export names of a module, sorted.
pub fn exports(wasm: &[u8]) -> Result<Vec<String>, TrimError> {
    let module = parse(wasm)?;
    let names: BTreeSet<String> = module.exports.iter().map(|e| e.name.clone()).collect();
    Ok(names.into_iter().collect())
}

/// Removes every `proxy_on_*` export that `keep` does not keep, then the code nothing
/// reaches any more. Fails if a kept callback is missing: the SDK changed and the list
/// needs a look.
pub fn trim(wasm: &[u8], keep: Keep) -> Result<Trimmed, TrimError> {
    let mut module = parse(wasm)?;
    let present: BTreeSet<&str> = module.exports.iter().map(|e| e.name.as_str()).collect();
    let missing: Vec<&'static str> = keep
        .required()
        .filter(|name| !present.contains(name))
        .collect();
    if !missing.is_empty() {
        return Err(TrimError::MissingCallbacks { missing });
    }
    let doomed: Vec<(walrus::ExportId, String)> = module
        .exports
        .iter()
        .filter(|e| e.name.starts_with("proxy_on_") && !keep.keeps(&e.name))
        .map(|e| (e.id(), e.name.clone()))
        .collect();
    let mut removed = Vec::with_capacity(doomed.len());
    for (id, name) in doomed {
        module.exports.delete(id);
        removed.push(name);
    }
    removed.sort();
    walrus::passes::gc::run(&mut module);
    Ok(Trimmed {
        wasm: module.emit_wasm(),
        removed,
    })
}

fn parse(wasm: &[u8]) -> Result<walrus::Module, TrimError> {
    walrus::Module::from_buffer(wasm).map_err(|e| TrimError::Unreadable(e.into()))
}

#[cfg(test)]
mod tests {

    use super::*;
    use walrus::{FunctionBuilder, Module, ModuleConfig, ValType};

    /// A module shaped like an SDK build: one function per callback export, plus the
    /// non-callback exports, and one helper reachable only from `proxy_on_log`.
    fn sdk_like(callbacks: &[&str]) -> Vec<u8> {
        let mut module = Module::with_config(ModuleConfig::new());
        let mut helper = FunctionBuilder::new(&mut module.types, &[], &[ValType::I32]);
        helper.func_body().i32_const(42);
        let helper = helper.finish(vec![], &mut module.funcs);
        module.funcs.get_mut(helper).name = Some("only_for_log".into());
        for name in callbacks {
            let mut f = FunctionBuilder::new(&mut module.types, &[], &[ValType::I32]);
            if *name == "proxy_on_log" {
                f.func_body().call(helper);
            } else {
                f.func_body().i32_const(1);
            }
            let id = f.finish(vec![], &mut module.funcs);
            module.exports.add(name, id);
        }
        for name in ["malloc", "proxy_abi_version_0_2_1", "_initialize"] {
            let mut f = FunctionBuilder::new(&mut module.types, &[], &[]);
            f.func_body();
            let id = f.finish(vec![], &mut module.funcs);
            module.exports.add(name, id);
        }
        let memory = module.memories.add_local(false, false, 1, None, None);
        module.exports.add("memory", memory);
        module.emit_wasm()
    }

    const DROPPED: &[&str] = &[
        "proxy_on_done",
        "proxy_on_log",
        "proxy_on_request_body",
        "proxy_on_response_body",
        "proxy_on_response_trailers",
        "proxy_on_grpc_close",
        "proxy_on_foreign_function",
    ];

    #[test]
    fn keeps_diana_callbacks_and_non_callbacks_and_drops_the_rest() {
        let all: Vec<&str> = KEPT_CALLBACKS.iter().chain(DROPPED).copied().collect();
        let trimmed = trim(&sdk_like(&all), Keep::Headers).unwrap();
        let mut expected_removed: Vec<String> = DROPPED.iter().map(|s| s.to_string()).collect();
        expected_removed.sort();
        assert_eq!(trimmed.removed, expected_removed);
        let left = exports(&trimmed.wasm).unwrap();
        let mut expected: Vec<String> = KEPT_CALLBACKS
            .iter()
            .chain(&["malloc", "proxy_abi_version_0_2_1", "_initialize", "memory"])
            .map(|s| s.to_string())
            .collect();
        expected.sort();
        assert_eq!(left, expected);
    }

    #[test]
    fn code_reachable_only_from_a_removed_callback_goes_too() {
        let all: Vec<&str> = KEPT_CALLBACKS.iter().chain(DROPPED).copied().collect();
        let before = Module::from_buffer(&sdk_like(&all)).unwrap();
        assert!(before.funcs.by_name("only_for_log").is_some());
        let after =
            Module::from_buffer(&trim(&sdk_like(&all), Keep::Headers).unwrap().wasm).unwrap();
        assert!(after.funcs.iter().count() < before.funcs.iter().count());
        assert_eq!(after.funcs.iter().count(), KEPT_CALLBACKS.len() + 3);
    }

    #[test]
    fn trimming_twice_changes_nothing() {
        let all: Vec<&str> = KEPT_CALLBACKS.iter().chain(DROPPED).copied().collect();
        let once = trim(&sdk_like(&all), Keep::Headers).unwrap();
        let twice = trim(&once.wasm, Keep::Headers).unwrap();
        assert!(twice.removed.is_empty());
        assert_eq!(exports(&twice.wasm).unwrap(), exports(&once.wasm).unwrap());
    }

    #[test]
    fn a_module_without_a_kept_callback_is_refused() {
        let without: Vec<&str> = KEPT_CALLBACKS
            .iter()
            .copied()
            .filter(|n| *n != "proxy_on_tick")
            .collect();
        let error = trim(&sdk_like(&without), Keep::Headers).unwrap_err();
        assert!(
            matches!(&error, TrimError::MissingCallbacks { missing } if missing == &["proxy_on_tick"]),
            "{error:?}"
        );
        assert_eq!(
            error.to_string(),
            "not a Diana module built with the proxy-wasm SDK: missing export(s) proxy_on_tick"
        );
    }

    #[test]
    fn the_module_for_answers_keeps_the_body_callbacks_only() {
        let all: Vec<&str> = KEPT_CALLBACKS.iter().chain(DROPPED).copied().collect();
        let trimmed = trim(&sdk_like(&all), Keep::Bodies).unwrap();
        let left = exports(&trimmed.wasm).unwrap();
        for name in BODY_CALLBACKS {
            assert!(left.iter().any(|e| e == name), "{name} kept: {left:?}");
        }
        assert!(!left.iter().any(|e| e == "proxy_on_log"), "{left:?}");
        assert!(
            !left.iter().any(|e| e == "proxy_on_request_body"),
            "{left:?}"
        );
        let headers = exports(&trim(&sdk_like(&all), Keep::Headers).unwrap().wasm).unwrap();
        for name in BODY_CALLBACKS {
            assert!(
                !headers.iter().any(|e| e == name),
                "{name} removed: {headers:?}"
            );
        }
    }

    #[test]
    fn garbage_is_refused_with_a_reason() {
        let error = trim(b"not wasm", Keep::Headers).unwrap_err();
        assert!(matches!(error, TrimError::Unreadable(_)), "{error:?}");
        assert!(
            error
                .to_string()
                .starts_with("not a readable wasm module: "),
            "{error}"
        );
    }
}
