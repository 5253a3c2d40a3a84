//! A counting global allocator: per thread, the bytes live and the peak since the last
//! reset, so that the driver can bound what one input makes the code allocate. An
//! allocation above [`HARD_LIMIT`] is refused after the case is named on stderr (the
//! process then aborts with Rust's allocation-failure message): an unbounded allocation
//! is found, reported with the case that made it, and never takes the machine down.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;

/// The largest single allocation allowed (1 GiB).
pub const HARD_LIMIT: usize = 1 << 30;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
    static CASE: Cell<(&'static str, u64, u64)> = const { Cell::new(("", 0, 0)) };
}

/// The global allocator of the fuzz binary (`#[global_allocator]` in `main.rs`).
#[derive(Debug, Default)]
pub struct Counting;

fn add(bytes: usize) {
    let bytes = isize::try_from(bytes).unwrap_or(isize::MAX);
    let _ = LIVE.try_with(|live| {
        let now = live.get().saturating_add(bytes);
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

fn sub(bytes: usize) {
    let bytes = isize::try_from(bytes).unwrap_or(isize::MAX);
    let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(bytes)));
}

/// Writes `n` in decimal without allocating.
fn write_number(out: &mut impl Write, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    loop {
        start -= 1;
        if let Some(digit) = digits.get_mut(start) {
            *digit = b'0' + (n % 10) as u8;
        }
        n /= 10;
        if n == 0 || start == 0 {
            break;
        }
    }
    let _ = out.write_all(digits.get(start..).unwrap_or_default());
}

/// Names the case that asked for `size` bytes, without allocating.
fn report_oversize(size: usize) {
    let (target, seed, case) = CASE.try_with(Cell::get).unwrap_or(("", 0, 0));
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(b"\ndiana-fuzz: allocation of ");
    write_number(&mut err, size as u64);
    let _ = err.write_all(b" bytes refused (limit 1 GiB) in target ");
    let _ = err.write_all(target.as_bytes());
    let _ = err.write_all(b", replay with: scripts/fuzz --target ");
    let _ = err.write_all(target.as_bytes());
    let _ = err.write_all(b" --seed ");
    write_number(&mut err, seed);
    let _ = err.write_all(b" --replay ");
    write_number(&mut err, case);
    let _ = err.write_all(b"\n");
}

// SAFETY: every call is forwarded to `System` with the same arguments; the counters are
// plain thread-local cells with constant initialisers (no allocation, no destructor).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > HARD_LIMIT {
            report_oversize(layout.size());
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded as is.
        let pointer = unsafe { System.alloc(layout) };
        if !pointer.is_null() {
            add(layout.size());
        }
        pointer
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > HARD_LIMIT {
            report_oversize(layout.size());
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded as is.
        let pointer = unsafe { System.alloc_zeroed(layout) };
        if !pointer.is_null() {
            add(layout.size());
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        sub(layout.size());
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(pointer, layout) }
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > HARD_LIMIT {
            report_oversize(new_size);
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded as is.
        let moved = unsafe { System.realloc(pointer, layout, new_size) };
        if !moved.is_null() {
            sub(layout.size());
            add(new_size);
        }
        moved
    }
}

/// Names the case this thread runs (for the oversize report) and starts its peak anew.
/// Returns the bytes live now, the base of [`used_since`].
pub fn start_case(target: &'static str, seed: u64, case: u64) -> isize {
    let _ = CASE.try_with(|cell| cell.set((target, seed, case)));
    let live = LIVE.try_with(Cell::get).unwrap_or(0);
    let _ = PEAK.try_with(|peak| peak.set(live));
    live
}

/// The most this thread had allocated beyond `base` since [`start_case`].
pub fn used_since(base: isize) -> u64 {
    let peak = PEAK.try_with(Cell::get).unwrap_or(0);
    u64::try_from(peak.saturating_sub(base)).unwrap_or(0)
}
