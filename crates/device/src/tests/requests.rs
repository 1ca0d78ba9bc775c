//! Requests that get an answer: every valid request type, and malformed requests (one
//! field changed from a valid one) answered with IOERR or UNSUPP.

use super::*;

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
    store_table(&rig, &table);
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
fn discard_and_write_zeroes_on_read_only_disk_are_ioerr() {
    // Offered whatever --read-only says (as qemu-storage-daemon does), refused like writes.
    for type_ in [req_type::DISCARD, req_type::WRITE_ZEROES] {
        let mut rig = Rig::new(true, EngineKind::Sync);
        assert_ne!(rig.blk.features & feature::bit(feature::DISCARD), 0);
        assert_ne!(rig.blk.features & feature::bit(feature::RO), 0);
        rig.write_header(HDR, type_, 0);
        rig.write_segment(DATA, 0, 8, 0);
        assert_eq!(
            rig.run(&seg_chain(), &[]),
            err(status::IOERR),
            "type {type_}"
        );
        disk_unchanged(&rig);
    }
}

#[test]
fn buffer_larger_than_size_max_is_served() {
    // size_max is what Linux splits segments at; a client may send one buffer of any
    // size within what it was told the device takes (libblkio: seg_max * size_max).
    let mut rig = Rig::new(false, EngineKind::IoUring);
    let len = crate::config::SIZE_MAX + 512;
    rig.write_header(HDR, req_type::OUT, 0);
    fill(&rig, DATA, len as usize, 0x3C);
    assert_eq!(rig.run(&write_chain(len), &[]), ok(1));
    assert!(rig.disk()[..len as usize].iter().all(|&b| b == 0x3C));
    rig.write_header(HDR, req_type::IN, 0);
    fill(&rig, DATA, len as usize, 0);
    let a = rig.run(&read_chain(len), &[(DATA, DATA + u64::from(len))]);
    assert_eq!(a, ok(len + 1));
}

/// Linux builds an indirect table of `seg_max + 2` descriptors whatever the queue size:
/// with a 16-entry queue, a table of 256 entries (254 data segments) must be served.
#[test]
fn indirect_table_longer_than_the_queue_is_served() {
    let mut rig = Rig::new(false, EngineKind::IoUring);
    let seg_max = rig.blk.base_limits.seg_max as u16;
    assert!(seg_max + 2 > QSIZE);
    rig.write_header(HDR, req_type::IN, 0);
    // 254 data segments of 512 bytes, each in a different 4 KiB page (like a fragmented
    // guest), between the header and the status.
    let seg = |i: u16| 0x2_0000 + 0x1000 * u64::from(i);
    let mut table = vec![d(HDR, 16, F_NEXT, 1)];
    for i in 0..seg_max {
        table.push(d(seg(i), 512, F_WRITE | F_NEXT, i + 2));
    }
    table.push(d(STATUS, 1, F_WRITE, 0));
    assert_eq!(table.len(), usize::from(seg_max) + 2);
    store_table(&rig, &table);
    let writable: Vec<(u64, u64)> = (0..seg_max).map(|i| (seg(i), seg(i) + 512)).collect();
    let len = 16 * table.len() as u32;
    let a = rig.run(&[d(TABLE, len, F_INDIRECT, 0)], &writable);
    assert_eq!(a, ok(u32::from(seg_max) * 512 + 1));
    let disk = rig.disk();
    for i in 0..seg_max {
        let mut got = vec![0u8; 512];
        rig.mem.read_slice(&mut got, GuestAddress(seg(i))).unwrap();
        let at = usize::from(i) * 512;
        assert_eq!(got, disk[at..at + 512], "segment {i}");
    }
    // One more segment than seg_max is answered (IOERR), not dropped.
    rig.write_header(HDR, req_type::IN, 0);
    let mut table = vec![d(HDR, 16, F_NEXT, 1)];
    for i in 0..=seg_max {
        table.push(d(seg(i), 512, F_WRITE | F_NEXT, i + 2));
    }
    table.push(d(STATUS, 1, F_WRITE, 0));
    store_table(&rig, &table);
    let len = 16 * table.len() as u32;
    let writable: Vec<(u64, u64)> = (0..=seg_max).map(|i| (seg(i), seg(i) + 512)).collect();
    assert_eq!(
        rig.run(&[d(TABLE, len, F_INDIRECT, 0)], &writable),
        err(status::IOERR)
    );
    assert!(!rig.broken());
}

/// A request the disk serves within the pass that took it is timed to its completion,
/// not to the start of that pass (which read 0 ns for every such request).
#[test]
fn a_request_done_within_its_pass_is_timed() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::IN, 3);
    assert_eq!(rig.run(&read_chain(1024), &[(DATA, DATA + 1024)]), ok(1025));
    let s = rig.stats.snapshot(0);
    let read = &s["ops"]["read"];
    assert_eq!(read["ios"], 1, "{s}");
    assert!(read["lat"]["sum_ns"].as_u64().unwrap() > 0, "{read}");
}
