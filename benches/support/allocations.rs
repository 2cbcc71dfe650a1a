//! Allocator calls counted on the service's threads only, or on every
//! thread ([`every_thread`]) (a bench's global allocator; the library sets
//! none): a figure that does not depend on machine noise. Counting is off
//! outside [`count`], where the cost is one relaxed load per allocation.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub struct Counting;

static ON: AtomicBool = AtomicBool::new(false);
static EVERY_THREAD: AtomicBool = AtomicBool::new(false);
static CALLS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static SERVICE: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as one of the service's (its runtime's
/// `on_thread_start`).
#[allow(dead_code)] // The stores bench counts every thread.
pub fn service_thread() {
    SERVICE.with(|s| s.set(true));
}

/// Counts on every thread of the process from now on (a bench that calls
/// the service in process, with no threads of its own).
#[allow(dead_code)] // The load bench counts its service's threads alone.
pub fn every_thread() {
    EVERY_THREAD.store(true, Ordering::Relaxed);
}

fn note(size: usize) {
    if ON.load(Ordering::Relaxed)
        && (EVERY_THREAD.load(Ordering::Relaxed) || SERVICE.try_with(Cell::get).unwrap_or(false))
    {
        CALLS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(size as u64, Ordering::Relaxed);
    }
}

// SAFETY: every call is passed to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Allocator calls (allocations and reallocations) and bytes requested
/// (a reallocation's whole new size) on the service's threads while `f`
/// runs.
pub async fn count<T>(f: impl std::future::Future<Output = T>) -> (T, u64, u64) {
    let (c0, b0) = (CALLS.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
    ON.store(true, Ordering::Relaxed);
    let out = f.await;
    ON.store(false, Ordering::Relaxed);
    let (c1, b1) = (CALLS.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
    (out, c1 - c0, b1 - b0)
}
