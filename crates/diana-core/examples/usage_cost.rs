//! What reading an LLM answer's usage costs: the time to feed a 100-event stream (and a
//! JSON answer) through the usage reader, as the host's body callbacks would, measured
//! natively. Without a usage source nothing is read: the cost is zero.
//!
//! `cargo run --release -p diana-core --example usage_cost`

use diana_core::usage::{Framing, JsonPath, RequestReader, UsageReader, UsageSource};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// A chunk of generated text as the model streams it: a few words.
const WORDS: &str = "The quick brown fox jumps over";

fn openai_stream(events: usize) -> String {
    let mut body = String::new();
    for n in 0..events - 1 {
        body += &format!(
            "data: {{\"id\":\"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT\",\"object\":\"chat.completion.chunk\",\"created\":1741569952,\"model\":\"gpt-4.1-2025-04-14\",\"system_fingerprint\":\"fp_1\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{WORDS} {n}\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n"
        );
    }
    body += "data: {\"id\":\"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT\",\"object\":\"chat.completion.chunk\",\"created\":1741569952,\"model\":\"gpt-4.1-2025-04-14\",\"choices\":[],\"usage\":{\"prompt_tokens\":19,\"completion_tokens\":600,\"total_tokens\":619,\"prompt_tokens_details\":{\"cached_tokens\":0},\"completion_tokens_details\":{\"reasoning_tokens\":0}}}\n\n";
    body + "data: [DONE]\n\n"
}

fn anthropic_stream(events: usize) -> String {
    let mut body = String::from(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-sonnet-4-5\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":0,\"output_tokens\":1}}}\n\n",
    );
    for n in 0..events - 3 {
        body += &format!(
            "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"{WORDS} {n}\"}}}}\n\n"
        );
    }
    body += "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":600}}\n\n";
    body + "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
}

fn gemini_stream(events: usize) -> String {
    let mut body = String::new();
    for n in 0..events {
        body += &format!(
            "data: {{\"candidates\": [{{\"content\": {{\"parts\": [{{\"text\": \"{WORDS} {n}\"}}],\"role\": \"model\"}},\"index\": 0}}],\"usageMetadata\": {{\"promptTokenCount\": 8,\"candidatesTokenCount\": {},\"totalTokenCount\": {}}},\"modelVersion\": \"gemini-2.5-flash\"}}\r\n\r\n",
            6 * (n + 1),
            8 + 6 * (n + 1)
        );
    }
    body
}

fn openai_json() -> String {
    let content = format!("{WORDS} ").repeat(100);
    format!(
        "{{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion\",\"created\":1741569952,\"model\":\"gpt-4.1\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{content}\",\"refusal\":null}},\"finish_reason\":\"stop\"}}],\"usage\":{{\"prompt_tokens\":19,\"completion_tokens\":600,\"total_tokens\":619}}}}"
    )
}

/// One read of `body`, fed in `chunk`-byte pieces: what `--once` gives callgrind to count.
#[inline(never)]
fn read_once(source: &UsageSource, framing: Framing, body: &[u8], chunk: usize) -> bool {
    let mut reader = UsageReader::new(source, framing);
    for piece in body.chunks(chunk) {
        reader.feed(black_box(piece));
    }
    black_box(reader.finish()).is_ok()
}

/// The mean time of one read of `body`, fed in `chunk`-byte pieces.
fn time_read(source: &UsageSource, framing: Framing, body: &[u8], chunk: usize) -> Duration {
    let once = || read_once(source, framing, body, chunk);
    // Warm up, then as many rounds as fit in about half a second.
    for _ in 0..100 {
        black_box(once());
    }
    let started = Instant::now();
    let mut rounds = 0u32;
    while started.elapsed() < Duration::from_millis(500) {
        for _ in 0..100 {
            black_box(once());
        }
        rounds += 100;
    }
    started.elapsed() / rounds
}

fn main() {
    // `--once N`: read case N once, for an instruction count
    // (`valgrind --tool=callgrind --toggle-collect='*read_once*' … --once N`).
    let once: Option<usize> = std::env::args()
        .skip_while(|arg| arg != "--once")
        .nth(1)
        .and_then(|n| n.parse().ok());
    if once.is_none() {
        println!(
            "{:<34} {:>8} {:>7} {:>12} {:>9}",
            "body", "bytes", "chunks", "per read", "per KiB"
        );
    }
    let cases: Vec<(&str, UsageSource, Framing, String, usize)> = vec![
        (
            "openai, 100 events",
            UsageSource::OpenAi,
            Framing::Sse,
            openai_stream(100),
            400,
        ),
        (
            "anthropic, 100 events",
            UsageSource::Anthropic,
            Framing::Sse,
            anthropic_stream(100),
            400,
        ),
        (
            "gemini, 100 events",
            UsageSource::Gemini,
            Framing::Sse,
            gemini_stream(100),
            400,
        ),
        (
            "json: usage.total_tokens, 100 ev.",
            UsageSource::JsonPath(
                JsonPath::parse("usage.total_tokens").unwrap_or_else(|_| unreachable!()),
            ),
            Framing::Sse,
            openai_stream(100),
            400,
        ),
        (
            "openai, one JSON answer",
            UsageSource::OpenAi,
            Framing::Json,
            openai_json(),
            16 << 10,
        ),
    ];
    if let Some((_, source, framing, body, chunk)) = once.and_then(|n| cases.get(n)) {
        assert!(read_once(source, *framing, body.as_bytes(), *chunk));
        return;
    }
    for (name, source, framing, body, chunk) in cases {
        let per_read = time_read(&source, framing, body.as_bytes(), chunk);
        let per_kib = per_read.as_nanos() as f64 * 1024.0 / body.len() as f64;
        println!(
            "{name:<34} {:>8} {:>7} {:>9.1} µs {:>6.0} ns",
            body.len(),
            body.len().div_ceil(chunk),
            per_read.as_nanos() as f64 / 1000.0,
            per_kib
        );
    }
    // The request side: a reservation read after a 10 KiB prompt.
    let request = format!(
        "{{\"model\":\"gpt-4.1\",\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}],\"max_tokens\":800}}",
        "x".repeat(10 << 10)
    );
    let path = JsonPath::parse("max_tokens").unwrap_or_else(|_| unreachable!());
    let started = Instant::now();
    let rounds = 20_000u32;
    for _ in 0..rounds {
        let mut reader = RequestReader::new(&path);
        reader.feed(black_box(request.as_bytes()));
        black_box(reader.finish().ok());
    }
    let per_read = started.elapsed() / rounds;
    println!(
        "{:<34} {:>8} {:>7} {:>9.1} µs {:>6.0} ns",
        "request max_tokens, 10 KiB prompt",
        request.len(),
        1,
        per_read.as_nanos() as f64 / 1000.0,
        per_read.as_nanos() as f64 * 1024.0 / request.len() as f64
    );
}
