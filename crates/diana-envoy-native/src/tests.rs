//! The binding on a fake Envoy (`fake.rs`: a main thread and two worker threads that keep
//! Envoy 1.40's rules): what it asks of Envoy, in order, for each way a request is paused
//! and resumed, and that it leaves nothing behind.

use crate::envoy::BodyStatus::{self, StopIterationAndBuffer};
use crate::envoy::HeadersStatus::{Continue, StopAllAndWatermark, StopIteration};
use crate::envoy::TrailersStatus;
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

/// An LLM budget (issue 42): 1000 tokens a minute, each answer charged the tokens its JSON
/// body says it used.
const TOKENS: &str = "resources:\n  - Url: /\n    rules: [{rpu: 1000, unit: minute, response_cost: {json: usage.total_tokens}}]\n";

const JSON_ANSWER: [(&str, &str); 2] = [(":status", "200"), ("content-type", "application/json")];

/// How often the module read a stream's body chunks.
fn body_reads(envoy: &Envoy, stream: StreamId) -> usize {
    envoy
        .seen_by(stream)
        .iter()
        .filter(|seen| **seen == Seen::BodyRead { stream })
        .count()
}

/// The body hooks that ran on a stream, in order (`end_of_stream` of each).
fn body_hooks(envoy: &Envoy, stream: StreamId) -> Vec<bool> {
    envoy
        .seen_by(stream)
        .iter()
        .filter_map(|seen| match seen {
            Seen::ResponseBody { end_of_stream, .. } => Some(*end_of_stream),
            _ => None,
        })
        .collect()
}

/// Whether a stream's request went on (its headers hook answered `Continue`; the worker may
/// have edited its headers first: `accept-encoding` goes where the answer's usage is read).
fn went_on(envoy: &Envoy, stream: StreamId) -> bool {
    envoy.seen_by(stream).contains(&Seen::Headers {
        stream,
        status: Continue,
    })
}

/// Whether a stream's request was refused by a local reply.
fn refused(envoy: &Envoy, stream: StreamId) -> bool {
    envoy
        .seen_by(stream)
        .iter()
        .any(|seen| matches!(seen, Seen::Reply { .. }))
}

/// The body's usage is split across chunks, and one chunk across slices: only read whole
/// and in order, and ended by the last chunk's hook, does it say 2500 tokens, which leaves
/// the next request of the client over the budget while the first stream is still there.
#[test]
fn a_chunked_answer_reaches_the_worker_in_order_and_ends_with_its_last_chunk() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, TOKENS);
    let a = envoy.request(0, "/", "10.0.0.1");
    assert!(went_on(&envoy, a), "{}", envoy.report());
    let asked = envoy.seen_by(a).len();
    envoy.respond_with_body(a, &JSON_ANSWER);
    envoy.body(a, &["{\"usage\":{\"total_", "tokens\":25"], false);
    envoy.body(a, &["00}}"], false);
    envoy.body(a, &[], true);
    // Each chunk was read in its own hook, once, and went on.
    assert_eq!(
        envoy.seen_by(a)[asked..],
        [
            Seen::ResponseHeaders { stream: a },
            Seen::BodyRead { stream: a },
            Seen::ResponseBody {
                stream: a,
                end_of_stream: false
            },
            Seen::BodyRead { stream: a },
            Seen::ResponseBody {
                stream: a,
                end_of_stream: false
            },
            Seen::BodyRead { stream: a },
            Seen::ResponseBody {
                stream: a,
                end_of_stream: true
            },
        ],
        "{}",
        envoy.report()
    );
    let b = envoy.request(0, "/", "10.0.0.1");
    assert!(refused(&envoy, b), "{}", envoy.report());
    end_clean(&envoy, config, &[a]);
}

/// Trailers end a body whose last chunk did not say so (HTTP/2, gRPC).
#[test]
fn an_answer_with_trailers_ends_its_body_at_the_trailers() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, TOKENS);
    let a = envoy.request(1, "/", "10.0.0.1");
    envoy.respond_with_body(a, &JSON_ANSWER);
    envoy.body(a, &["{\"usage\":{\"total_tokens\":2500}}"], false);
    envoy.trailers(a);
    assert_eq!(body_reads(&envoy, a), 1, "{}", envoy.report());
    assert!(envoy
        .seen_by(a)
        .ends_with(&[Seen::ResponseTrailers { stream: a }]));
    let b = envoy.request(1, "/", "10.0.0.1");
    assert!(refused(&envoy, b), "{}", envoy.report());
    end_clean(&envoy, config, &[a]);
}

/// A body the worker does not read is never read (no host call, no copy) and passes whole:
/// a request the worker stopped tracking at its headers (a local rule), and one it tracked
/// until its answer (a global rule's own call) but charges nothing from the body.
#[test]
fn a_body_the_worker_does_not_read_is_never_read() {
    for (document, calls) in [(LEAKY.to_string(), false), (global(100, 1), true)] {
        let envoy = Envoy::start(2);
        let config = configure(&envoy, &document);
        let a = envoy.request(0, "/", "10.0.0.1");
        if calls {
            envoy.answer(Owner::Stream(a), 1);
        }
        envoy.respond_with_body(a, &JSON_ANSWER);
        envoy.body(a, &["{\"usage\":", "{\"total_tokens\":2500}}"], false);
        envoy.body(a, &["\n"], false);
        envoy.trailers(a);
        assert_eq!(body_reads(&envoy, a), 0, "{document}\n{}", envoy.report());
        assert_eq!(body_hooks(&envoy, a), [false, false], "{}", envoy.report());
        end_clean(&envoy, config, &[a]);
    }
}

/// The client leaves in the middle of the answer: Envoy destroys the stream between two
/// chunks (its stream-complete hook, then its destroy) and runs nothing of it after; the
/// worker is told the request is gone and holds nothing for it.
#[test]
fn a_request_destroyed_in_the_middle_of_its_body_leaves_nothing_behind() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, TOKENS);
    let a = envoy.request(0, "/", "10.0.0.1");
    envoy.respond_with_body(a, &JSON_ANSWER);
    envoy.body(a, &["{\"usage\":{\"total_tokens\":"], false);
    assert_eq!(envoy.census(config).requests, 1, "{}", envoy.report());
    envoy.end(a);
    // A chunk that was on its way is dropped with the stream.
    envoy.body(a, &["2500}}"], true);
    assert_eq!(body_reads(&envoy, a), 1, "{}", envoy.report());
    assert_eq!(body_hooks(&envoy, a), [false], "{}", envoy.report());
    assert_clean(&envoy, config);
    // The worker goes on: the next request of the client is decided.
    let b = envoy.request(0, "/", "10.0.0.1");
    assert!(
        went_on(&envoy, b) || refused(&envoy, b),
        "{}",
        envoy.report()
    );
    end_clean(&envoy, config, &[b]);
}

/// An answer of headers alone (a HEAD, a 204) ends its body at the headers: nothing to read.
#[test]
fn an_answer_without_a_body_ends_at_its_headers() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, TOKENS);
    let a = envoy.request(0, "/", "10.0.0.1");
    envoy.respond(a, &[(":status", "204")]);
    assert_eq!(body_reads(&envoy, a), 0, "{}", envoy.report());
    end_clean(&envoy, config, &[a]);
}

/// An LLM budget that reserves each request's `max_tokens` from its JSON body up front (issue
/// 42, "Reservations"): 1000 tokens an hour per account at `/llm`; `/plain` reads no body.
const RESERVE: &str = "resources:\n  - Url: /llm\n    rules: [{name: llm, actor: account, unit: hour, rpu: 1000, algo: W, response_cost: {usage: openai, reserve: {json: max_tokens, default: 100, min: 1, max: 1000}}}]\n  - Url: /plain\n    rules: [{rpu: 100, unit: minute}]\n";

/// [`RESERVE`]'s budget in global scope, asked of the quota service (a lease of at least the
/// reservation's `max`).
const RESERVE_GLOBAL: &str = "resources:\n  - Url: /llm\n    rules: [{name: llm, actor: account, unit: hour, rpu: 1000, algo: W, scope: global, lease: 1000, response_cost: {usage: openai, reserve: {json: max_tokens, default: 100, min: 1, max: 1000}}}]\nglobal: {cluster: diana_quota}\n";

const ALICE: [(&str, &str); 1] = [("x-account-id", "alice")];

/// Held at its headers for its body: they stop alone, and no scheduler is made for it.
fn held(stream: StreamId) -> Seen {
    Seen::Headers {
        stream,
        status: StopIteration,
    }
}

/// A request-body hook that read its chunk and answered `status`.
fn chunk_read(stream: StreamId, end_of_stream: bool, status: BodyStatus) -> [Seen; 2] {
    [
        Seen::RequestBodyRead { stream },
        Seen::RequestBody {
            stream,
            end_of_stream,
            status,
        },
    ]
}

/// The request-body hooks that ran on a stream, in order: `end_of_stream` and the status of
/// each.
fn request_body_hooks(envoy: &Envoy, stream: StreamId) -> Vec<(bool, BodyStatus)> {
    envoy
        .seen_by(stream)
        .iter()
        .filter_map(|seen| match seen {
            Seen::RequestBody {
                end_of_stream,
                status,
                ..
            } => Some((*end_of_stream, *status)),
            _ => None,
        })
        .collect()
}

/// How often the module read a stream's request body chunks.
fn request_body_reads(envoy: &Envoy, stream: StreamId) -> usize {
    envoy
        .seen_by(stream)
        .iter()
        .filter(|seen| **seen == Seen::RequestBodyRead { stream })
        .count()
}

/// Alice asks `/llm` on worker `worker` for `max_tokens`, in a body of one chunk.
fn ask(envoy: &Envoy, worker: usize, max_tokens: u32) -> StreamId {
    let stream = envoy.request_with_body(worker, "/llm", "10.0.0.1", &ALICE);
    envoy.request_body(stream, &[&format!("{{\"max_tokens\":{max_tokens}}}")], true);
    stream
}

/// Whether a request held for its body was admitted at its end (its last body hook answered
/// `Continue`, which sends it on).
fn admitted_at_its_end(envoy: &Envoy, stream: StreamId) -> bool {
    request_body_hooks(envoy, stream).last() == Some(&(true, BodyStatus::Continue))
}

/// The body's `max_tokens` is split across chunks, and one chunk across slices: the request
/// waits at its headers (`StopIteration`, so that its body still comes to the filter), each
/// chunk is read in its own hook and buffered by Envoy (`StopIterationAndBuffer`), and only
/// the last one decides it: admitted (`Continue` sends it on, its `accept-encoding` removed
/// first, as for any request whose answer's usage is read), reserving 700 of the account's
/// 1000. So 301 more do not fit (a local reply from the body hook), 300 do.
#[test]
fn a_request_held_for_its_body_is_decided_at_its_end_reserving_what_the_body_says() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, RESERVE);
    let a = envoy.request_with_body(0, "/llm", "10.0.0.1", &ALICE);
    assert_eq!(envoy.seen_by(a), [held(a)], "{}", envoy.report());
    envoy.request_body(a, &["{\"model\":\"m\",\"max_", "tok"], false);
    envoy.request_body(a, &["ens\":7"], false);
    assert_eq!(envoy.census(config).requests, 1, "{}", envoy.report());
    envoy.request_body(a, &["00}"], true);
    let [first_read, first] = chunk_read(a, false, StopIterationAndBuffer);
    let [last_read, last] = chunk_read(a, true, BodyStatus::Continue);
    assert_eq!(
        envoy.seen_by(a),
        [
            held(a),
            first_read.clone(),
            first.clone(),
            first_read,
            first,
            last_read,
            Seen::RouteCleared { stream: a },
            last,
        ],
        "{}",
        envoy.report()
    );
    let b = ask(&envoy, 0, 301);
    assert_eq!(
        envoy.seen_by(b),
        [
            held(b),
            Seen::RequestBodyRead { stream: b },
            Seen::Reply {
                stream: b,
                status: 503
            },
            Seen::Destroyed { stream: b },
            Seen::RequestBody {
                stream: b,
                end_of_stream: true,
                status: StopIterationAndBuffer
            },
        ],
        "{}",
        envoy.report()
    );
    // The budget is the process's: another worker thread sees the same reservation.
    let c = ask(&envoy, 1, 300);
    assert!(admitted_at_its_end(&envoy, c), "{}", envoy.report());
    assert!(refused(&envoy, ask(&envoy, 1, 1)), "{}", envoy.report());
    end_clean(&envoy, config, &[a, c]);
}

/// Trailers end a held request's body whose last chunk did not say so: the request is decided
/// at its trailers (and goes on with them).
#[test]
fn a_held_requests_trailers_end_its_body_and_decide_it() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, RESERVE);
    let a = envoy.request_with_body(1, "/llm", "10.0.0.1", &ALICE);
    envoy.request_body(a, &["{\"max_tokens\":700}"], false);
    envoy.request_trailers(a);
    let [read, chunk] = chunk_read(a, false, StopIterationAndBuffer);
    assert_eq!(
        envoy.seen_by(a),
        [
            held(a),
            read,
            chunk,
            Seen::RouteCleared { stream: a },
            Seen::RequestTrailers {
                stream: a,
                status: TrailersStatus::Continue
            },
        ],
        "{}",
        envoy.report()
    );
    assert!(refused(&envoy, ask(&envoy, 1, 301)), "{}", envoy.report());
    end_clean(&envoy, config, &[a]);
}

/// A request that comes without a body (`end_of_stream` at its headers) is decided at its
/// headers, reserving the rule's `default` (100): 900 more fit, 901 do not.
#[test]
fn a_request_without_a_body_is_decided_at_its_headers() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, RESERVE);
    let a = envoy.request_with(0, "/llm", "10.0.0.1", &ALICE);
    assert_eq!(
        envoy.seen_by(a),
        [
            Seen::RouteCleared { stream: a },
            Seen::Headers {
                stream: a,
                status: Continue
            },
        ],
        "{}",
        envoy.report()
    );
    assert!(refused(&envoy, ask(&envoy, 0, 901)), "{}", envoy.report());
    let c = ask(&envoy, 0, 900);
    assert!(admitted_at_its_end(&envoy, c), "{}", envoy.report());
    end_clean(&envoy, config, &[a, c]);
}

/// A request with a body whose rules read none of it is never held: admitted at its headers,
/// its body hooks answer `Continue` without a lock and without reading a byte. Paused at its
/// headers for its own call (a global rule), it stops for all (`StopAllIterationAndWatermark`):
/// Envoy holds its body back from the filter until the answer resumes it, then hands it over
/// in one chunk, which goes on unread.
#[test]
fn a_request_whose_rules_read_no_body_is_never_held_and_its_body_is_not_read() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, RESERVE);
    let a = envoy.request_with_body(0, "/plain", "10.0.0.1", &ALICE);
    assert_eq!(envoy.seen_by(a), admitted(a), "{}", envoy.report());
    let locks = envoy.locks_on(On::Worker(0));
    envoy.request_body(a, &["{\"max_tokens\":", "700}"], false);
    envoy.request_body(a, &[], false);
    envoy.request_body(a, &["\n"], true);
    assert_eq!(envoy.locks_on(On::Worker(0)), locks, "{}", envoy.report());
    assert_eq!(request_body_reads(&envoy, a), 0, "{}", envoy.report());
    assert_eq!(
        request_body_hooks(&envoy, a),
        [
            (false, BodyStatus::Continue),
            (false, BodyStatus::Continue),
            (true, BodyStatus::Continue)
        ],
        "{}",
        envoy.report()
    );
    end_clean(&envoy, config, &[a]);

    let envoy = Envoy::start(2);
    let config = configure(&envoy, &global(100, 1));
    let b = envoy.request_with_body(0, "/", "10.0.0.1", &ALICE);
    assert_eq!(envoy.seen_by(b), calling(b, 0), "{}", envoy.report());
    envoy.request_body(b, &["{\"max_tokens\":", "700}"], false);
    envoy.request_body(b, &["\n"], true);
    envoy.answer(Owner::Stream(b), 1);
    assert_eq!(
        envoy.seen_by(b)[3..],
        [
            Seen::BodyHeldBack {
                stream: b,
                end_of_stream: false
            },
            Seen::BodyHeldBack {
                stream: b,
                end_of_stream: true
            },
            answered(Owner::Stream(b), true),
            Seen::Continue { stream: b },
            Seen::RequestBody {
                stream: b,
                end_of_stream: true,
                status: BodyStatus::Continue
            },
        ],
        "{}",
        envoy.report()
    );
    end_clean(&envoy, config, &[b]);
}

/// The client leaves while its request is held for its body: its destroy tells the worker,
/// which holds nothing for it (it had no scheduler, and reserved nothing: its body never
/// ended), and a chunk on its way is dropped with the stream.
#[test]
fn a_stream_destroyed_while_held_for_its_body_leaves_nothing_behind() {
    let envoy = Envoy::start(2);
    let config = configure(&envoy, RESERVE);
    let a = envoy.request_with_body(0, "/llm", "10.0.0.1", &ALICE);
    envoy.request_body(a, &["{\"max_tokens\":"], false);
    assert_eq!(envoy.census(config).requests, 1, "{}", envoy.report());
    envoy.end(a);
    envoy.request_body(a, &["700}"], true);
    let [read, chunk] = chunk_read(a, false, StopIterationAndBuffer);
    assert_eq!(
        envoy.seen_by(a),
        [held(a), read, chunk, Seen::Destroyed { stream: a }],
        "{}",
        envoy.report()
    );
    assert_clean(&envoy, config);
    // The whole budget is left.
    let b = ask(&envoy, 0, 1000);
    assert!(admitted_at_its_end(&envoy, b), "{}", envoy.report());
    end_clean(&envoy, config, &[b]);
}

/// A global budget: the request is held for its body, then its end (its last chunk, or its
/// trailers) asks the quota service for the 700 it read, from its worker thread, and pauses
/// for that call (Envoy keeps buffering; the stream gets its scheduler only now); the answer
/// resumes it (`continue_decoding` sends on its headers and the body Envoy buffered).
#[test]
fn a_global_request_held_for_its_body_calls_for_what_it_read_and_is_resumed_by_the_answer() {
    for trailers in [false, true] {
        let envoy = Envoy::start(2);
        let config = configure(&envoy, RESERVE_GLOBAL);
        let a = envoy.request_with_body(1, "/llm", "10.0.0.1", &ALICE);
        envoy.request_body(a, &["{\"max_tokens\":7", "00"], false);
        let call = Seen::Callout {
            owner: Owner::Stream(a),
            id: 1,
            endpoint: "acquire".to_string(),
            on: On::Worker(1),
        };
        let [read, chunk] = chunk_read(a, false, StopIterationAndBuffer);
        let mut wanted = vec![held(a), read.clone(), chunk];
        if trailers {
            envoy.request_body(a, &["}"], false);
            envoy.request_trailers(a);
            let [read, chunk] = chunk_read(a, false, StopIterationAndBuffer);
            wanted.extend([
                read,
                chunk,
                call,
                Seen::SchedulerNew { stream: a },
                Seen::RequestTrailers {
                    stream: a,
                    status: TrailersStatus::StopIteration,
                },
            ]);
        } else {
            envoy.request_body(a, &["}"], true);
            wanted.extend([
                read,
                call,
                Seen::SchedulerNew { stream: a },
                Seen::RequestBody {
                    stream: a,
                    end_of_stream: true,
                    status: StopIterationAndBuffer,
                },
            ]);
        }
        assert_eq!(envoy.seen_by(a), wanted, "{}", envoy.report());
        // One call, for the 700 the body said.
        let asked = envoy.callouts();
        let bodies: Vec<String> = asked
            .iter()
            .map(|pending| String::from_utf8_lossy(&pending.callout.body).into_owned())
            .collect();
        assert!(
            matches!(&bodies[..], [body] if body.contains("\"cost\":700")),
            "{asked:?}"
        );
        envoy.answer(Owner::Stream(a), 1);
        assert_eq!(
            envoy.seen_by(a)[wanted.len()..],
            [
                answered(Owner::Stream(a), true),
                Seen::RouteCleared { stream: a },
                Seen::Continue { stream: a },
            ],
            "{}",
            envoy.report()
        );
        end_clean(&envoy, config, &[a]);
    }
}

/// A closed breaker's good call is counted at its response headers without its worker's
/// lock (the stream keeps its call, `Step::watch`, and counts it in the breaker's tap): a
/// request through it takes the lock once, for its request headers, as one through no
/// breaker does. A failed call goes to the worker at its response headers, a call reset
/// before them at its end; a stream that still holds something for its end (a
/// `max_in_flight` place) takes it at its response headers and its end.
#[test]
fn a_closed_breakers_good_call_takes_no_lock_at_its_response() {
    let envoy = Envoy::start(2);
    let document = "resources:\n  - Url: /dep\n    breaker: {name: dep, failure_ratio: 0.5}\n  - Url: /inside\n    rules: [{max_in_flight: 5}]\n  - Url: /plain\n    rules: [{rpu: 1000}]\n";
    let config = configure(&envoy, document);
    // (path, its answer's status, or none: reset before it; events under the lock)
    for (path, status, events) in [
        ("/dep", Some("200"), 1),
        ("/dep", Some("503"), 2),
        ("/dep", None, 2),
        ("/inside", Some("200"), 3),
        ("/plain", Some("200"), 1),
    ] {
        let taken = locked_events_of_one(&envoy, config, path, |stream| {
            if let Some(status) = status {
                envoy.respond(stream, &[(":status", status)]);
            }
        });
        assert_eq!(taken, events, "{path} {status:?}: {}", envoy.report());
    }
    assert_clean(&envoy, config);
}

/// How many events took the lock of worker 0's slot of `config` for one request to `path`
/// there, answered by `answer` (or not: reset before its response) and ended.
fn locked_events_of_one(
    envoy: &Envoy,
    config: ConfigId,
    path: &str,
    answer: impl FnOnce(StreamId),
) -> usize {
    let before = envoy.stream_events(config);
    let stream = envoy.request(0, path, "10.0.0.1");
    answer(stream);
    envoy.end(stream);
    envoy.sync(On::Worker(0));
    envoy.stream_events(config) - before
}

/// A breaker judges a response by the status Envoy recorded for the stream (the
/// upstream's, as the router got it) where Envoy has set one, else by `:status`: a 503 the
/// upstream sent is a failure whatever `:status` became on its way back, and a `:status`
/// 503 with no code recorded is one too.
#[test]
fn a_response_is_judged_by_the_code_envoy_recorded_else_by_its_status() {
    let envoy = Envoy::start(1);
    let document = "resources:\n  - Url: /dep\n    breaker: {name: dep, failure_ratio: 0.5}\n";
    let config = configure(&envoy, document);
    // (recorded code, :status, events under the lock: a failure goes to the worker, and
    // so does every call after it until the worker's next flush)
    for (recorded, status, events) in [
        (Some(200), "503", 1),
        (None, "200", 1),
        (Some(503), "200", 2),
        (None, "503", 2),
        (None, "200", 2),
    ] {
        let taken = locked_events_of_one(&envoy, config, "/dep", |stream| match recorded {
            Some(code) => envoy.respond_recorded(stream, &[(":status", status)], code),
            None => envoy.respond(stream, &[(":status", status)]),
        });
        assert_eq!(taken, events, "{recorded:?} {status}: {}", envoy.report());
    }
    assert_clean(&envoy, config);
}

/// The good calls counted in a breaker's tap are in its window when failures come: 6 of
/// them and 4 failures (40 %) keep `failure_ratio: 0.5` closed, where the same 4 failures
/// alone open it.
#[test]
fn good_calls_counted_without_the_lock_dilute_the_failures_after_them() {
    for good in [6, 0] {
        let envoy = Envoy::start(1);
        let document = "resources:\n  - Url: /dep\n    breaker: {name: dep, failure_ratio: 0.5, min_calls: 4}\n";
        let config = configure(&envoy, document);
        for status in std::iter::repeat_n("200", good).chain(std::iter::repeat_n("503", 4)) {
            let stream = envoy.request(0, "/dep", "10.0.0.1");
            envoy.respond(stream, &[(":status", status)]);
            envoy.end(stream);
        }
        envoy.sync(On::Worker(0));
        // Past the verdict a worker caches (50 ms), the next request reads the record.
        std::thread::sleep(std::time::Duration::from_millis(60));
        let stream = envoy.request(0, "/dep", "10.0.0.1");
        envoy.sync(On::Worker(0));
        let failed_fast = envoy
            .seen_by(stream)
            .iter()
            .any(|seen| matches!(seen, Seen::Reply { status: 503, .. }));
        assert_eq!(failed_fast, good == 0, "{good} good: {}", envoy.report());
        envoy.end(stream);
        envoy.sync(On::Worker(0));
        assert_clean(&envoy, config);
    }
}
