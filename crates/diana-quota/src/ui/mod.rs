//! The fleet view's page: `GET /ui` and its assets under `/ui/…`, static files compiled
//! into the binary (`include_bytes!`: no build step, nothing fetched from elsewhere at run
//! time), read-only.
//!
//! **The login.** A browser cannot send `authorization: Bearer` on a page load, so the page
//! is a shell that holds nothing of the fleet and needs no credential; its data is
//! `GET /v1/view`, behind the view's own rules ([`crate::fleet::ViewAccess`]), which the
//! page's script fetches with the header:
//!
//! ```text
//!   load /ui ─▶ token in sessionStorage? ─▶ GET /v1/view (Bearer token, or none) ─┐
//!        ▲                                                                        │
//!        │      200 ─▶ shown ─▶ again 2 s after the answer ◀──────────────────────┤
//!        │      401 ─▶ token forgotten ─▶ the sign-in form ─▶ token kept ─▶ GET ──┤
//!        │      other / unreachable ─▶ last view kept, marked stale ─▶ again ─────┘
//!        └── "Forget the token" (sessionStorage cleared, the view hidden)
//! ```
//!
//! The token lives in the tab's `sessionStorage` (gone with the tab), travels only in the
//! `authorization` header of a same-origin fetch, never in a URL, a cookie or the page.
//! A view opened by `--insecure-open-view` is shown without asking.
//!
//! **What a client sends cannot become markup.** Every identity, path, rule, breaker and
//! gateway name is data from clients or gateways: the script writes it with `textContent`
//! and `setAttribute` only (never `innerHTML`, a test greps the script for it), and each
//! answer carries a Content-Security-Policy that allows no inline script, no script but
//! this origin's, no connection but this origin's, no frame, no form submission
//! ([`CONTENT_SECURITY_POLICY`]), with `x-content-type-options: nosniff`.

use axum::http::{header, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// The page's path (its assets are under `/ui/`).
pub const UI_PATH: &str = "/ui";

/// Every answer's policy: the page's own script and style only; fetches to this origin
/// only (`/v1/view`); no inline script or style, no `eval`, no plugin, no frame around
/// it, no form that leaves the page, no `<base>` that moves its URLs.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'";

/// One file of the page.
#[derive(Debug, Clone, Copy)]
pub struct Asset {
    /// Where it is served.
    pub path: &'static str,
    pub content_type: &'static str,
    pub body: &'static [u8],
}

/// The page's files, as served (`/ui/` is the shell too: its URLs are absolute).
pub const ASSETS: [Asset; 5] = [
    asset(UI_PATH, HTML, include_bytes!("index.html")),
    asset("/ui/", HTML, include_bytes!("index.html")),
    asset(
        "/ui/app.js",
        "text/javascript; charset=utf-8",
        include_bytes!("app.js"),
    ),
    asset(
        "/ui/style.css",
        "text/css; charset=utf-8",
        include_bytes!("style.css"),
    ),
    asset("/ui/icon.svg", "image/svg+xml", include_bytes!("icon.svg")),
];

const HTML: &str = "text/html; charset=utf-8";

const fn asset(path: &'static str, content_type: &'static str, body: &'static [u8]) -> Asset {
    Asset {
        path,
        content_type,
        body,
    }
}

/// The routes of [`ASSETS`] (`GET`, and `HEAD` with it); any other path under `/ui/` is
/// the router's 404.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    ASSETS.iter().fold(Router::new(), |router, asset| {
        router.route(asset.path, get(move || async move { serve(asset) }))
    })
}

/// An asset with the headers every answer of the page carries.
fn serve(asset: &'static Asset) -> Response {
    let headers = [
        (
            header::CONTENT_TYPE,
            HeaderValue::from_static(asset.content_type),
        ),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
        (
            HeaderName::from_static("cross-origin-opener-policy"),
            HeaderValue::from_static("same-origin"),
        ),
        (
            HeaderName::from_static("cross-origin-resource-policy"),
            HeaderValue::from_static("same-origin"),
        ),
        // Small files, new with each version of the binary: asked again, never stale.
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
    ];
    (headers, asset.body).into_response()
}
