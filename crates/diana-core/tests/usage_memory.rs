//! The usage reader holds no part of the body: once made, reading any amount of it
//! allocates nothing (counted by this test binary's allocator, on the reading thread only).

use diana_core::usage::{Framing, JsonPath, RequestReader, Usage, UsageReader, UsageSource};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is passed on to the system allocator unchanged; the count is a
// thread-local cell with a const initialiser, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|count| count.set(count.get() + 1));
        // SAFETY: as the caller's contract with this allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        // SAFETY: `pointer` came from `System.alloc` above with this layout.
        unsafe { System.dealloc(pointer, layout) }
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, size: usize) -> *mut u8 {
        ALLOCATIONS.with(|count| count.set(count.get() + 1));
        // SAFETY: as the caller's contract with this allocator.
        unsafe { System.realloc(pointer, layout, size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

#[test]
fn reading_a_body_of_any_size_allocates_nothing() {
    // The count sees an allocation on this thread.
    let before = allocations();
    let held = std::hint::black_box(vec![0u8; 16]);
    assert_eq!(allocations() - before, 1);
    drop(held);

    // 20 MiB of an answer's text, then its usage, in 64 KiB chunks.
    let text = "usage ".repeat(20 << 20 >> 3);
    let body = format!(
        "{{\"choices\":[{{\"message\":{{\"content\":\"{text}\"}}}}],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\":4,\"total_tokens\":7}}}}"
    );
    let mut reader = UsageReader::new(&UsageSource::OpenAi, Framing::Json);
    let before = allocations();
    for chunk in body.as_bytes().chunks(64 << 10) {
        reader.feed(chunk);
    }
    let read = reader.finish();
    assert_eq!(
        allocations() - before,
        0,
        "allocations while reading a JSON answer"
    );
    assert_eq!(
        read,
        Ok(Usage {
            input: 3,
            output: 4,
            total: Some(7)
        })
    );

    // 200,000 events of a stream, a few bytes at a time.
    let event = b"event: message_delta\r\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"usage\"}}\r\n\r\n";
    let mut reader = UsageReader::new(&UsageSource::Anthropic, Framing::Sse);
    let before = allocations();
    for _ in 0..200_000 {
        for chunk in event.chunks(7) {
            reader.feed(chunk);
        }
    }
    reader.feed(b"data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\r\n\r\n");
    let read = reader.finish();
    assert_eq!(
        allocations() - before,
        0,
        "allocations while reading a stream"
    );
    assert_eq!(
        read,
        Ok(Usage {
            input: 0,
            output: 9,
            total: None
        })
    );

    // A request's reservation after a long prompt.
    let path = JsonPath::parse("max_tokens").map_err(|e| e.to_string());
    let mut reader = RequestReader::new(&path.unwrap());
    let request = format!("{{\"messages\":[{{\"content\":\"{text}\"}}],\"max_tokens\":800}}");
    let before = allocations();
    for chunk in request.as_bytes().chunks(64 << 10) {
        reader.feed(chunk);
    }
    let read = reader.finish();
    assert_eq!(
        allocations() - before,
        0,
        "allocations while reading a request"
    );
    assert_eq!(read, Ok(800));
}
