//! Request handling driven through a worker by hand, with virtio-queue's mock split queue
//! laying out the descriptor table and available ring in guest memory:
//! - `requests`: every valid request type, and malformed requests that each change one
//!   field of a valid one and must be answered with a status;
//! - `unanswerable`: chains with no trustworthy status byte, which must stop their queue
//!   and never reach the used ring;
//! - `rings`: notification suppression, engine backpressure, stopping a ring with requests
//!   in flight, new memory tables;
//! - `session`: the control plane through the socket: configuration space, features, the
//!   backend channel's config-change message.
//!
//! Each request case checks the exact status and used length, that guest memory outside
//! the request's writable bytes and the used ring is untouched, and that the disk holds
//! what it should.

mod dirty_log;
mod lifecycle;
mod requests;
mod rings;
mod session;
mod throttle;
mod unanswerable;

use std::fs::File;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

use proto::wire::{feature, req_type, status};
use proto::RingInfo;
use storage::{Backend, DiskSpec, Engine, EngineKind, OpenOptions};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::blk::Blk;
use crate::config::DeviceConfig;
use crate::memory::GuestMemory;
use crate::ring::{DeviceRing, RingAddrs};
use crate::stats::QueueStats;
use crate::worker::{Command, Mailbox, QueueStart, Worker, WorkerSetup};

pub(crate) type Mem = GuestMemoryMmap<()>;

const QSIZE: u16 = 16;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;
const MEM_END: u64 = 0x20_0000;
const DISK_BYTES: u64 = 2 << 20;
const CAPACITY: u64 = DISK_BYTES / 512;

const HDR: u64 = 0x1000;
const HDR2: u64 = 0x1100;
const STATUS: u64 = 0x2000;
const DATA: u64 = 0x8000;
const TABLE: u64 = 0x4000;
const OUTSIDE: u64 = 0x30_0000;
const USED_RING: u64 = 0x800;

fn all_features() -> u64 {
    [
        feature::VERSION_1,
        feature::RING_EVENT_IDX,
        feature::RING_INDIRECT_DESC,
        feature::FLUSH,
        feature::DISCARD,
        feature::WRITE_ZEROES,
        feature::CONFIG_WCE,
    ]
    .iter()
    .fold(0, |m, &f| m | feature::bit(f))
}

fn d(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, flags, next))
}

/// A vring descriptor for the worker, from a `File` the test made.
fn vfd(f: File) -> crate::vring_fd::VringFd {
    crate::vring_fd::VringFd::new(f, "test").unwrap()
}

/// An eventfd and a `File` for the same counter (what a frontend passes).
fn eventfd_pair() -> (EventFd, File) {
    let efd = EventFd::new(EFD_NONBLOCK).unwrap();
    let dup = efd.try_clone().unwrap();
    // SAFETY: into_raw_fd hands over ownership of a valid fd to the File.
    let file = unsafe { File::from_raw_fd(dup.into_raw_fd()) };
    (efd, file)
}

struct Rig {
    mem: Mem,
    /// Descriptor table, available ring and used ring, laid out once by MockSplitQueue.
    desc: u64,
    avail: u64,
    used: u64,
    blk: Arc<Blk>,
    worker: Worker,
    mailbox: Arc<Mailbox>,
    file: tempfile::NamedTempFile,
    next_avail: u16,
    stats: Arc<QueueStats>,
    /// The queue's call and error eventfds, as the frontend would read them.
    call: EventFd,
    err: EventFd,
    /// Raised when the worker ends the session (its `kill`).
    killed: Arc<AtomicBool>,
    /// The reset fence the worker counts old requests in.
    fence: Arc<crate::fence::Fence>,
}

/// What the device answered for one request.
#[derive(Debug, PartialEq, Eq)]
struct Answer {
    status: u8,
    used_len: u32,
}

impl Rig {
    fn new(read_only: bool, engine: EngineKind) -> Rig {
        Rig::with_features(read_only, engine, all_features())
    }

    fn with_features(read_only: bool, engine: EngineKind, features: u64) -> Rig {
        let file = tempfile::NamedTempFile::new().unwrap();
        let pattern: Vec<u8> = (0..DISK_BYTES).map(|i| (i % 251) as u8).collect();
        std::fs::write(file.path(), &pattern).unwrap();
        let config = DeviceConfig {
            disk: DiskSpec::File(file.path().to_path_buf()),
            read_only,
            queue_size: QSIZE,
            engine,
            ..Default::default()
        };
        let disk = Arc::new(
            Backend::open(
                &config.disk,
                &OpenOptions {
                    read_only,
                    cache: config.cache,
                    prealloc: false,
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let engine = disk.engine(config.engine, 64).unwrap();
        Rig::with_engine(&config, &disk, engine, 64, features, file)
    }

    /// A rig whose worker uses `engine` (of `depth`).
    fn with_engine(
        config: &DeviceConfig,
        disk: &Arc<Backend>,
        engine: Box<dyn Engine>,
        depth: usize,
        features: u64,
        file: tempfile::NamedTempFile,
    ) -> Rig {
        // Two adjacent regions, so buffers can cross a region boundary; nothing past MEM_END.
        let mem: Mem = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x10_0000),
            (GuestAddress(0x10_0000), 0x10_0000),
        ])
        .unwrap();
        let blk = Arc::new(Blk::new(config, disk));
        blk.acked.store(
            features & blk.features,
            std::sync::atomic::Ordering::Relaxed,
        );
        // The mock lays out the descriptor table and the avail ring. Its used ring address
        // is computed from the avail ring's entry count rather than its byte length, which
        // makes the used ring overlap the avail ring (and used_event) for queues of more than
        // a few entries, so the used ring gets an address of its own.
        let mock = MockSplitQueue::new(&mem, QSIZE);
        let (desc, avail, used) = (mock.desc_table_addr().0, mock.avail_addr().0, USED_RING);
        assert!(avail + 6 + 2 * u64::from(QSIZE) <= used);
        let killed = Arc::new(AtomicBool::new(false));
        let fence: Arc<crate::fence::Fence> = Arc::default();
        let k = killed.clone();
        let (worker, mailbox) = Worker::for_test(WorkerSetup {
            id: 0,
            disk: Arc::from("test"),
            blk: blk.clone(),
            engine,
            depth,
            submit_batch: 0,
            drain_timeout: crate::config::DEFAULT_DRAIN_TIMEOUT,
            fence: fence.clone(),
            poison: Arc::new(AtomicBool::new(false)),
            kill: Box::new(move || k.store(true, std::sync::atomic::Ordering::SeqCst)),
            lifecycle: Arc::default(),
            throttle: None,
        });
        let (call, call_file) = eventfd_pair();
        let (err, err_file) = eventfd_pair();
        let (_kick, kick_file) = eventfd_pair();
        let mut rig = Rig {
            mem,
            desc,
            avail,
            used,
            blk,
            worker,
            mailbox,
            file,
            next_avail: 0,
            stats: Arc::default(),
            call,
            err,
            killed,
            fence,
        };
        let gm = Arc::new(GuestMemory::from_mmap(rig.mem.clone()));
        rig.ask(|reply| Command::Memory {
            mem: gm.clone(),
            reply,
        });
        let event_idx = features & feature::bit(feature::RING_EVENT_IDX) != 0;
        let ring = DeviceRing::new(&gm, QSIZE, rig.addrs(), event_idx, 0).unwrap();
        let start = QueueStart {
            index: 0,
            ring,
            info: RingInfo {
                desc_table: GuestAddress(desc),
                size: QSIZE,
                indirect: features & feature::bit(feature::RING_INDIRECT_DESC) != 0,
                max_indirect: RingInfo::max_indirect_for(QSIZE, rig.blk.base_limits.seg_max),
            },
            kick: vfd(kick_file),
            call: Some(vfd(call_file)),
            err: Some(vfd(err_file)),
            enabled: true,
            stats: rig.stats.clone(),
            inflight: None,
            resubmit: Vec::new(),
            log_used: None,
        };
        Worker::post(&rig.mailbox, Command::Start(Box::new(start)));
        rig.worker.step();
        rig
    }

    fn addrs(&self) -> RingAddrs {
        RingAddrs {
            desc: self.desc,
            avail: self.avail,
            used: self.used,
        }
    }

    /// Post a command that answers, run the worker until it does, and return the answer.
    fn ask<T>(&mut self, make: impl FnOnce(std::sync::mpsc::SyncSender<T>) -> Command) -> T {
        let (tx, rx) = sync_channel(1);
        Worker::post(&self.mailbox, make(tx));
        self.step_until(&rx)
    }

    /// Post a command whose answer comes later; the receiver.
    fn post<T>(
        &mut self,
        make: impl FnOnce(std::sync::mpsc::SyncSender<T>) -> Command,
    ) -> Receiver<T> {
        let (tx, rx) = sync_channel(1);
        Worker::post(&self.mailbox, make(tx));
        rx
    }

    fn step_until<T>(&mut self, rx: &Receiver<T>) -> T {
        for _ in 0..10_000 {
            self.worker.step();
            if let Ok(v) = rx.try_recv() {
                return v;
            }
        }
        panic!("the worker did not answer");
    }

    fn step_until_timeout<T>(&mut self, rx: &Receiver<T>, limit: std::time::Duration) -> T {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < limit {
            self.worker.step();
            if let Ok(v) = rx.try_recv() {
                return v;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        panic!("the worker did not answer within {limit:?}");
    }

    fn store_desc(&self, index: u16, desc: RawDescriptor) {
        let at = GuestAddress(self.desc + 16 * u64::from(index));
        self.mem.write_obj(desc, at).unwrap();
    }

    fn set_avail(&self, slot: u16, head: u16) {
        let at = GuestAddress(self.avail + 4 + 2 * u64::from(slot % QSIZE));
        self.mem.write_obj(head, at).unwrap();
    }

    fn set_avail_idx(&self, idx: u16) {
        self.mem
            .write_obj(idx, GuestAddress(self.avail + 2))
            .unwrap();
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(self.used + 2)).unwrap()
    }

    /// The used element in `slot`: (id, len).
    fn used_elem(&self, slot: u16) -> (u32, u32) {
        let at = self.used + 4 + 8 * u64::from(slot % QSIZE);
        let id: u32 = self.mem.read_obj(GuestAddress(at)).unwrap();
        let len: u32 = self.mem.read_obj(GuestAddress(at + 4)).unwrap();
        (id, len)
    }

    /// End of the used ring (flags, idx, ring, avail_event).
    fn used_end(&self) -> u64 {
        self.used + 6 + 8 * u64::from(QSIZE)
    }

    fn disk(&self) -> Vec<u8> {
        std::fs::read(self.file.path()).unwrap()
    }

    fn write_header(&self, at: u64, type_: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&type_.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(at)).unwrap();
    }

    fn write_segment(&self, at: u64, sector: u64, sectors: u32, flags: u32) {
        let mut s = [0u8; 16];
        s[0..8].copy_from_slice(&sector.to_le_bytes());
        s[8..12].copy_from_slice(&sectors.to_le_bytes());
        s[12..16].copy_from_slice(&flags.to_le_bytes());
        self.mem.write_slice(&s, GuestAddress(at)).unwrap();
    }

    /// Store `descs` at table indices 0.. and publish `head` in the available ring.
    fn publish(&mut self, descs: &[RawDescriptor], head: u16) {
        let slot = self.next_avail % QSIZE;
        self.next_avail = self.next_avail.wrapping_add(1);
        for (i, desc) in descs.iter().enumerate() {
            self.store_desc(i as u16, *desc);
        }
        self.set_avail(slot, head);
        self.set_avail_idx(self.next_avail);
    }

    /// Run the worker until it is idle; the new used element, if one was produced.
    fn process(&mut self) -> Option<(u32, u32)> {
        let before = self.used_idx();
        self.worker.settle();
        (self.used_idx() != before).then(|| self.used_elem(before))
    }

    fn submit(&mut self, descs: &[RawDescriptor], head: u16) -> Option<(u32, u32)> {
        self.publish(descs, head);
        self.process()
    }

    /// Run one request, checking that guest memory changed only in the used ring and in
    /// `writable` ranges; returns the status byte at STATUS and the used length.
    fn run(&mut self, descs: &[RawDescriptor], writable: &[(u64, u64)]) -> Answer {
        self.mem.write_obj(0xEEu8, GuestAddress(STATUS)).unwrap();
        self.publish(descs, 0);
        let before = snapshot(&self.mem);
        let (id, used_len) = self.process().expect("request was not completed");
        assert_eq!(id, 0, "used id is the head");
        let after = snapshot(&self.mem);
        let used = (self.used, self.used_end());
        let mut allowed: Vec<(u64, u64)> = writable.to_vec();
        allowed.push((STATUS, STATUS + 1));
        allowed.push(used);
        for (i, (a, b)) in before.iter().zip(&after).enumerate() {
            let i = i as u64;
            if a != b && !allowed.iter().any(|&(s, e)| i >= s && i < e) {
                panic!("guest byte {i:#x} changed from {a:#x} to {b:#x} outside the request");
            }
        }
        Answer {
            status: self.mem.read_obj(GuestAddress(STATUS)).unwrap(),
            used_len,
        }
    }

    /// Stop the queue as GET_VRING_BASE does; the next available index it answers.
    fn stop(&mut self) -> u16 {
        self.ask(|reply| Command::Stop { queue: 0, reply })
    }

    /// Whether the queue was stopped as broken.
    fn broken(&self) -> bool {
        self.worker.queue_broken(0)
    }
}

fn snapshot(mem: &Mem) -> Vec<u8> {
    let mut v = vec![0u8; MEM_END as usize];
    mem.read_slice(&mut v, GuestAddress(0)).unwrap();
    v
}

fn ok(used_len: u32) -> Answer {
    Answer {
        status: status::OK,
        used_len,
    }
}

fn err(status: u8) -> Answer {
    Answer {
        status,
        used_len: 1,
    }
}

/// header, one data buffer, status: the usual three-descriptor chain.
fn chain3(data: u64, len: u32, data_flags: u16) -> Vec<RawDescriptor> {
    vec![
        d(HDR, 16, F_NEXT, 1),
        d(data, len, data_flags | F_NEXT, 2),
        d(STATUS, 1, F_WRITE, 0),
    ]
}

fn read_chain(len: u32) -> Vec<RawDescriptor> {
    chain3(DATA, len, F_WRITE)
}

fn write_chain(len: u32) -> Vec<RawDescriptor> {
    chain3(DATA, len, 0)
}

fn flush_chain() -> Vec<RawDescriptor> {
    vec![d(HDR, 16, F_NEXT, 1), d(STATUS, 1, F_WRITE, 0)]
}

fn seg_chain() -> Vec<RawDescriptor> {
    vec![
        d(HDR, 16, F_NEXT, 1),
        d(DATA, 16, F_NEXT, 2),
        d(STATUS, 1, F_WRITE, 0),
    ]
}

fn fill(rig: &Rig, at: u64, len: usize, byte: u8) {
    rig.mem
        .write_slice(&vec![byte; len], GuestAddress(at))
        .unwrap();
}

fn disk_unchanged(rig: &Rig) {
    let expect: Vec<u8> = (0..DISK_BYTES).map(|i| (i % 251) as u8).collect();
    assert!(rig.disk() == expect, "the disk changed");
}

/// Write a table of descriptors at TABLE.
fn store_table(rig: &Rig, table: &[RawDescriptor]) {
    for (i, t) in table.iter().enumerate() {
        rig.mem
            .write_obj(*t, GuestAddress(TABLE + 16 * i as u64))
            .unwrap();
    }
}
