//! Request handling driven through virtio-queue's mock split queue: every valid request
//! type, and malformed requests that each change one field of a valid one. Each case checks
//! the exact status and used length, that guest memory outside the request's writable bytes
//! and the used ring is untouched, and that the disk holds what it should.

use std::sync::Arc;

use proto::wire::{feature, req_type, status};
use storage::{Backend, DiskSpec, EngineKind, OpenOptions};
use vhost_user_backend::VringT;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic, GuestMemoryMmap};

use crate::blk::BlkDevice;
use crate::config::DeviceConfig;
use crate::worker::{Mem, Vring};

const QSIZE: u16 = 16;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;
const MEM_END: u64 = 0x20_0000;
const DISK_BYTES: u64 = 1 << 20;
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

struct Rig {
    mem: Mem,
    /// Descriptor table, available ring and used ring, laid out once by MockSplitQueue.
    desc: u64,
    avail: u64,
    used: u64,
    dev: BlkDevice,
    vring: Vec<Vring>,
    file: tempfile::NamedTempFile,
    next_avail: u16,
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
        // Two adjacent regions, so buffers can cross a region boundary; nothing past MEM_END.
        let mem: Mem = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x10_0000),
            (GuestAddress(0x10_0000), 0x10_0000),
        ])
        .unwrap();
        let file = tempfile::NamedTempFile::new().unwrap();
        let pattern: Vec<u8> = (0..DISK_BYTES).map(|i| (i % 251) as u8).collect();
        std::fs::write(file.path(), &pattern).unwrap();
        let config = DeviceConfig {
            disk: DiskSpec::File(file.path().to_path_buf()),
            read_only,
            queue_size: QSIZE,
            engine,
            poll_us: 0,
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
        let atomic = GuestMemoryAtomic::new(mem.clone());
        let dev = BlkDevice::new(&config, &disk, atomic.clone()).unwrap();
        dev.ack(features & vhost_user_backend::VhostUserBackend::features(&dev));
        // The mock lays out the descriptor table and the avail ring. Its used ring address
        // is computed from the avail ring's entry count rather than its byte length, which
        // makes the used ring overlap the avail ring (and used_event) for queues of more than
        // a few entries, so the used ring gets an address of its own.
        let mock = MockSplitQueue::new(&mem, QSIZE);
        let (desc, avail, used) = (mock.desc_table_addr().0, mock.avail_addr().0, USED_RING);
        assert!(avail + 6 + 2 * u64::from(QSIZE) <= used);
        let vring = Vring::new(atomic, QSIZE).unwrap();
        vring.set_queue_size(QSIZE);
        vring.set_queue_info(desc, avail, used).unwrap();
        vring.set_queue_event_idx(features & feature::bit(feature::RING_EVENT_IDX) != 0);
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        Rig {
            mem,
            desc,
            avail,
            used,
            dev,
            vring: vec![vring],
            file,
            next_avail: 0,
        }
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

    /// Run the worker until it produces a used element; None if it produces none.
    fn process(&mut self) -> Option<(u32, u32)> {
        let before = self.used_idx();
        for _ in 0..1000 {
            self.dev.run_worker(0, &self.vring);
            if self.used_idx() != before {
                return Some(self.used_elem(before));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        None
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

/// A status byte left alone and a used length of 0: the chain could not be answered.
fn unanswered() -> Answer {
    Answer {
        status: 0xEE,
        used_len: 0,
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

// ---- valid requests ----

#[test]
fn read_returns_disk_bytes() {
    for engine in [EngineKind::Sync, EngineKind::IoUring] {
        let mut rig = Rig::new(false, engine);
        rig.write_header(HDR, req_type::IN, 3);
        let a = rig.run(&read_chain(1024), &[(DATA, DATA + 1024)]);
        assert_eq!(a, ok(1025), "{engine:?}");
        let mut got = vec![0u8; 1024];
        rig.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert_eq!(got, rig.disk()[3 * 512..3 * 512 + 1024]);
    }
}

#[test]
fn write_lands_on_disk_and_nowhere_else() {
    for engine in [EngineKind::Sync, EngineKind::IoUring] {
        let mut rig = Rig::new(false, engine);
        rig.write_header(HDR, req_type::OUT, 10);
        fill(&rig, DATA, 2048, 0xAB);
        assert_eq!(rig.run(&write_chain(2048), &[]), ok(1), "{engine:?}");
        let disk = rig.disk();
        assert!(disk[10 * 512..10 * 512 + 2048].iter().all(|&b| b == 0xAB));
        assert_eq!(disk[10 * 512 - 1], ((10 * 512 - 1) % 251) as u8);
        assert_eq!(disk[12 * 512 + 1536], ((12 * 512 + 1536) % 251) as u8);
    }
}

#[test]
fn flush_succeeds() {
    let mut rig = Rig::new(false, EngineKind::IoUring);
    rig.write_header(HDR, req_type::FLUSH, 0);
    assert_eq!(rig.run(&flush_chain(), &[]), ok(1));
}

#[test]
fn get_id_returns_the_serial() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::GET_ID, 0);
    let a = rig.run(&read_chain(20), &[(DATA, DATA + 20)]);
    assert_eq!(a, ok(21));
    let mut id = [0u8; 20];
    rig.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    let name = rig.file.path().file_name().unwrap().to_str().unwrap();
    let want = &name.as_bytes()[name.len().saturating_sub(20)..];
    assert_eq!(&id[..want.len()], want);
}

#[test]
fn discard_and_write_zeroes_zero_the_range() {
    for (type_, flags) in [
        (req_type::DISCARD, 0),
        (req_type::WRITE_ZEROES, 0),
        (req_type::WRITE_ZEROES, 1),
    ] {
        let mut rig = Rig::new(false, EngineKind::IoUring);
        rig.write_header(HDR, type_, 0);
        rig.write_segment(DATA, 8, 16, flags);
        assert_eq!(
            rig.run(&seg_chain(), &[]),
            ok(1),
            "type {type_} flags {flags}"
        );
        let disk = rig.disk();
        assert!(disk[8 * 512..24 * 512].iter().all(|&b| b == 0));
        assert_eq!(disk[8 * 512 - 1], ((8 * 512 - 1) % 251) as u8);
        assert_eq!(disk[24 * 512], ((24 * 512) % 251) as u8);
    }
}

#[test]
fn indirect_chain_is_followed() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, 0);
    let table = [
        d(HDR, 16, F_NEXT, 1),
        d(DATA, 512, F_WRITE | F_NEXT, 2),
        d(DATA + 0x1000, 512, F_WRITE | F_NEXT, 3),
        d(STATUS, 1, F_WRITE, 0),
    ];
    for (i, t) in table.iter().enumerate() {
        rig.mem
            .write_obj(*t, GuestAddress(TABLE + 16 * i as u64))
            .unwrap();
    }
    let a = rig.run(
        &[d(TABLE, 64, F_INDIRECT, 0)],
        &[(DATA, DATA + 512), (DATA + 0x1000, DATA + 0x1200)],
    );
    assert_eq!(a, ok(1025));
    let mut got = vec![0u8; 512];
    rig.mem
        .read_slice(&mut got, GuestAddress(DATA + 0x1000))
        .unwrap();
    assert_eq!(got, rig.disk()[512..1024]);
}

#[test]
fn buffer_across_memory_regions_and_header_sharing_a_buffer() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    // Header and payload in one readable buffer that crosses from region 0 into region 1.
    let start = 0x10_0000 - 16 - 256;
    rig.write_header(start, req_type::OUT, 4);
    fill(&rig, start + 16, 512, 0x5A);
    let a = rig.run(
        &[d(start, 16 + 512, F_NEXT, 1), d(STATUS, 1, F_WRITE, 0)],
        &[],
    );
    assert_eq!(a, ok(1));
    assert!(rig.disk()[4 * 512..5 * 512].iter().all(|&b| b == 0x5A));
}

#[test]
fn status_may_share_the_last_writable_buffer() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, 1);
    // One writable buffer of 513 bytes: 512 payload + the status byte at its end.
    let a = {
        rig.mem.write_obj(0xEEu8, GuestAddress(DATA + 512)).unwrap();
        rig.submit(&[d(HDR, 16, F_NEXT, 1), d(DATA, 513, F_WRITE, 0)], 0)
    };
    assert_eq!(a, Some((0, 513)));
    let s: u8 = rig.mem.read_obj(GuestAddress(DATA + 512)).unwrap();
    assert_eq!(s, status::OK);
}

// ---- malformed requests: one field changed from a valid one ----

#[test]
fn unknown_type_is_unsupp() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, 3, 0);
    assert_eq!(rig.run(&read_chain(512), &[]), err(status::UNSUPP));
}

#[test]
fn legacy_barrier_flag_in_type_is_unsupp() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::OUT | 0x8000_0000, 0);
    assert_eq!(rig.run(&write_chain(512), &[]), err(status::UNSUPP));
    disk_unchanged(&rig);
}

#[test]
fn write_to_read_only_disk_is_ioerr_and_writes_nothing() {
    let mut rig = Rig::new(true, EngineKind::Sync);
    rig.write_header(HDR, req_type::OUT, 0);
    fill(&rig, DATA, 512, 0xFF);
    assert_eq!(rig.run(&write_chain(512), &[]), err(status::IOERR));
    disk_unchanged(&rig);
}

#[test]
fn discard_on_read_only_disk_is_unsupp_as_not_offered() {
    let mut rig = Rig::new(true, EngineKind::Sync);
    rig.write_header(HDR, req_type::DISCARD, 0);
    rig.write_segment(DATA, 0, 8, 0);
    assert_eq!(rig.run(&seg_chain(), &[]), err(status::UNSUPP));
    disk_unchanged(&rig);
}

#[test]
fn read_at_capacity_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, CAPACITY);
    assert_eq!(rig.run(&read_chain(512), &[]), err(status::IOERR));
}

#[test]
fn write_straddling_the_end_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::OUT, CAPACITY - 1);
    assert_eq!(rig.run(&write_chain(1024), &[]), err(status::IOERR));
    disk_unchanged(&rig);
}

#[test]
fn overflowing_sector_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::OUT, u64::MAX);
    assert_eq!(rig.run(&write_chain(512), &[]), err(status::IOERR));
    disk_unchanged(&rig);
}

#[test]
fn length_not_multiple_of_512_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::OUT, 0);
    assert_eq!(rig.run(&write_chain(513), &[]), err(status::IOERR));
    disk_unchanged(&rig);
}

#[test]
fn short_header_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::OUT, 0);
    let mut c = write_chain(512);
    c[0] = d(HDR, 12, F_NEXT, 1);
    // 12 header bytes + 512 payload bytes: the "header" would swallow payload; with only
    // readable bytes 524 the parse succeeds as a 508-byte payload, which is unaligned.
    assert_eq!(rig.run(&c, &[]), err(status::IOERR));
    let only_hdr = vec![d(HDR, 12, F_NEXT, 1), d(STATUS, 1, F_WRITE, 0)];
    assert_eq!(rig.run(&only_hdr, &[]), err(status::IOERR));
    disk_unchanged(&rig);
}

#[test]
fn read_only_status_descriptor_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, 0);
    let mut c = read_chain(512);
    c[2] = d(STATUS, 1, 0, 0);
    assert_eq!(rig.run(&c, &[]), unanswered());
}

#[test]
fn zero_length_status_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    let c = vec![d(HDR, 16, F_NEXT, 1), d(STATUS, 0, F_WRITE, 0)];
    assert_eq!(rig.run(&c, &[]), unanswered());
}

#[test]
fn readable_after_writable_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, 0);
    let c = vec![
        d(HDR, 16, F_NEXT, 1),
        d(DATA, 512, F_WRITE | F_NEXT, 2),
        d(HDR2, 16, F_NEXT, 3),
        d(STATUS, 1, F_WRITE, 0),
    ];
    assert_eq!(rig.run(&c, &[]), err(status::IOERR));
}

#[test]
fn read_with_device_readable_payload_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, 0);
    assert_eq!(rig.run(&chain3(DATA, 512, 0), &[]), err(status::IOERR));
}

#[test]
fn write_with_device_writable_payload_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::OUT, 0);
    assert_eq!(
        rig.run(&chain3(DATA, 512, F_WRITE), &[]),
        err(status::IOERR)
    );
    disk_unchanged(&rig);
}

#[test]
fn payload_outside_guest_memory_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, 0);
    assert_eq!(
        rig.run(&chain3(OUTSIDE, 512, F_WRITE), &[]),
        err(status::IOERR)
    );
    // A buffer that starts inside memory and runs past its end.
    rig.write_header(HDR, req_type::OUT, 0);
    assert_eq!(
        rig.run(&chain3(MEM_END - 512, 1024, 0), &[]),
        err(status::IOERR)
    );
    disk_unchanged(&rig);
}

#[test]
fn header_outside_guest_memory_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    let mut c = flush_chain();
    c[0] = d(OUTSIDE, 16, F_NEXT, 1);
    assert_eq!(rig.run(&c, &[]), err(status::IOERR));
}

#[test]
fn status_outside_guest_memory_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    let c = vec![d(HDR, 16, F_NEXT, 1), d(OUTSIDE, 1, F_WRITE, 0)];
    assert_eq!(rig.run(&c, &[]), unanswered());
}

#[test]
fn next_index_out_of_range_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, 0);
    let mut c = read_chain(512);
    c[1] = d(DATA, 512, F_WRITE | F_NEXT, QSIZE);
    assert_eq!(rig.run(&c, &[]), unanswered());
}

#[test]
fn looping_chain_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, 0);
    let mut c = read_chain(512);
    c[1] = d(DATA, 512, F_WRITE | F_NEXT, 0);
    assert_eq!(rig.run(&c, &[]), unanswered());
}

#[test]
fn indirect_without_negotiation_is_unanswerable() {
    let features = all_features() & !feature::bit(feature::RING_INDIRECT_DESC);
    let mut rig = Rig::with_features(false, EngineKind::Sync, features);
    rig.write_header(HDR, req_type::FLUSH, 0);
    for (i, t) in flush_chain().iter().enumerate() {
        rig.mem
            .write_obj(*t, GuestAddress(TABLE + 16 * i as u64))
            .unwrap();
    }
    assert_eq!(rig.run(&[d(TABLE, 32, F_INDIRECT, 0)], &[]), unanswered());
}

#[test]
fn indirect_table_of_bad_length_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    for (i, t) in flush_chain().iter().enumerate() {
        rig.mem
            .write_obj(*t, GuestAddress(TABLE + 16 * i as u64))
            .unwrap();
    }
    assert_eq!(rig.run(&[d(TABLE, 24, F_INDIRECT, 0)], &[]), unanswered());
    assert_eq!(rig.run(&[d(TABLE, 0, F_INDIRECT, 0)], &[]), unanswered());
}

#[test]
fn nested_indirect_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    let table = [d(TABLE + 0x100, 32, F_INDIRECT, 0)];
    rig.mem.write_obj(table[0], GuestAddress(TABLE)).unwrap();
    assert_eq!(rig.run(&[d(TABLE, 16, F_INDIRECT, 0)], &[]), unanswered());
}

#[test]
fn indirect_with_next_flag_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    for (i, t) in flush_chain().iter().enumerate() {
        rig.mem
            .write_obj(*t, GuestAddress(TABLE + 16 * i as u64))
            .unwrap();
    }
    let c = vec![
        d(TABLE, 32, F_INDIRECT | F_NEXT, 1),
        d(STATUS, 1, F_WRITE, 0),
    ];
    assert_eq!(rig.run(&c, &[]), unanswered());
}

#[test]
fn flush_with_payload_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    assert_eq!(rig.run(&write_chain(512), &[]), err(status::IOERR));
    disk_unchanged(&rig);
}

#[test]
fn flush_without_negotiation_is_unsupp() {
    let features = all_features() & !feature::bit(feature::FLUSH);
    let mut rig = Rig::with_features(false, EngineKind::Sync, features);
    rig.write_header(HDR, req_type::FLUSH, 0);
    assert_eq!(rig.run(&flush_chain(), &[]), err(status::UNSUPP));
}

#[test]
fn get_id_without_room_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::GET_ID, 0);
    assert_eq!(rig.run(&flush_chain(), &[]), err(status::IOERR));
}

#[test]
fn discard_with_unmap_flag_is_unsupp() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::DISCARD, 0);
    rig.write_segment(DATA, 0, 8, 1);
    assert_eq!(rig.run(&seg_chain(), &[]), err(status::UNSUPP));
    disk_unchanged(&rig);
}

#[test]
fn write_zeroes_with_reserved_flag_is_unsupp() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::WRITE_ZEROES, 0);
    rig.write_segment(DATA, 0, 8, 2);
    assert_eq!(rig.run(&seg_chain(), &[]), err(status::UNSUPP));
    disk_unchanged(&rig);
}

#[test]
fn discard_with_two_segments_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::DISCARD, 0);
    rig.write_segment(DATA, 0, 8, 0);
    rig.write_segment(DATA + 16, 16, 8, 0);
    let mut c = seg_chain();
    c[1] = d(DATA, 32, F_NEXT, 2);
    assert_eq!(rig.run(&c, &[]), err(status::IOERR));
    disk_unchanged(&rig);
}

#[test]
fn discard_past_capacity_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::DISCARD, 0);
    rig.write_segment(DATA, CAPACITY - 4, 8, 0);
    assert_eq!(rig.run(&seg_chain(), &[]), err(status::IOERR));
    disk_unchanged(&rig);
}

#[test]
fn write_zeroes_larger_than_the_limit_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::WRITE_ZEROES, 0);
    rig.write_segment(DATA, 0, crate::config::MAX_DISCARD_SECTORS + 1, 0);
    assert_eq!(rig.run(&seg_chain(), &[]), err(status::IOERR));
    disk_unchanged(&rig);
}

#[test]
fn write_zeroes_without_negotiation_is_unsupp() {
    let features = all_features() & !feature::bit(feature::WRITE_ZEROES);
    let mut rig = Rig::with_features(false, EngineKind::Sync, features);
    rig.write_header(HDR, req_type::WRITE_ZEROES, 0);
    rig.write_segment(DATA, 0, 8, 0);
    assert_eq!(rig.run(&seg_chain(), &[]), err(status::UNSUPP));
    disk_unchanged(&rig);
}

#[test]
fn buffer_larger_than_size_max_is_ioerr() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::OUT, 0);
    let len = crate::config::SIZE_MAX + 512;
    assert_eq!(rig.run(&write_chain(len), &[]), err(status::IOERR));
    disk_unchanged(&rig);
}

// ---- broken rings: the queue stops, nothing panics ----

#[test]
fn head_outside_the_queue_stops_the_queue() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    assert_eq!(rig.submit(&flush_chain(), QSIZE + 3), None);
    assert!(rig.dev.queue_broken(0));
    // A later valid request on the stopped queue is not served.
    assert_eq!(rig.submit(&flush_chain(), 0), None);
}

#[test]
fn avail_index_running_ahead_stops_the_queue() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    rig.next_avail = QSIZE + 5;
    assert_eq!(rig.submit(&flush_chain(), 0), None);
    assert!(rig.dev.queue_broken(0));
}

#[test]
fn many_requests_in_one_batch_all_complete() {
    let rig = Rig::new(false, EngineKind::IoUring);
    // Five independent reads, heads 0, 3, 6, 9, 12, each with its own header/status.
    for r in 0..5u16 {
        let base = r * 3;
        let hdr = HDR + 0x20 * u64::from(r);
        let st = STATUS + u64::from(r);
        rig.write_header(hdr, req_type::IN, u64::from(r));
        rig.store_desc(base, d(hdr, 16, F_NEXT, base + 1));
        let data = DATA + 512 * u64::from(r);
        rig.store_desc(base + 1, d(data, 512, F_WRITE | F_NEXT, base + 2));
        rig.store_desc(base + 2, d(st, 1, F_WRITE, 0));
        rig.set_avail(r, base);
    }
    rig.set_avail_idx(5);
    for _ in 0..1000 {
        rig.dev.run_worker(0, &rig.vring);
        if rig.used_idx() == 5 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(rig.used_idx(), 5);
    let disk = rig.disk();
    for r in 0..5u64 {
        let s: u8 = rig.mem.read_obj(GuestAddress(STATUS + r)).unwrap();
        assert_eq!(s, status::OK);
        let mut got = vec![0u8; 512];
        rig.mem
            .read_slice(&mut got, GuestAddress(DATA + 512 * r))
            .unwrap();
        assert_eq!(got, disk[(r * 512) as usize..(r * 512 + 512) as usize]);
    }
}

// ---- configuration space ----

#[test]
fn driver_write_of_writeback_through_set_config_takes_effect() {
    use vhost_user_backend::VhostUserBackend;
    let rig = Rig::new(false, EngineKind::Sync);
    let wb = |d: &BlkDevice| d.get_config(proto::config::WRITEBACK_OFFSET as u32, 1)[0];
    assert_eq!(wb(&rig.dev), 1, "writeback by default");
    rig.dev.set_config(32, &[0]).unwrap();
    assert_eq!(wb(&rig.dev), 0, "the driver switched to writethrough");
    assert!(rig.dev.write_through());
    rig.dev.set_config(32, &[1]).unwrap();
    assert_eq!(wb(&rig.dev), 1);
    assert!(!rig.dev.write_through());
    // Other fields are read-only.
    assert!(rig.dev.set_config(0, &[0; 8]).is_err());
    assert_eq!(
        rig.dev.get_config(0, 8),
        CAPACITY.to_le_bytes().to_vec(),
        "capacity unchanged"
    );
    // Without CONFIG_WCE the write is ignored.
    let rig = Rig::with_features(
        false,
        EngineKind::Sync,
        all_features() & !feature::bit(feature::CONFIG_WCE),
    );
    rig.dev.set_config(32, &[0]).unwrap();
    assert_eq!(wb(&rig.dev), 1);
}

#[test]
fn config_space_reports_the_disk_and_limits() {
    use vhost_user_backend::VhostUserBackend;
    let rig = Rig::new(false, EngineKind::Sync);
    let c = proto::BlkConfig::from_bytes(&rig.dev.get_config(0, proto::config::CONFIG_LEN as u32));
    assert_eq!(c.capacity, CAPACITY);
    assert_eq!(c.seg_max, u32::from(QSIZE) - 2);
    assert_eq!(c.size_max, crate::config::SIZE_MAX);
    assert_eq!(c.blk_size, 512);
    assert_eq!(c.num_queues, 1);
    assert_eq!((c.max_discard_seg, c.max_write_zeroes_seg), (1, 1));
    assert!(c.max_discard_sectors > 0 && c.max_write_zeroes_sectors > 0);
    assert_eq!(c.write_zeroes_may_unmap, 1);
    // Reads past the defined fields are zero-filled; absurd ranges are refused.
    assert_eq!(rig.dev.get_config(72, 24), vec![0; 24]);
    assert!(rig.dev.get_config(u32::MAX, 4).is_empty());
}

// ---- notification suppression ----

/// A call eventfd on the rig's queue; returns how many notifications it has counted.
fn attach_call(rig: &Rig) -> vmm_sys_util::eventfd::EventFd {
    use std::os::fd::{FromRawFd, IntoRawFd};
    let call = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let dup = call.try_clone().unwrap();
    // SAFETY: into_raw_fd hands over ownership of a valid fd to the File.
    let file = unsafe { std::fs::File::from_raw_fd(dup.into_raw_fd()) };
    rig.vring[0].set_call(Some(file));
    call
}

fn notifications(call: &vmm_sys_util::eventfd::EventFd) -> u64 {
    call.read().unwrap_or(0)
}

/// Publish `n` flush requests (heads 0, 2, 4, ...) in one go and run the worker once.
fn flush_batch(rig: &mut Rig, n: u16) {
    for r in 0..n {
        let hdr = HDR + 0x20 * u64::from(r);
        rig.write_header(hdr, req_type::FLUSH, 0);
        rig.store_desc(2 * r, d(hdr, 16, F_NEXT, 2 * r + 1));
        rig.store_desc(2 * r + 1, d(STATUS + u64::from(r), 1, F_WRITE, 0));
        rig.set_avail(rig.next_avail, 2 * r);
        rig.next_avail = rig.next_avail.wrapping_add(1);
    }
    rig.set_avail_idx(rig.next_avail);
    let target = rig.used_idx().wrapping_add(n);
    for _ in 0..1000 {
        rig.dev.run_worker(0, &rig.vring);
        if rig.used_idx() == target {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    panic!("batch of {n} not completed");
}

#[test]
fn a_batch_is_published_with_one_notification() {
    let mut rig = Rig::with_features(
        false,
        EngineKind::Sync,
        all_features() & !feature::bit(feature::RING_EVENT_IDX),
    );
    let call = attach_call(&rig);
    flush_batch(&mut rig, 5);
    assert_eq!(rig.used_idx(), 5);
    assert_eq!(notifications(&call), 1, "one interrupt for the batch of 5");
}

#[test]
fn no_interrupt_flag_is_honoured_without_event_idx() {
    let mut rig = Rig::with_features(
        false,
        EngineKind::Sync,
        all_features() & !feature::bit(feature::RING_EVENT_IDX),
    );
    let call = attach_call(&rig);
    rig.mem.write_obj(1u16, GuestAddress(rig.avail)).unwrap(); // VRING_AVAIL_F_NO_INTERRUPT
    flush_batch(&mut rig, 3);
    assert_eq!(
        notifications(&call),
        0,
        "the driver asked not to be interrupted"
    );
    rig.mem.write_obj(0u16, GuestAddress(rig.avail)).unwrap();
    flush_batch(&mut rig, 1);
    assert_eq!(notifications(&call), 1);
}

#[test]
fn used_event_is_honoured_with_event_idx() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    let call = attach_call(&rig);
    let used_event = GuestAddress(rig.avail + 4 + 2 * u64::from(QSIZE));
    // The driver wants to hear only when the used index passes 10.
    rig.mem.write_obj(10u16, used_event).unwrap();
    flush_batch(&mut rig, 4);
    assert_eq!(
        notifications(&call),
        0,
        "used index 4 has not passed used_event 10"
    );
    flush_batch(&mut rig, 4);
    assert_eq!(
        notifications(&call),
        0,
        "used index 8 has not passed used_event 10"
    );
    flush_batch(&mut rig, 4);
    assert_eq!(
        notifications(&call),
        1,
        "used index 12 passed used_event 10"
    );
    // Re-armed at the current index: the next completion notifies.
    rig.mem.write_obj(rig.used_idx(), used_event).unwrap();
    flush_batch(&mut rig, 1);
    assert_eq!(notifications(&call), 1);
}
