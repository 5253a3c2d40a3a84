//! The binding on a fake Envoy (`fake.rs`: a main thread and two worker threads that keep
//! Envoy 1.40's rules): what it asks of Envoy, in order, for each way a request is paused
//! and resumed, and that it leaves nothing behind.

use crate::envoy::HeadersStatus::{Continue, StopAllAndWatermark};
use crate::fake::{ConfigId, Envoy, On, Owner, Seen, StreamId};
use crate::filter::{Census, DEFERRED_EVENT as DEFERRED};
use crate::timer::TICK_EVENT;

/// A global rule of `limit` a minute, `lease` tokens a call.
fn global(limit: u32, lease: u32) -> String {
    format!(
        "resources:\n  - Url: /\n    rules: [{{rpu: {limit}, unit: minute, scope: global, lease: {lease}}}]\nglobal: {{cluster: diana_quota}}\n"
    )
}

/// A local leaky bucket: 2 a second, so one request every 500 ms (a second request sent
/// right after the first waits, however slow the machine).
const LEAKY: &str = "resources:\n  - Url: /\n    rules: [{algo: LB, rpu: 2, unit: second}]\n";

fn configure(envoy: &Envoy, document: &str) -> ConfigId {
    match envoy.configure(document) {
        Some(config) => config,
        None => panic!("document refused: {document}"),
    }
}

/// Nothing left behind (no stream is left) and no rule broken.
fn assert_clean(envoy: &Envoy, config: ConfigId) {
    assert_eq!(
        envoy.census(config),
        Census::default(),
        "{}",
        envoy.report()
    );
    assert_eq!(envoy.schedulers().0, 0, "{}", envoy.report());
    assert_no_violation(envoy);
}

/// Ends these streams, then nothing is left behind.
fn end_clean(envoy: &Envoy, config: ConfigId, streams: &[StreamId]) {
    for stream in streams {
        envoy.end(*stream);
    }
    assert_clean(envoy, config);
}

fn assert_no_violation(envoy: &Envoy) {
    assert_eq!(
        envoy.violations(),
        Vec::<String>::new(),
        "{}",
        envoy.report()
    );
}

/// Admitted by its headers hook, nothing else asked.
fn admitted(stream: StreamId) -> [Seen; 1] {
    [Seen::Headers {
        stream,
        status: Continue,
    }]
}

/// Paused by its headers hook, with a scheduler for whoever resumes it.
fn paused(stream: StreamId) -> [Seen; 2] {
    [
        Seen::SchedulerNew { stream },
        Seen::Headers {
            stream,
            status: StopAllAndWatermark,
        },
    ]
}

/// Paused for its own call (the first of its stream), made from worker `worker`.
fn calling(stream: StreamId, worker: usize) -> [Seen; 3] {
    let [scheduler, headers] = paused(stream);
    [
        Seen::Callout {
            owner: Owner::Stream(stream),
            id: 1,
            endpoint: "acquire".to_string(),
            on: On::Worker(worker),
        },
        scheduler,
        headers,
    ]
}

/// The first call of `owner` answered (`answered`: with headers).
fn answered(owner: Owner, answered: bool) -> Seen {
    Seen::Answered {
        owner,
        id: 1,
        answered,
    }
}

/// Resumed from the main thread: its scheduler committed there, the event run on its own
/// thread, and there it continued.
fn resumed_from_main(stream: StreamId) -> [Seen; 3] {
    [
        Seen::Commit {
            stream,
            event: DEFERRED,
            on: On::Main,
        },
        Seen::Scheduled {
            stream,
            event: DEFERRED,
        },
        Seen::Continue { stream },
    ]
}

/// The configuration's tick committed from `on`.
fn tick_from(config: ConfigId, on: On) -> Seen {
    Seen::ConfigCommit {
        config,
        event: TICK_EVENT,
        on,
    }
}

/// The first refill ahead: a callout of the configuration, from the main thread.
fn refill(config: ConfigId) -> Seen {
    Seen::Callout {
        owner: Owner::Config(config),
        id: 1,
        endpoint: "acquire".to_string(),
        on: On::Main,
    }
}

/// Where `wanted` is in the log.
fn position(envoy: &Envoy, wanted: &Seen) -> Option<usize> {
    envoy.seen().iter().position(|seen| seen == wanted)
}

/// Waits for `stream`'s event `seen`, and returns the stream's log.
fn wait_for(envoy: &Envoy, stream: StreamId, seen: Seen) -> Vec<Seen> {
    envoy.wait_until(&format!("{seen:?}"), |log| log.contains(&seen));
    envoy.seen_by(stream)
}

#[test]
fn a_global_request_pauses_for_its_own_call_and_resumes_when_it_is_answered() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, &global(100, 1));
    let a = envoy.request(0, "/", "10.0.0.1");
    assert_eq!(envoy.seen_by(a), calling(a, 0), "{}", envoy.report());
    envoy.answer(Owner::Stream(a), 1);
    envoy.respond(a, &[(":status", "200")]);
    envoy.end(a);
    assert_eq!(
        envoy.seen_by(a)[3..],
        [
            answered(Owner::Stream(a), true),
            Seen::Continue { stream: a },
            Seen::ResponseHeaders { stream: a },
            Seen::SchedulerDeleted { stream: a },
            Seen::Destroyed { stream: a },
        ],
        "{}",
        envoy.report()
    );
    assert_clean(&envoy, config);
}

#[test]
fn a_leaky_bucket_wait_is_resumed_from_the_main_threads_tick_through_the_streams_scheduler() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, LEAKY);
    let sent = std::time::Instant::now();
    let a = envoy.request(1, "/", "10.0.0.1");
    let b = envoy.request(1, "/", "10.0.0.1");
    assert_eq!(envoy.seen_by(a), admitted(a));
    let log = wait_for(&envoy, b, Seen::Continue { stream: b });
    // Its turn came 500 ms after the first request's, not before.
    assert!(sent.elapsed() >= std::time::Duration::from_millis(490));
    assert_eq!(log[..2], paused(b), "{}", envoy.report());
    assert_eq!(log[2..], resumed_from_main(b), "{}", envoy.report());
    // The wait asked for a finer tick: the timer thread posted it to the main thread.
    let ticked = position(&envoy, &tick_from(config, On::Elsewhere));
    let [resumed, ..] = resumed_from_main(b);
    assert!(
        ticked.is_some() && ticked < position(&envoy, &resumed),
        "{}",
        envoy.report()
    );
    end_clean(&envoy, config, &[a, b]);
}

#[test]
fn a_request_parked_behind_another_streams_call_is_resumed_from_the_main_thread() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, &global(1000, 10));
    // `a` calls for the worker's lease; `c`, on the same worker meanwhile, rides on it.
    let a = envoy.request(0, "/", "10.0.0.1");
    let c = envoy.request(0, "/", "10.0.0.3");
    assert_eq!(envoy.seen_by(c), paused(c), "{}", envoy.report());
    assert_eq!(envoy.callouts().len(), 1, "{}", envoy.report());
    envoy.answer(Owner::Stream(a), 1);
    let log = wait_for(&envoy, c, Seen::Continue { stream: c });
    // `a` is resumed by its own answer, in its own hook; `c` from the tick the answer
    // asked for at once (from worker 0, not the timer), through its scheduler.
    assert_eq!(
        envoy.seen_by(a)[3..],
        [
            answered(Owner::Stream(a), true),
            Seen::Continue { stream: a }
        ],
        "{}",
        envoy.report()
    );
    assert_eq!(log[2..], resumed_from_main(c), "{}", envoy.report());
    let asked = position(&envoy, &tick_from(config, On::Worker(0)));
    let landed = position(&envoy, &answered(Owner::Stream(a), true));
    assert!(asked.is_some() && landed < asked, "{}", envoy.report());
    end_clean(&envoy, config, &[a, c]);
}

#[test]
fn a_stream_destroyed_while_paused_for_its_call_has_the_call_cancelled_and_leaves_nothing() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, &global(100, 1));
    let a = envoy.request(1, "/", "10.0.0.1");
    envoy.end(a);
    assert_eq!(envoy.seen_by(a)[..3], calling(a, 1));
    assert_eq!(
        envoy.seen_by(a)[3..],
        [
            Seen::SchedulerDeleted { stream: a },
            Seen::Destroyed { stream: a },
            Seen::Cancelled {
                owner: Owner::Stream(a),
                id: 1
            },
        ],
        "{}",
        envoy.report()
    );
    assert!(envoy.callouts().is_empty());
    assert_clean(&envoy, config);
    // The worker is not stuck: the next request calls and is answered.
    let b = envoy.request(1, "/", "10.0.0.1");
    envoy.answer(Owner::Stream(b), 1);
    assert!(envoy.seen_by(b).contains(&Seen::Continue { stream: b }));
    end_clean(&envoy, config, &[b]);
}

#[test]
fn an_event_scheduled_for_a_stream_destroyed_meanwhile_is_dropped() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, LEAKY);
    let a = envoy.request(0, "/", "10.0.0.1");
    // The main thread cannot tick until released, and then worker 0 runs nothing until
    // released: `b`'s end is queued on worker 0 before anything the tick posts there.
    let main = envoy.hold(On::Main);
    let b = envoy.request(0, "/", "10.0.0.1");
    let worker = envoy.hold(On::Worker(0));
    envoy.end_later(b);
    drop(main);
    let [committed, ..] = resumed_from_main(b);
    envoy.wait_until("b's resume committed", |log| log.contains(&committed));
    drop(worker);
    let log = wait_for(
        &envoy,
        b,
        Seen::Dropped {
            stream: b,
            event: DEFERRED,
        },
    );
    assert_eq!(
        log[2..],
        [
            committed,
            Seen::SchedulerDeleted { stream: b },
            Seen::Destroyed { stream: b },
            Seen::Dropped {
                stream: b,
                event: DEFERRED
            },
        ],
        "{}",
        envoy.report()
    );
    end_clean(&envoy, config, &[a]);
}

/// A global rule with a lease of 10, on worker 0, until the main thread calls for a refill
/// ahead: the configuration and the streams sent.
fn until_refill_ahead(envoy: &Envoy) -> (ConfigId, Vec<StreamId>) {
    let config = configure(envoy, &global(1000, 10));
    let first = envoy.request(0, "/", "10.0.0.1");
    envoy.answer(Owner::Stream(first), 1);
    // The lease is spent from the stash, without calls, until it runs low: then the
    // worker asks for the tick at once, and the main thread's tick calls for more.
    let mut sent = vec![first];
    for _ in 0..5 {
        let stream = envoy.request(0, "/", "10.0.0.1");
        assert_eq!(envoy.seen_by(stream), admitted(stream));
        sent.push(stream);
    }
    envoy.wait_until("the refill ahead", |log| log.contains(&refill(config)));
    (config, sent)
}

#[test]
fn a_refill_ahead_is_a_callout_of_the_configuration_made_and_answered_on_the_main_thread() {
    let envoy = Envoy::start(2);
    let (config, mut sent) = until_refill_ahead(&envoy);
    let asked = position(&envoy, &tick_from(config, On::Worker(0)));
    let called = position(&envoy, &refill(config));
    assert!(asked.is_some() && asked < called, "{}", envoy.report());
    // Answered on the main thread (`answer` returns once its hook has run there).
    envoy.answer(Owner::Config(config), 1);
    assert!(envoy
        .seen()
        .contains(&answered(Owner::Config(config), true)));
    // Its tokens serve the next requests: no stream calls again.
    for _ in 0..8 {
        let stream = envoy.request(0, "/", "10.0.0.1");
        sent.push(stream);
        assert_eq!(
            envoy.seen_by(stream),
            admitted(stream),
            "{}",
            envoy.report()
        );
    }
    // Whatever else the main thread calls for, it calls for from the main thread.
    for pending in envoy.callouts() {
        assert_eq!(pending.owner, Owner::Config(config));
    }
    for stream in sent {
        envoy.end(stream);
    }
    assert_eq!(envoy.census(config).requests, 0, "{}", envoy.report());
    assert_no_violation(&envoy);
}

#[test]
fn a_reload_leaves_the_old_configurations_streams_to_it_and_frees_it_after_its_destroy() {
    let envoy = Envoy::start(2);
    let old = configure(&envoy, LEAKY);
    let a = envoy.request(0, "/", "10.0.0.1");
    let b = envoy.request(0, "/", "10.0.0.1");
    // Replaced while `b` waits in the old configuration's worker.
    let new = configure(
        &envoy,
        "resources:\n  - Url: /\n    rules: [{rpu: 1, unit: minute}]\n",
    );
    assert_ne!(old, new);
    let c = envoy.request(0, "/", "10.0.0.9");
    let d = envoy.request(0, "/", "10.0.0.9");
    assert_eq!(envoy.seen_by(c), admitted(c));
    // The new document's limit, 1 a minute: `d` is answered, inside its headers hook.
    assert!(
        matches!(
            envoy.seen_by(d).first(),
            Some(Seen::Reply { status: 503, .. })
        ),
        "{}",
        envoy.report()
    );
    // The old configuration still ticks for `b`.
    let log = wait_for(&envoy, b, Seen::Continue { stream: b });
    assert_eq!(log[2..], resumed_from_main(b), "{}", envoy.report());
    end_clean(&envoy, old, &[a, b, c]);
    envoy.destroy_config(old);
    let deleted = position(&envoy, &Seen::ConfigSchedulerDeleted { config: old });
    let destroyed = position(&envoy, &Seen::ConfigDestroyed { config: old });
    assert!(
        deleted.is_some() && deleted < destroyed,
        "{}",
        envoy.report()
    );
    // Worker 0 lets go of the old configuration's worker at its next stream.
    assert!(!envoy.freed(old));
    let e = envoy.request(0, "/", "10.0.0.10");
    envoy.end(e);
    assert!(envoy.freed(old), "{}", envoy.report());
    // Nothing of the old configuration ran after its destroy.
    let after = &envoy.seen()[destroyed.unwrap_or(0)..];
    assert!(
        !after.contains(&Seen::ConfigScheduled {
            config: old,
            event: TICK_EVENT
        }),
        "{}",
        envoy.report()
    );
    assert_clean(&envoy, new);
    // The new configuration's scheduler is the only one left.
    assert_eq!(envoy.schedulers(), (0, 1));
}

#[test]
fn a_configuration_destroyed_with_callouts_in_flight_has_them_cancelled() {
    let envoy = Envoy::start(2);
    let (config, sent) = until_refill_ahead(&envoy);
    // The tick that called has filed its call once its hook is over.
    envoy.sync(On::Main);
    for stream in sent {
        envoy.end(stream);
    }
    assert_eq!(envoy.census(config).main_calls, 1, "{}", envoy.report());
    assert!(envoy.holds_scheduler(config));
    // Envoy replaces it: the new one takes the streams, the old one goes.
    let next = configure(&envoy, &global(1000, 10));
    envoy.destroy_config(config);
    let deleted = position(&envoy, &Seen::ConfigSchedulerDeleted { config });
    let destroyed = position(&envoy, &Seen::ConfigDestroyed { config });
    let cancelled = position(
        &envoy,
        &Seen::Cancelled {
            owner: Owner::Config(config),
            id: 1,
        },
    );
    assert!(
        deleted.is_some() && deleted < destroyed && destroyed < cancelled,
        "{}",
        envoy.report()
    );
    assert!(envoy.callouts().is_empty(), "{}", envoy.report());
    // Worker 0 used it: it lets go of it at its next stream.
    let next_stream = envoy.request(0, "/", "10.0.0.1");
    envoy.end(next_stream);
    assert!(envoy.freed(config), "{}", envoy.report());
    assert_no_violation(&envoy);
    assert!(envoy.holds_scheduler(next));
}

#[test]
fn a_local_reply_that_ends_the_stream_inside_its_hook_leaves_nothing_to_do_on_it() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, &global(1, 1));
    let a = envoy.request(0, "/", "10.0.0.1");
    envoy.answer(Owner::Stream(a), 1);
    let b = envoy.request(0, "/", "10.0.0.1");
    envoy.answer(Owner::Stream(b), 1);
    // `b` is over the limit: its reply, sent from its callout hook, ends it there, and its
    // destroy runs inside the reply.
    assert_eq!(
        envoy.seen_by(b)[3..],
        [
            answered(Owner::Stream(b), true),
            Seen::Reply {
                stream: b,
                status: 503
            },
            Seen::SchedulerDeleted { stream: b },
            Seen::Destroyed { stream: b },
        ],
        "{}",
        envoy.report()
    );
    end_clean(&envoy, config, &[a]);
}

#[test]
fn the_main_threads_tick_and_the_worker_threads_requests_race_on_the_workers_safely() {
    const EACH: usize = 30;
    let envoy = Envoy::start(2);
    // 200 a second: a request every 5 ms, so most wait for a turn the tick gives them,
    // while more arrive on both worker threads.
    let config = configure(
        &envoy,
        "resources:\n  - Url: /\n    rules: [{algo: LB, rpu: 200, unit: second}]\n",
    );
    let sent: Vec<Vec<StreamId>> = std::thread::scope(|scope| {
        let senders: Vec<_> = (0..2)
            .map(|worker| {
                let envoy = &envoy;
                scope.spawn(move || {
                    (0..EACH)
                        .map(|n| envoy.request(worker, "/", &format!("10.0.{worker}.{n}")))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        senders
            .into_iter()
            .map(|sender| sender.join().unwrap_or_default())
            .collect()
    });
    let all: Vec<StreamId> = sent.iter().flatten().copied().collect();
    assert_eq!(all.len(), 2 * EACH);
    envoy.wait_until("every request resumed or answered", |log| {
        all.iter().all(|stream| {
            log.iter().any(|seen| {
                *seen == Seen::Continue { stream: *stream }
                    || admitted(*stream).contains(seen)
                    || matches!(seen, Seen::Reply { stream: s, .. } if s == stream)
            })
        })
    });
    let mut waited = 0;
    for (worker, streams) in sent.iter().enumerate() {
        let mut resumed = Vec::new();
        for &stream in streams {
            let log = envoy.seen_by(stream);
            if log.len() == 5 && log[..2] == paused(stream) && log[2..] == resumed_from_main(stream)
            {
                resumed.push(stream);
            } else {
                assert!(
                    log == admitted(stream) || matches!(log.first(), Some(Seen::Reply { .. })),
                    "worker {worker}, stream {stream}: {log:?}\n{}",
                    envoy.report()
                );
            }
        }
        // Each worker's waiters are resumed in the order they came.
        let order: Vec<usize> = envoy
            .seen()
            .iter()
            .filter_map(|seen| match seen {
                Seen::Continue { stream } => resumed.iter().position(|s| s == stream),
                _ => None,
            })
            .collect();
        assert!(order.windows(2).all(|pair| pair[0] < pair[1]), "{order:?}");
        waited += resumed.len();
    }
    assert!(waited > EACH, "most requests waited for a turn: {waited}");
    for stream in all {
        envoy.end(stream);
    }
    assert_clean(&envoy, config);
}

/// A callout that fails (reset, timeout) comes back without headers: the worker reads it
/// as unanswered, and the rule is enforced locally meanwhile (README: degrade).
#[test]
fn a_failed_call_reaches_its_stream_unanswered_and_the_request_goes_on() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, &global(100, 1));
    let a = envoy.request(1, "/", "10.0.0.1");
    envoy.fail(Owner::Stream(a), 1);
    assert_eq!(
        envoy.seen_by(a)[3..],
        [
            answered(Owner::Stream(a), false),
            Seen::Continue { stream: a },
        ],
        "{}",
        envoy.report()
    );
    end_clean(&envoy, config, &[a]);
}

/// A breaker's `fallback_header` that a client sends is removed, and Envoy chooses the
/// route again: a route on that header must not follow the client's own value (the wasm
/// host clears the route on every header edit; a dynamic module must ask).
#[test]
fn a_header_diana_edits_has_envoy_choose_the_route_again() {
    let envoy = Envoy::start(2);
    let document = "resources:\n  - Url: /dep\n    breaker: {name: dep, failure_ratio: 0.5, fallback_header: x-diana-fallback}\n";
    let config = configure(&envoy, document);
    let forged = envoy.request_with(0, "/dep", "10.0.0.1", &[("x-diana-fallback", "dep")]);
    let plain = envoy.request(0, "/other", "10.0.0.1");
    let seen = envoy.seen();
    let cleared = |stream| {
        seen.iter()
            .position(|s| *s == crate::fake::Seen::RouteCleared { stream })
    };
    let headers = |stream| {
        seen.iter().position(
            |s| matches!(s, crate::fake::Seen::Headers { stream: at, .. } if *at == stream),
        )
    };
    assert!(
        cleared(forged).is_some_and(|at| headers(forged).is_some_and(|h| at < h)),
        "{}",
        envoy.report()
    );
    // No breaker on the path: nothing edited, nothing to choose again.
    assert_eq!(cleared(plain), None, "{}", envoy.report());
    end_clean(&envoy, config, &[forged, plain]);
}

/// A stream its worker settles at its response headers (a breaker's call judged) and
/// then no longer tracks ends without its worker's lock; one that still holds something
/// for its end (a `max_in_flight` place) takes it once more, to give it back. A stream
/// the worker never tracked takes it only for its request headers.
#[test]
fn a_stream_settled_at_its_response_headers_ends_without_its_workers_lock() {
    let envoy = Envoy::start(2);
    let document = "resources:\n  - Url: /dep\n    breaker: {name: dep, failure_ratio: 0.5}\n  - Url: /inside\n    rules: [{max_in_flight: 5}]\n  - Url: /plain\n    rules: [{rpu: 1000}]\n";
    let config = configure(&envoy, document);
    // (path, events under the lock: request headers, response headers, end)
    for (path, events) in [("/dep", 2), ("/inside", 3), ("/plain", 1)] {
        let before = envoy.stream_events(config);
        let stream = envoy.request(0, path, "10.0.0.1");
        envoy.respond(stream, &[(":status", "200")]);
        envoy.end(stream);
        envoy.sync(On::Worker(0));
        assert_eq!(
            envoy.stream_events(config) - before,
            events,
            "{path}: {}",
            envoy.report()
        );
    }
    assert_clean(&envoy, config);
}
