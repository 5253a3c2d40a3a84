//! The fleet view's page (`GET /ui` and its assets) through the HTTP layer in-process: what
//! each answer carries (the security headers), that the page holds nothing of the fleet and
//! needs no credential while its data does, and what its files may contain (no inline
//! script, no markup built from data). The page in a real browser: tests/e2e/test_fleet_ui.py.

#![cfg(test)]

mod common;

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use common::*;
use diana_quota::auth::{parse_secrets, Auth};
use diana_quota::fleet::ViewAccess;
use diana_quota::store::{MemoryStore, Store};
use diana_quota::ui::{ASSETS, CONTENT_SECURITY_POLICY, UI_PATH};
use diana_quota::{app, AppState};
use std::sync::Arc;
use tower::ServiceExt;

const VIEW_TOKEN: &str = "view-only-secret-0123456789abcdefghij";

fn router_with(auth: Auth, access: ViewAccess) -> Router {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::default());
    app(AppState::with_view(store, test_settings(), auth, access))
}

fn view_tokens() -> ViewAccess {
    ViewAccess::Tokens(Arc::new(
        Auth::with_secrets(&parse_secrets(VIEW_TOKEN, "test").unwrap()).unwrap(),
    ))
}

async fn call(
    router: &Router,
    method: &str,
    path: &str,
    authorization: Option<&str>,
) -> (StatusCode, HeaderMap, Vec<u8>) {
    let mut request = Request::builder().method(method).uri(path);
    if let Some(value) = authorization {
        request = request.header("authorization", value);
    }
    let response = router
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap()
        .to_vec();
    (status, headers, body)
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .map(|value| value.to_str().unwrap())
        .unwrap_or("")
}

fn text(path: &str) -> &'static str {
    let asset = ASSETS.iter().find(|asset| asset.path == path).unwrap();
    std::str::from_utf8(asset.body).unwrap()
}

#[tokio::test]
async fn every_file_is_served_with_its_type_and_the_security_headers() {
    let router = router_with(test_auth(), ViewAccess::Service);
    // (path, content type)
    let cases = [
        ("/ui", "text/html; charset=utf-8"),
        ("/ui/", "text/html; charset=utf-8"),
        ("/ui/app.js", "text/javascript; charset=utf-8"),
        ("/ui/style.css", "text/css; charset=utf-8"),
        ("/ui/icon.svg", "image/svg+xml"),
    ];
    assert_eq!(cases.len(), ASSETS.len());
    for (path, content_type) in cases {
        for method in ["GET", "HEAD"] {
            let (status, headers, body) = call(&router, method, path, None).await;
            assert_eq!(status, StatusCode::OK, "{method} {path}");
            assert_eq!(header(&headers, "content-type"), content_type, "{path}");
            assert_eq!(
                header(&headers, "content-security-policy"),
                CONTENT_SECURITY_POLICY,
                "{path}"
            );
            assert_eq!(header(&headers, "x-content-type-options"), "nosniff");
            assert_eq!(header(&headers, "x-frame-options"), "DENY");
            assert_eq!(header(&headers, "referrer-policy"), "no-referrer");
            assert_eq!(header(&headers, "cache-control"), "no-cache");
            if method == "GET" {
                let asset = ASSETS.iter().find(|asset| asset.path == path).unwrap();
                assert_eq!(body, asset.body, "{path}");
            } else {
                assert!(body.is_empty(), "HEAD {path}");
            }
        }
    }
    assert_eq!(
        CONTENT_SECURITY_POLICY,
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
         connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    );
    // Nothing else under /ui; and the page is read-only.
    for (method, path, expected) in [
        ("GET", "/ui/index.html", StatusCode::NOT_FOUND),
        ("GET", "/ui/../v1/view", StatusCode::NOT_FOUND),
        ("GET", "/ui/app.js/x", StatusCode::NOT_FOUND),
        ("GET", "/uix", StatusCode::NOT_FOUND),
        ("POST", "/ui", StatusCode::METHOD_NOT_ALLOWED),
        ("DELETE", "/ui/app.js", StatusCode::METHOD_NOT_ALLOWED),
    ] {
        let (status, _, _) = call(&router, method, path, None).await;
        assert_eq!(status, expected, "{method} {path}");
    }
}

/// A report whose every name is markup, and whose rule and identity a caller without the
/// credential must never see.
const REPORT: &str = r#"{"gateway":"gw-secret-1","interval_ms":1000,"degraded":true,
  "rules":[{"name":"rule-<b>secret</b>","admitted":5,"limited":9,
    "hot_limited":{"capacity":10,"total":9,"floor":0,"items":[["<img src=x onerror=alert(1)>",9,0]]}}],
  "breakers":[{"key":"k1","name":"breaker-<script>x</script>","fleet":false,
    "params":{"slow_ratio_ppm":0,"failure_ratio_ppm":500000,"min_calls":20,"window_seconds":10,
      "open_ms":30000,"half_open_calls":3,"probe_timeout_ms":2000},"status":"open"}]}"#;

#[tokio::test]
async fn the_page_needs_no_credential_and_holds_nothing_of_the_fleet() {
    let gateway_bearer = bearer();
    let view_bearer = format!("Bearer {VIEW_TOKEN}");
    // (auth, access, who reads the view)
    let cases: Vec<(Auth, ViewAccess, Option<&str>)> = vec![
        (test_auth(), ViewAccess::Service, Some(&gateway_bearer)),
        (test_auth(), view_tokens(), Some(&view_bearer)),
        (Auth::insecure(), view_tokens(), Some(&view_bearer)),
        (Auth::insecure(), ViewAccess::Open, None),
        // Closed to everyone: the page still loads, and says how to open it.
        (Auth::insecure(), ViewAccess::Service, None),
    ];
    for (at, (auth, access, reader)) in cases.into_iter().enumerate() {
        let open = access.is_open();
        let router = router_with(auth, access);
        let report = Request::builder()
            .method("POST")
            .uri("/v1/report")
            .header("content-type", "application/json")
            .header("authorization", bearer())
            .body(Body::from(REPORT))
            .unwrap();
        let (status, _, _) = send(&router, report).await;
        assert_eq!(status, StatusCode::OK, "case {at}");
        for asset in ASSETS {
            let (status, _, body) = call(&router, "GET", asset.path, None).await;
            assert_eq!(status, StatusCode::OK, "case {at}: {}", asset.path);
            let body = String::from_utf8_lossy(&body);
            for secret in [
                "gw-secret-1",
                "secret</b>",
                "onerror",
                "breaker-<",
                TEST_TOKEN,
                VIEW_TOKEN,
            ] {
                assert!(
                    !body.contains(secret),
                    "case {at}: {} holds {secret}",
                    asset.path
                );
            }
        }
        // The data is behind the view's rules.
        let (status, _, body) = call(&router, "GET", "/v1/view", None).await;
        if open {
            assert_eq!(status, StatusCode::OK, "case {at}");
        } else {
            assert_eq!(status, StatusCode::UNAUTHORIZED, "case {at}");
            assert!(!String::from_utf8_lossy(&body).contains("gw-secret-1"));
            let wrong = "Bearer not-a-secret-of-this-service-0123456789";
            let (status, _, _) = call(&router, "GET", "/v1/view", Some(wrong)).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "case {at}");
        }
        if let Some(reader) = reader {
            let (status, _, body) = call(&router, "GET", "/v1/view", Some(reader)).await;
            assert_eq!(status, StatusCode::OK, "case {at}");
            let body = String::from_utf8_lossy(&body);
            assert!(body.contains("gw-secret-1"), "case {at}: {body}");
            assert!(
                !body.contains(TEST_TOKEN) && !body.contains(VIEW_TOKEN),
                "case {at}"
            );
        }
    }
}

#[tokio::test]
async fn the_pages_requests_are_counted_under_one_route() {
    let router = router_with(test_auth(), ViewAccess::Service);
    for asset in ASSETS {
        assert_eq!(
            call(&router, "GET", asset.path, None).await.0,
            StatusCode::OK
        );
    }
    call(&router, "GET", "/ui/nothing-here", None).await;
    let (_, _, metrics) = call(&router, "GET", "/metrics", None).await;
    let metrics = String::from_utf8(metrics).unwrap();
    let served = format!(
        "diana_quota_http_requests_total{{path=\"{UI_PATH}\",status=\"200\"}} {}",
        ASSETS.len()
    );
    assert!(metrics.contains(&served), "{metrics}");
    // An unknown file is no route of the page: no label per path a client makes up.
    assert!(
        metrics.contains("diana_quota_http_requests_total{path=\"other\",status=\"404\"} 1"),
        "{metrics}"
    );
}

#[test]
fn the_page_runs_no_inline_script_and_loads_only_its_own_files() {
    let html = text(UI_PATH);
    let lower = html.to_ascii_lowercase();
    // Every <script> has a src of this origin and no body.
    let scripts: Vec<&str> = lower.split("<script").skip(1).collect();
    assert_eq!(scripts.len(), 1, "{html}");
    for script in &scripts {
        let (tag, rest) = script.split_once('>').unwrap();
        assert!(tag.contains("src=\"/ui/"), "<script{tag}>");
        assert!(rest.starts_with("</script>"), "an inline script: {rest}");
    }
    // No event-handler attribute, no inline style, no javascript: URL, nothing embedded.
    assert_eq!(event_handlers(&lower), Vec::<String>::new());
    for bad in [
        "style=",
        "javascript:",
        "<iframe",
        "<object",
        "<embed",
        "<base",
    ] {
        assert!(!lower.contains(bad), "{bad} in index.html");
    }
    // Every src and href names one of the page's files.
    for attribute in ["src=\"", "href=\""] {
        for piece in html.split(attribute).skip(1) {
            let target = piece.split('"').next().unwrap();
            assert!(
                ASSETS.iter().any(|asset| asset.path == target),
                "{attribute}{target}\" is not a file of the page"
            );
        }
    }
}

#[test]
fn the_script_never_turns_data_into_markup() {
    let script = text("/ui/app.js");
    for sink in [
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
        "createContextualFragment",
        "DOMParser",
        "srcdoc",
        "localStorage",
        "document.cookie",
        "location.hash",
        "location.search",
        "?token",
        "&token",
    ] {
        assert!(!script.contains(sink), "app.js uses {sink}");
    }
    // It fetches the view of this origin only, with the header.
    assert!(script.contains(r#"const VIEW_URL = "/v1/view";"#));
    assert!(script.contains("headers.authorization = `Bearer ${sent}`"));
    assert!(script.contains(r#"credentials: "omit""#));
    // One place sets attributes (`setAttrs`), from names written in the script.
    assert_eq!(script.matches("setAttribute(").count(), 1);
}

/// The `on…=` attributes of an HTML text (lower case).
fn event_handlers(html: &str) -> Vec<String> {
    let mut found = Vec::new();
    let bytes = html.as_bytes();
    for (at, _) in html.match_indices("on") {
        let after_space = at > 0 && bytes[at - 1].is_ascii_whitespace();
        let name: String = html[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphabetic())
            .collect();
        let rest = html[at + name.len()..].trim_start();
        if after_space && name.len() > 2 && rest.starts_with('=') {
            found.push(name);
        }
    }
    found
}
