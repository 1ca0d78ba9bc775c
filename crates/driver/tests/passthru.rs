//! Passthru against vblk's own device: raw commands of every type in batches, raw statuses
//! and used lengths back, completions by polling.

use std::time::Duration;

use proto::wire::{req_type, status, DiscardSegment, ID_BYTES};
use vblk_driver::{Cmd, Cqe, Data, Disk, DiskOptions, Passthru, PassthruOptions};

mod common;
use common::{mem_device, pattern, start};

const EMPTY: Cqe = Cqe {
    user_data: 0,
    status: Ok(0xEE),
    used_len: 0,
};

fn passthru(sock: &std::path::Path, polled: bool) -> (Disk, Passthru) {
    let disk = Disk::attach(
        sock,
        &DiskOptions {
            num_queues: Some(1),
            ..DiskOptions::default()
        },
    )
    .unwrap();
    let q = disk.take_queue(0).unwrap();
    let pt = Passthru::new(q, PassthruOptions { polled })
        .map_err(|e| e.error)
        .unwrap();
    (disk, pt)
}

fn cmd(type_: u32, sector: u64, data: Option<Data>, user_data: u64) -> Cmd {
    Cmd {
        type_,
        ioprio: 0,
        sector,
        data,
        user_data,
    }
}

fn data(buf: u16, len: u32, from_device: bool) -> Option<Data> {
    Some(Data {
        buf,
        offset: 0,
        len,
        from_device,
    })
}

/// Submit what is queued and wait for `n` completions, sorted by user_data.
fn run(pt: &mut Passthru, n: usize) -> Vec<Cqe> {
    assert_eq!(pt.submit().unwrap(), n);
    let mut out = vec![EMPTY; n];
    let got = pt.wait(n, &mut out, None).unwrap();
    assert_eq!(got, n);
    out.sort_by_key(|c| c.user_data);
    out
}

#[test]
fn every_request_type_goes_through_and_its_raw_status_comes_back() {
    let (_d, sock) = start(mem_device(1));
    for polled in [true, false] {
        let (disk, mut pt) = passthru(&sock, polled);
        let capacity_sectors = disk.info().capacity_sectors;
        let bufs = (0..4).map(|_| pt.alloc(8192).unwrap()).collect();
        let first = pt.register(bufs).unwrap();
        assert_eq!(first, 0);
        let payload = pattern(42, 8192);
        pt.buffer_mut(0).unwrap().copy_from_slice(&payload);

        // A batch of four: write, flush, read back into another buffer, GET_ID.
        pt.push(cmd(req_type::OUT, 16, data(0, 8192, false), 1))
            .unwrap();
        pt.push(cmd(req_type::FLUSH, 0, None, 2)).unwrap();
        pt.push(cmd(req_type::GET_ID, 0, data(2, ID_BYTES as u32, true), 4))
            .unwrap();
        assert_eq!(pt.queued(), 3);
        let c = run(&mut pt, 3);
        assert_eq!(c[0].status, Ok(status::OK));
        assert_eq!(c[0].used_len, 1, "a write: only the status byte");
        assert_eq!(c[1].status, Ok(status::OK));
        assert_eq!(c[2].status, Ok(status::OK));
        assert_eq!(c[2].used_len, ID_BYTES as u32 + 1);
        let id = &pt.buffer(2).unwrap()[..ID_BYTES];
        assert!(id.iter().any(|&b| b != 0), "GET_ID wrote the serial");

        pt.push(cmd(req_type::IN, 16, data(1, 8192, true), 3))
            .unwrap();
        let c = run(&mut pt, 1);
        assert_eq!((c[0].status, c[0].used_len), (Ok(status::OK), 8193));
        assert_eq!(&pt.buffer(1).unwrap()[..], &payload[..]);

        // DISCARD and WRITE_ZEROES with their segment in a registered buffer.
        let seg = DiscardSegment {
            sector: 16u64.to_le(),
            num_sectors: 16u32.to_le(),
            flags: 0,
        };
        // SAFETY: DiscardSegment is 16 bytes of plain data.
        let raw: [u8; 16] = unsafe { std::mem::transmute(seg) };
        pt.buffer_mut(3).unwrap()[..16].copy_from_slice(&raw);
        pt.push(cmd(req_type::WRITE_ZEROES, 0, data(3, 16, false), 5))
            .unwrap();
        pt.push(cmd(req_type::DISCARD, 0, data(3, 16, false), 6))
            .unwrap();
        let c = run(&mut pt, 2);
        assert_eq!(c[0].status, Ok(status::OK));
        assert_eq!(c[1].status, Ok(status::OK));
        pt.push(cmd(req_type::IN, 16, data(1, 8192, true), 7))
            .unwrap();
        run(&mut pt, 1);
        assert!(pt.buffer(1).unwrap().iter().all(|&b| b == 0), "zeroed");

        // What the device refuses comes back raw: an unknown type and GET_LIFETIME are
        // UNSUPP, a read past the end is IOERR.
        pt.push(cmd(99, 0, None, 8)).unwrap();
        pt.push(cmd(req_type::GET_LIFETIME, 0, data(3, 8, true), 9))
            .unwrap();
        pt.push(cmd(req_type::IN, capacity_sectors, data(1, 4096, true), 10))
            .unwrap();
        let c = run(&mut pt, 3);
        assert_eq!(c[0].status, Ok(status::UNSUPP));
        assert_eq!(c[1].status, Ok(status::UNSUPP));
        assert_eq!(c[2].status, Ok(status::IOERR));
        assert_eq!(pt.in_flight(), 0);
        drop(pt);
        drop(disk);
    }
}

#[test]
fn bad_commands_are_refused_before_the_ring_with_the_numbers() {
    let (_d, sock) = start(mem_device(1));
    let (disk, mut pt) = passthru(&sock, true);
    let b = pt.alloc(4096).unwrap();
    pt.register(vec![b]).unwrap();
    let e = pt
        .push(cmd(req_type::IN, 0, data(3, 512, true), 1))
        .unwrap_err();
    assert!(
        e.to_string().contains("buffer 3 is not registered (1 are)"),
        "{e}"
    );
    let e = pt
        .push(cmd(req_type::IN, 0, data(0, 8192, true), 1))
        .unwrap_err();
    assert!(e.to_string().contains("4096 bytes long"), "{e}");
    // A full submission queue says so.
    for i in 0..usize::from(disk.info().queue_size) {
        pt.push(cmd(req_type::FLUSH, 0, None, i as u64)).unwrap();
    }
    let e = pt.push(cmd(req_type::FLUSH, 0, None, 0)).unwrap_err();
    assert!(e.to_string().contains("submission queue is full"), "{e}");
    let n = pt.submit().unwrap();
    let mut out = vec![EMPTY; n];
    let mut got = 0;
    while got < n {
        got += pt.wait(1, &mut out[got..], None).unwrap();
    }
    assert!(out.iter().all(|c| c.status == Ok(status::OK)));
}

#[test]
fn a_busy_queue_cannot_become_passthru_and_keeps_its_io() {
    let (_d, sock) = start(mem_device(1));
    let disk = Disk::attach(
        &sock,
        &DiskOptions {
            num_queues: Some(1),
            ..DiskOptions::default()
        },
    )
    .unwrap();
    let mut q = disk.take_queue(0).unwrap();
    let b = q.alloc(4096).unwrap();
    q.read(0, b, 7).unwrap();
    let refused = *Passthru::new(q, PassthruOptions::default()).unwrap_err();
    let (mut q, e) = (refused.queue, refused.error);
    assert!(e.to_string().contains("1 I/Os in flight"), "{e}");
    let c = q.wait(Some(Duration::from_secs(10))).unwrap();
    assert_eq!((c.token, c.result), (7, Ok(())));
}
