//! Live statistics: counters the workers update per request (relaxed atomics on cache lines
//! only their queue's worker writes) and a control socket that hands out a JSON snapshot
//! (`vblk serve --control-socket PATH`, read by `vblk stats PATH`).
//!
//! Per queue: requests and bytes by type, malformed requests (rejected), failed I/O,
//! requests in flight, and a completion-latency histogram per type. Per worker: polling
//! hits and misses. Counters run from the daemon's start (across frontends), as the
//! kernel's /proc/diskstats do; rates are differences of two snapshots.
//!
//! Latency is measured in passes: from the start of the worker pass that took a request to
//! the start of the pass that published its completion, read from one clock read per pass
//! (never one per request). It includes the time a request waits in the device and its
//! engine; it cannot include the time the chain sat in the ring before the device looked.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use serde_json::{json, Value};

/// Add `n` to a counter that only one thread writes (its queue's or its own worker): a
/// load and a store, without the locked read-modify-write a `fetch_add` costs on every
/// request. Readers see each value whole (relaxed atomics); a second writer would lose
/// counts, never corrupt memory.
#[inline]
pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// The kinds of request counted apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Read = 0,
    Write = 1,
    Flush = 2,
    Discard = 3,
    WriteZeroes = 4,
    GetId = 5,
}

const KINDS: usize = 6;
const KIND_NAMES: [&str; KINDS] = [
    "read",
    "write",
    "flush",
    "discard",
    "write_zeroes",
    "get_id",
];
/// Histogram buckets: bucket i counts latencies in [2^i, 2^(i+1)) ns (bucket 0 also 0).
const BUCKETS: usize = 40;

/// A log2 latency histogram.
#[derive(Debug)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    fn record(&self, ns: u64) {
        let i = (63 - ns.max(1).leading_zeros() as usize).min(BUCKETS - 1);
        bump(&self.buckets[i], 1);
        bump(&self.sum_ns, ns);
    }

    fn snapshot(&self) -> Value {
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        json!({ "sum_ns": self.sum_ns.load(Ordering::Relaxed), "log2_ns": counts })
    }
}

/// One kind's counters.
#[derive(Debug, Default)]
struct Op {
    count: AtomicU64,
    bytes: AtomicU64,
    lat: Histogram,
}

/// Counters of one queue.
#[derive(Debug, Default)]
pub(crate) struct QueueStats {
    /// Requests completed (any status).
    pub completed: AtomicU64,
    /// Requests answered with an error status because they were malformed.
    pub rejected: AtomicU64,
    /// Requests whose I/O failed (IOERR from the disk).
    pub failed: AtomicU64,
    /// Requests taken and not yet completed (stored once per pass).
    pub in_flight: AtomicU64,
    ops: [Op; KINDS],
}

impl QueueStats {
    /// A request of `kind` and `bytes` completed `lat_ns` nanoseconds after it was taken.
    pub(crate) fn done(&self, kind: Kind, bytes: u64, lat_ns: u64) {
        let op = &self.ops[kind as usize];
        bump(&op.count, 1);
        bump(&op.bytes, bytes);
        op.lat.record(lat_ns);
        bump(&self.completed, 1);
    }

    pub(crate) fn snapshot(&self, index: usize) -> Value {
        let mut ops = serde_json::Map::new();
        for (i, name) in KIND_NAMES.iter().enumerate() {
            let op = &self.ops[i];
            ops.insert(
                (*name).to_string(),
                json!({
                    "ios": op.count.load(Ordering::Relaxed),
                    "bytes": op.bytes.load(Ordering::Relaxed),
                    "lat": op.lat.snapshot(),
                }),
            );
        }
        json!({
            "queue": index,
            "completed": self.completed.load(Ordering::Relaxed),
            "rejected": self.rejected.load(Ordering::Relaxed),
            "failed": self.failed.load(Ordering::Relaxed),
            "in_flight": self.in_flight.load(Ordering::Relaxed),
            "ops": ops,
        })
    }
}

/// Counters of one worker.
#[derive(Debug, Default)]
pub(crate) struct WorkerStats {
    /// Polling windows that found work.
    pub poll_hits: AtomicU64,
    /// Polling windows that ran out (then the worker slept).
    pub poll_misses: AtomicU64,
    /// Times the worker slept in epoll.
    pub sleeps: AtomicU64,
    /// The worker's running estimate of the CPU one sleep costs it, ns (0: not measured).
    pub sleep_cost_ns: AtomicU64,
    /// The polling window when the worker last went to sleep, ns: the window of that idle
    /// period's kind (poll.rs, `Wait`; at QD1 on a slow disk, the disk's, which is 0 or
    /// the floor, while the guest's may be the full bound).
    pub poll_window_ns: AtomicU64,
    /// How the worker spends its idle periods between trials (`poll::Regime` as a number,
    /// 0 the adaptive window): the last trial's choice (poll.rs), stored at the end of
    /// each busy period.
    pub poll_regime: AtomicU64,
    /// Sleeps that left kicks off for at most `--coalesce-us` (poll.rs, coalescing).
    pub coalesced_sleeps: AtomicU64,
}

/// The reset fence (fence.rs): requests of stopped queues still out, and how long queues
/// started after them waited.
#[derive(Debug, Default)]
pub(crate) struct FenceStats {
    /// Old requests out now.
    pub old_requests: AtomicU64,
    /// Queues that started while old requests were out and waited for them.
    pub fenced_starts: AtomicU64,
    /// Their waits, summed and the longest, ns.
    pub wait_ns_total: AtomicU64,
    pub wait_ns_max: AtomicU64,
}

/// Ring stops (GET_VRING_BASE) and the frontend's misbehaviour.
#[derive(Debug, Default)]
pub(crate) struct LifecycleStats {
    /// Rings stopped.
    pub stops: AtomicU64,
    /// Stops that found requests in flight and waited for them.
    pub drains: AtomicU64,
    /// The longest such wait, ns.
    pub drain_wait_ns_max: AtomicU64,
    /// Stops answered at the drain timeout with requests still out (they became old).
    pub drains_timed_out: AtomicU64,
    /// Sessions ended because the frontend wedged a call, error or kick descriptor.
    pub wedged_fds: AtomicU64,
    /// Sessions ended because a worker did not answer (or panicked).
    pub lost_workers: AtomicU64,
    /// Connections whose session could not be set up (the disk refused a new engine).
    pub failed_setups: AtomicU64,
    /// Sessions the frontend broke: a malformed or refused message, a deadline it let
    /// pass (a message unfinished, a reply unread), guest memory truncated (SIGBUS).
    pub broken_sessions: AtomicU64,
    /// 1 while the device logs the guest pages it writes (a live migration runs).
    pub log_active: AtomicU64,
    /// Page marks made in dirty logs, over the daemon's life.
    pub logged_pages: Arc<AtomicU64>,
}

/// The worker threads' counters, by thread.
pub(crate) fn workers_snapshot(workers: &[Arc<WorkerStats>]) -> Value {
    let all: Vec<Value> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| {
            json!({
                "worker": i,
                "poll_hits": w.poll_hits.load(Ordering::Relaxed),
                "poll_misses": w.poll_misses.load(Ordering::Relaxed),
                "sleeps": w.sleeps.load(Ordering::Relaxed),
                "sleep_cost_ns": w.sleep_cost_ns.load(Ordering::Relaxed),
                "poll_window_ns": w.poll_window_ns.load(Ordering::Relaxed),
                "poll_regime": crate::poll::Regime::from_u64(w.poll_regime.load(Ordering::Relaxed)).name(),
                "coalesced_sleeps": w.coalesced_sleeps.load(Ordering::Relaxed),
            })
        })
        .collect();
    Value::Array(all)
}

/// Everything about one disk.
#[derive(Debug)]
pub(crate) struct Stats {
    pub queues: Vec<Arc<QueueStats>>,
    /// Requests that waited for the disk's limits (its own or its group's).
    pub throttle: Arc<crate::throttle::LimiterStats>,
    pub workers: Vec<Arc<WorkerStats>>,
    pub fence: Arc<FenceStats>,
    pub lifecycle: Arc<LifecycleStats>,
    started: Instant,
    disk: String,
    /// The disk, for what its image is ([`image_of`]) when asked; weak, so that the
    /// statistics never keep a removed disk's image open.
    backend: Weak<storage::Backend>,
}

/// A disk's image format, backing chain and allocation: `{"format":"qcow2","version":3,
/// "cluster_size":..,"virtual_size":..,"file_size":..,"read_only":..,
/// "clusters_allocated":..,"l2_slices_read":..,"cache_bytes":..,"writebacks":..,
/// "owner_writes":..,
/// "backing":[{"path":..,"format":..},..]}` (the counts since the daemon opened it); files
/// and block devices are `{"format":"raw"}`; other disks `null`.
pub fn image_of(b: &storage::Backend) -> Value {
    let Some(img) = b.qcow2() else {
        return match b.kind() {
            storage::BackendKind::File | storage::BackendKind::BlockDevice => {
                json!({"format": "raw"})
            }
            _ => Value::Null,
        };
    };
    let h = img.header();
    let st = img.stats();
    let mut chain = Vec::new();
    let mut next = img.backing();
    while let Some((b, format)) = next {
        chain.push(json!({
            "path": b.path().map(|p| p.display().to_string()),
            "format": format.to_string(),
        }));
        next = b.qcow2().and_then(|i| i.backing());
    }
    json!({
        "format": "qcow2",
        "version": h.version,
        "cluster_size": h.cluster_size(),
        "virtual_size": img.size(),
        "file_size": st.file_size,
        "read_only": !st.writable,
        "clusters_allocated": st.clusters_allocated,
        "l2_slices_read": st.l2_slices_read,
        "cache_bytes": st.cache_bytes,
        "writebacks": st.writebacks,
        "owner_writes": st.owner_writes,
        "backing": chain,
    })
}

impl Stats {
    pub(crate) fn new(
        num_queues: usize,
        workers: Vec<Arc<WorkerStats>>,
        disk: String,
        backend: &Arc<storage::Backend>,
    ) -> Stats {
        Stats {
            queues: (0..num_queues).map(|_| Arc::default()).collect(),
            throttle: Arc::default(),
            workers,
            fence: Arc::default(),
            lifecycle: Arc::default(),
            started: Instant::now(),
            disk,
            backend: Arc::downgrade(backend),
        }
    }

    /// The snapshot `vblk stats` reads: queues that have seen a request, and every worker.
    pub(crate) fn snapshot(&self, capacity_bytes: u64) -> Value {
        let queues: Vec<Value> = self
            .queues
            .iter()
            .enumerate()
            .filter(|(_, q)| {
                q.completed.load(Ordering::Relaxed) + q.in_flight.load(Ordering::Relaxed) > 0
            })
            .map(|(i, q)| q.snapshot(i))
            .collect();
        let workers = workers_snapshot(&self.workers);
        let (f, l) = (&self.fence, &self.lifecycle);
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let lifecycle = json!({
            "stops": load(&l.stops),
            "drains": load(&l.drains),
            "drain_wait_ns_max": load(&l.drain_wait_ns_max),
            "drains_timed_out": load(&l.drains_timed_out),
            "old_requests": load(&f.old_requests),
            "fenced_starts": load(&f.fenced_starts),
            "fence_wait_ns_total": load(&f.wait_ns_total),
            "fence_wait_ns_max": load(&f.wait_ns_max),
            "wedged_fds": load(&l.wedged_fds),
            "broken_sessions": load(&l.broken_sessions),
            "lost_workers": load(&l.lost_workers),
            "failed_setups": load(&l.failed_setups),
            "log_active": load(&l.log_active) != 0,
            "logged_pages": load(&l.logged_pages),
        });
        json!({
            "vblk_stats": 1,
            "disk": self.disk,
            "image": self.backend.upgrade().map_or(Value::Null, |b| image_of(&b)),
            "capacity_bytes": capacity_bytes,
            "uptime_ns": u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX),
            "num_queues": self.queues.len(),
            "queues": queues,
            "workers": workers,
            "lifecycle": lifecycle,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_log2_ns() {
        let h = Histogram::default();
        h.record(0);
        h.record(1);
        h.record(1023);
        h.record(1024);
        h.record(u64::MAX);
        let s = h.snapshot();
        let b = s["log2_ns"].as_array().unwrap();
        assert_eq!(b[0], 2, "0 and 1 ns");
        assert_eq!(b[9], 1, "1023 ns");
        assert_eq!(b[10], 1, "1024 ns");
        assert_eq!(b[BUCKETS - 1], 1, "huge values land in the last bucket");
    }
}
