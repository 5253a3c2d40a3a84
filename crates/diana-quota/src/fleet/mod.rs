//! The fleet as this replica sees it: the view of the gateways' reports ([`view`]), who
//! may read it ([`ViewAccess`]) and its metrics ([`metrics`]). The fleet's breakers
//! themselves live in the store (`crate::store::breakers`); the endpoints are
//! `crate::report`.

pub mod metrics;
pub mod view;

use crate::auth::{Auth, Rejection};
use crate::store::{Clock, Decided};
use axum::http::{header, HeaderMap};
use diana_core::report::{BreakerReport, ReportRequest};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use view::{Limits, Snapshot, View};

/// The view, shared by the handlers and the metrics.
pub struct Fleet {
    view: Mutex<View>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("limits", &self.lock().limits())
            .finish()
    }
}

impl Fleet {
    pub fn new(limits: Limits, clock: Arc<dyn Clock>) -> Fleet {
        Fleet {
            view: Mutex::new(View::new(limits)),
            clock,
        }
    }

    fn lock(&self) -> MutexGuard<'_, View> {
        // Every update leaves the view whole between statements that could panic: a
        // poisoned lock is usable.
        self.view.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A report received now.
    pub fn record_report(&self, report: &ReportRequest) {
        let now = self.clock.now();
        self.lock().record_report(report, now);
    }

    /// The fleet's answers for the fleet breakers of a report, now.
    pub fn record_fleet<'a>(
        &self,
        answered: impl IntoIterator<Item = (&'a BreakerReport, &'a Decided)>,
    ) {
        let now = self.clock.now();
        let mut view = self.lock();
        for (reported, decided) in answered {
            view.record_fleet(reported, decided, now);
        }
    }

    /// The view now.
    pub fn snapshot(&self) -> Snapshot {
        let now = self.clock.now();
        self.lock().snapshot(now)
    }
}

/// Who may read the fleet view (`GET /v1/view`). Never open by default: without a secret
/// of its own it takes the service's, and a service without one (`--insecure-no-auth`)
/// shows it to nobody unless told `--insecure-open-view`.
#[derive(Debug, Clone)]
pub enum ViewAccess {
    /// The service's secrets (the gateways' credential).
    Service,
    /// These read-only secrets (`--view-token-file`), and the service's.
    Tokens(Arc<Auth>),
    /// Anyone (`--insecure-open-view`: loopback demos).
    Open,
}

impl ViewAccess {
    /// Checks a request's `authorization` against the view's secrets, then the service's
    /// (`service`, when it requires one).
    pub fn check(&self, service: &Auth, headers: &HeaderMap) -> Result<(), Rejection> {
        let by_service = || {
            if service.is_required() {
                service.check(headers)
            } else if headers.contains_key(header::AUTHORIZATION) {
                Err(Rejection::Invalid)
            } else {
                Err(Rejection::Missing)
            }
        };
        match self {
            ViewAccess::Open => Ok(()),
            ViewAccess::Service => by_service(),
            ViewAccess::Tokens(view) => view.check(headers).or_else(|_| by_service()),
        }
    }

    /// Whether anyone can read the view.
    pub fn is_open(&self) -> bool {
        matches!(self, ViewAccess::Open)
    }
}
