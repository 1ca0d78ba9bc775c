//! Chains with no trustworthy status byte. The device must never put them on the used
//! ring (a guest would read whatever its status byte held as the answer): the queue stops,
//! the frontend is told through the vring's error eventfd, nothing in guest memory or on
//! the disk changes, and GET_VRING_BASE answers the index of the chain, so that every
//! request before it was answered and none after it was taken.

use super::*;

/// Publish `c` (head 0) after one good request, and check all of the above.
fn assert_unanswered(rig: &mut Rig, c: &[RawDescriptor]) {
    // One good request first: it must complete; the broken one after it must not.
    let hdr_before = {
        let mut h = [0u8; 16];
        rig.mem.read_slice(&mut h, GuestAddress(HDR)).unwrap();
        h
    };
    rig.write_header(HDR2, req_type::FLUSH, 0);
    rig.store_desc(QSIZE - 2, d(HDR2, 16, F_NEXT, QSIZE - 1));
    rig.store_desc(QSIZE - 1, d(STATUS + 1, 1, F_WRITE, 0));
    rig.set_avail(rig.next_avail, QSIZE - 2);
    rig.next_avail += 1;
    rig.set_avail_idx(rig.next_avail);
    assert_eq!(rig.process(), Some((u32::from(QSIZE) - 2, 1)));
    rig.mem.write_slice(&hdr_before, GuestAddress(HDR)).unwrap();
    let good = rig.used_idx();

    rig.mem.write_obj(0xEEu8, GuestAddress(STATUS)).unwrap();
    rig.publish(c, 0);
    let before = snapshot(&rig.mem);
    assert_eq!(
        rig.process(),
        None,
        "an unanswerable chain reached the used ring"
    );
    assert_eq!(rig.used_idx(), good);
    let after = snapshot(&rig.mem);
    let flags = (rig.used, rig.used + 2);
    for (i, (a, b)) in before.iter().zip(&after).enumerate() {
        let i = i as u64;
        assert!(
            a == b || (i >= flags.0 && i < flags.1),
            "guest byte {i:#x} changed from {a:#x} to {b:#x}"
        );
    }
    assert!(rig.broken(), "the queue must stop");
    assert_eq!(rig.err.read().unwrap_or(0), 1, "the frontend is told once");
    disk_unchanged(rig);
    // A later valid request on the stopped queue is not served.
    rig.write_header(HDR2, req_type::FLUSH, 0);
    rig.set_avail(rig.next_avail, QSIZE - 2);
    rig.next_avail += 1;
    rig.set_avail_idx(rig.next_avail);
    assert_eq!(rig.process(), None);
    // GET_VRING_BASE: the broken chain is the next one to process.
    assert_eq!(rig.stop(), good);
}

#[test]
fn read_only_status_descriptor_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, 0);
    let mut c = read_chain(512);
    c[2] = d(STATUS, 1, 0, 0);
    assert_unanswered(&mut rig, &c);
}

#[test]
fn zero_length_status_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    let c = vec![d(HDR, 16, F_NEXT, 1), d(STATUS, 0, F_WRITE, 0)];
    assert_unanswered(&mut rig, &c);
}

#[test]
fn status_outside_guest_memory_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    let c = vec![d(HDR, 16, F_NEXT, 1), d(OUTSIDE, 1, F_WRITE, 0)];
    assert_unanswered(&mut rig, &c);
}

#[test]
fn next_index_out_of_range_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, 0);
    let mut c = read_chain(512);
    c[1] = d(DATA, 512, F_WRITE | F_NEXT, QSIZE);
    assert_unanswered(&mut rig, &c);
}

#[test]
fn looping_chain_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, 0);
    let mut c = read_chain(512);
    c[1] = d(DATA, 512, F_WRITE | F_NEXT, 0);
    assert_unanswered(&mut rig, &c);
}

#[test]
fn indirect_without_negotiation_is_unanswerable() {
    let features = all_features() & !feature::bit(feature::RING_INDIRECT_DESC);
    let mut rig = Rig::with_features(false, EngineKind::Sync, features);
    rig.write_header(HDR, req_type::FLUSH, 0);
    store_table(&rig, &flush_chain());
    assert_unanswered(&mut rig, &[d(TABLE, 32, F_INDIRECT, 0)]);
}

#[test]
fn indirect_table_of_bad_length_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    store_table(&rig, &flush_chain());
    assert_unanswered(&mut rig, &[d(TABLE, 24, F_INDIRECT, 0)]);
    for len in [0, 16 * 1025] {
        let mut rig = Rig::new(false, EngineKind::Sync);
        rig.write_header(HDR, req_type::FLUSH, 0);
        store_table(&rig, &flush_chain());
        assert_unanswered(&mut rig, &[d(TABLE, len, F_INDIRECT, 0)]);
    }
}

#[test]
fn nested_indirect_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    let table = [d(TABLE + 0x100, 32, F_INDIRECT, 0)];
    rig.mem.write_obj(table[0], GuestAddress(TABLE)).unwrap();
    assert_unanswered(&mut rig, &[d(TABLE, 16, F_INDIRECT, 0)]);
}

#[test]
fn indirect_with_next_flag_is_unanswerable() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    store_table(&rig, &flush_chain());
    let c = vec![
        d(TABLE, 32, F_INDIRECT | F_NEXT, 1),
        d(STATUS, 1, F_WRITE, 0),
    ];
    assert_unanswered(&mut rig, &c);
}
