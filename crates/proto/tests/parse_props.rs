//! Property test: whatever the driver puts in the descriptor table, parsing never panics,
//! and a request it accepts stays inside guest memory and inside the disk.

use proptest::prelude::*;
use vblk_proto::wire::{req_type, SECTOR_SIZE};
use vblk_proto::{Limits, Parser, Request, RequestKind, RingInfo};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

const MEM: u64 = 0x10_0000;
const TABLE: u64 = 0x1000;
const QSIZE: u16 = 16;
const CAPACITY: u64 = 4096;

fn addr() -> impl Strategy<Value = u64> {
    prop_oneof![
        (0x2000u64..0x8000),
        Just(MEM - 1),
        Just(MEM - 512),
        Just(MEM),
        (MEM..MEM * 4),
        Just(u64::MAX - 8),
        Just(TABLE),
    ]
}

fn desc() -> impl Strategy<Value = (u64, u32, u16, u16)> {
    (
        addr(),
        prop_oneof![
            Just(1u32),
            Just(16),
            Just(512),
            Just(4096),
            0u32..70_000,
            Just(u32::MAX)
        ],
        0u16..8,
        prop_oneof![0u16..QSIZE, Just(QSIZE), Just(u16::MAX)],
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]
    #[test]
    fn parse_never_panics_and_accepted_requests_are_in_bounds(
        descs in proptest::collection::vec(desc(), 1..10),
        head in prop_oneof![0u16..10, Just(QSIZE), Just(u16::MAX)],
        type_ in prop_oneof![Just(req_type::IN), Just(req_type::OUT), Just(req_type::FLUSH),
                             Just(req_type::GET_ID), Just(req_type::DISCARD),
                             Just(req_type::WRITE_ZEROES), any::<u32>()],
        sector in prop_oneof![0u64..CAPACITY, Just(CAPACITY), Just(u64::MAX), any::<u64>()],
        seg in (any::<u64>(), any::<u32>(), 0u32..4),
        indirect in any::<bool>(),
        read_only in any::<bool>(),
    ) {
        let mem: GuestMemoryMmap<()> = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
        for (i, &(a, l, f, n)) in descs.iter().enumerate() {
            let mut raw = [0u8; 16];
            raw[0..8].copy_from_slice(&a.to_le_bytes());
            raw[8..12].copy_from_slice(&l.to_le_bytes());
            raw[12..14].copy_from_slice(&f.to_le_bytes());
            raw[14..16].copy_from_slice(&n.to_le_bytes());
            mem.write_slice(&raw, GuestAddress(TABLE + 16 * i as u64)).unwrap();
        }
        // Put a header and a segment where buffers are likely to point.
        for at in (0x2000u64..0x8000).step_by(0x200) {
            let mut h = [0u8; 32];
            h[0..4].copy_from_slice(&type_.to_le_bytes());
            h[8..16].copy_from_slice(&sector.to_le_bytes());
            h[16..24].copy_from_slice(&seg.0.to_le_bytes());
            h[24..28].copy_from_slice(&seg.1.to_le_bytes());
            h[28..32].copy_from_slice(&seg.2.to_le_bytes());
            mem.write_slice(&h, GuestAddress(at)).unwrap();
        }
        let limits = Limits {
            capacity: CAPACITY,
            seg_max: 14,
            read_only,
            flush: true,
            discard: true,
            write_zeroes: true,
            max_discard_sectors: 1024,
            max_write_zeroes_sectors: 1024,
        };
        let ring = RingInfo { desc_table: GuestAddress(TABLE), size: QSIZE, indirect, max_indirect: QSIZE };
        let mut parser = Parser::new(32);
        let mut req = Request::with_capacity(32);
        if parser.parse(&mem, ring, head, &limits, &mut req).is_ok() {
            let base = mem.get_host_address(GuestAddress(0)).unwrap() as u64;
            let inside = |p: u64, n: u64| p >= base && p + n <= base + MEM;
            prop_assert!(inside(req.status_ptr as u64, 1));
            let mut total = 0u64;
            for v in &req.iov {
                prop_assert!(inside(v.iov_base as u64, v.iov_len as u64));
                total += v.iov_len as u64;
            }
            match req.kind {
                RequestKind::In | RequestKind::Out => {
                    prop_assert_eq!(total, req.len);
                    prop_assert_eq!(req.len % SECTOR_SIZE, 0);
                    prop_assert!(req.sector + req.len / SECTOR_SIZE <= CAPACITY);
                    prop_assert!(!(read_only && req.kind == RequestKind::Out));
                }
                RequestKind::Discard | RequestKind::WriteZeroes { .. } => {
                    prop_assert!(!read_only);
                    prop_assert!(req.sector + req.len / SECTOR_SIZE <= CAPACITY);
                }
                RequestKind::GetId => prop_assert!(total > 0 && total <= 20),
                RequestKind::Flush => prop_assert!(req.iov.is_empty()),
            }
        }
    }
}

/// A header and a discard segment are read whole however the driver cuts the readable
/// buffers (in one, or in pieces of every size, at any alignment) and wherever the table is.
#[test]
fn header_and_segment_are_read_across_any_cut_of_the_readable_buffers() {
    let mem: GuestMemoryMmap<()> =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
    // A write-zeroes request: header (type, sector 0x0102_0304_0506_0708) and one segment
    // (sector 7, 9 sectors, UNMAP), 32 readable bytes at 0x2000, status at 0x3000.
    let mut bytes = [0u8; 32];
    bytes[0..4].copy_from_slice(&req_type::WRITE_ZEROES.to_le_bytes());
    bytes[8..16].copy_from_slice(&0x0102_0304_0506_0708u64.to_le_bytes());
    bytes[16..24].copy_from_slice(&7u64.to_le_bytes());
    bytes[24..28].copy_from_slice(&9u32.to_le_bytes());
    bytes[28..32].copy_from_slice(&1u32.to_le_bytes());
    mem.write_slice(&bytes, GuestAddress(0x2000)).unwrap();
    let limits = Limits {
        capacity: CAPACITY,
        seg_max: 14,
        read_only: false,
        flush: true,
        discard: true,
        write_zeroes: true,
        max_discard_sectors: 1024,
        max_write_zeroes_sectors: 1024,
    };
    let put = |table: u64, i: u16, addr: u64, len: u32, flags: u16, next: u16| {
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..16].copy_from_slice(&next.to_le_bytes());
        mem.write_slice(&raw, GuestAddress(table + 16 * u64::from(i)))
            .unwrap();
    };
    let cuts: [&[u32]; 6] = [
        &[32],
        &[16, 16],
        &[1, 31],
        &[5, 11, 7, 9],
        &[15, 2, 15],
        &[3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2],
    ];
    // The spec aligns the table to 16 bytes; a driver that does not is read all the same.
    for (table, cut) in [TABLE, TABLE + 3]
        .into_iter()
        .flat_map(|t| cuts.iter().map(move |c| (t, c)))
    {
        let ring = RingInfo {
            desc_table: GuestAddress(table),
            size: QSIZE,
            indirect: false,
            max_indirect: QSIZE,
        };
        let mut at = 0x2000;
        for (i, &len) in cut.iter().enumerate() {
            put(table, i as u16, at, len, 1, i as u16 + 1);
            at += u64::from(len);
        }
        put(table, cut.len() as u16, 0x3000, 1, 2, 0);
        let mut parser = Parser::new(32);
        let mut req = Request::with_capacity(32);
        parser
            .parse(&mem, ring, 0, &limits, &mut req)
            .unwrap_or_else(|e| panic!("table {table:#x}, cut {cut:?}: {e:?}"));
        assert_eq!(
            (req.kind, req.sector, req.len),
            (RequestKind::WriteZeroes { unmap: true }, 7, 9 * SECTOR_SIZE),
            "table {table:#x}, cut {cut:?}"
        );
    }
}
