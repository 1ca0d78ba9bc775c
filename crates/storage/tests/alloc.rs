//! No heap allocation per operation: once an engine is warm (its bounce pool has
//! seen the largest operation), pushing, submitting, waiting and reaping allocate
//! nothing on the calling thread. Checked with a counting global allocator.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use vblk_storage::{Backend, CacheMode, Engine, EngineKind, Op};

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

fn note() {
    if COUNTING.try_with(Cell::get).unwrap_or(false) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: forwarded contract.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: forwarded contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// One round: a batch of writes, reads (misaligned buffers: bounced under
/// O_DIRECT), a flush, a discard and write-zeroes; all reaped.
fn round(e: &mut dyn Engine, ops: &[(u64, Op)]) -> usize {
    for &(token, op) in ops {
        // SAFETY: the buffers `ops` names live in the caller for the whole test.
        unsafe { e.push(token, op) }.unwrap();
    }
    e.submit().unwrap();
    let mut ok = 0;
    let mut reaped = 0;
    while reaped < ops.len() {
        reaped += e.reap(&mut |c| ok += usize::from(c.result.is_ok()));
        if reaped < ops.len() {
            e.wait().unwrap();
        }
    }
    ok
}

fn check(name: &str, backend: &Arc<Backend>, kind: EngineKind) {
    let mut bufs: Vec<Buf> = (0..8).map(|i| Buf::new(4096 * (1 + i % 3), 1)).collect();
    let iovs: Vec<libc::iovec> = bufs.iter_mut().map(Buf::iovec).collect();
    let mut ops = Vec::new();
    for (i, iov) in iovs.iter().enumerate() {
        let offset = (i * 16384) as u64;
        let op = if i % 2 == 0 {
            Op::Write {
                offset,
                iov,
                iovcnt: 1,
                durable: i % 4 == 0,
            }
        } else {
            Op::Read {
                offset,
                iov,
                iovcnt: 1,
            }
        };
        ops.push((i as u64, op));
    }
    ops.push((100, Op::Flush));
    ops.push((
        101,
        Op::Discard {
            offset: 1 << 20,
            len: 65536,
            durable: false,
        },
    ));
    ops.push((
        102,
        Op::WriteZeroes {
            offset: 2 << 20,
            len: 65536,
            unmap: false,
            durable: false,
        },
    ));
    ops.push((
        103,
        Op::WriteZeroes {
            offset: 3 << 20,
            len: 65536,
            unmap: true,
            durable: false,
        },
    ));

    let mut e = backend.engine(kind, 16).unwrap();
    // Warm up: the bounce pool and anything lazily made reach their size.
    for _ in 0..3 {
        assert_eq!(round(&mut *e, &ops), ops.len(), "{name}: all succeed");
    }
    ALLOCS.store(0, Ordering::Relaxed);
    COUNTING.with(|c| c.set(true));
    for _ in 0..50 {
        round(&mut *e, &ops);
    }
    COUNTING.with(|c| c.set(false));
    assert_eq!(
        ALLOCS.load(Ordering::Relaxed),
        0,
        "{name} {kind}: allocations in 50 warm rounds"
    );
}

/// One test, so that no other test's allocations run on this thread meanwhile.
#[test]
fn no_allocation_per_operation() {
    // The counter sees allocations on this thread.
    COUNTING.with(|c| c.set(true));
    drop(std::hint::black_box(vec![1u8; 10]));
    COUNTING.with(|c| c.set(false));
    assert!(
        ALLOCS.load(Ordering::Relaxed) >= 1,
        "the counting allocator works"
    );

    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", 8 << 20, 1);
    for kind in EngineKind::ALL {
        if kind != EngineKind::Aio {
            check(
                "writeback file",
                &open(&path, CacheMode::Writeback, false),
                kind,
            );
        }
        check("O_DIRECT file", &open(&path, CacheMode::None, false), kind);
        let mem = Arc::new(Backend::open(&"mem:8M".parse().unwrap(), &Default::default()).unwrap());
        check("mem", &mem, kind);
        let null =
            Arc::new(Backend::open(&"null:8M".parse().unwrap(), &Default::default()).unwrap());
        check("null", &null, kind);
    }
}
