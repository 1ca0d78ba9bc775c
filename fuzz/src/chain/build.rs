//! Building a mostly valid request in guest memory from the fuzzer's bytes.
//!
//! The builder plays a virtio-blk driver: it picks what the device negotiated (limits,
//! indirect descriptors, queue size), a request of any type with its header, payload
//! segments and status byte, lays the buffers out in memory (header and status merged
//! with or split from their neighbours, buffers straddling the boundary between two
//! regions), and links them into a direct or an indirect chain as Linux does. Then,
//! rarely, it breaks something: a flag, a length, an address, a link, a loop, a nested or
//! misshapen indirect table, the head, a raw descriptor.
//!
//! It also says what it meant ([`Intent`]): a request that a driver may send and the
//! device must accept, one that breaks a rule of the request format (the device must
//! refuse it), or, after structural breakage, no opinion.

use proto::wire::{req_type, SEGMENT_FLAG_UNMAP};
use proto::{Limits, RequestKind, RingInfo};

use super::guest::{
    Guest, BUF_END, BUF_SPLIT, BUF_START, INDIRECT, TABLE, TABLES_END, TABLE_SPILL, TOP, TOP_END,
};
use crate::input::Input;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;
/// Most data segments one request gets (the tables hold 256 and 768 entries).
const MAX_DATA_SEGS: u64 = 240;

/// What the builder meant the request to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Intent {
    /// A request a driver may send: the device must accept it as this.
    Valid {
        /// Its kind.
        kind: RequestKind,
        /// First sector.
        sector: u64,
        /// Payload bytes (data, GET_ID) or bytes of the range (discard, write-zeroes).
        len: u64,
    },
    /// A well-formed chain whose request breaks a rule: the device must refuse it.
    Invalid,
    /// Something structural was broken on purpose: no expectation.
    Unknown,
}

/// One built case: a ring, a chain in it and the limits to check it against.
#[derive(Clone, Debug)]
pub struct Case {
    /// The ring.
    pub ring: RingInfo,
    /// The head of the built chain.
    pub head: u16,
    /// What the device negotiated.
    pub limits: Limits,
    /// What the builder meant.
    pub intent: Intent,
    /// Two more heads to parse (any chain the table happens to hold).
    pub other_heads: [u16; 2],
}

/// A buffer of the chain before it is placed.
#[derive(Clone, Debug)]
struct Piece {
    len: u32,
    writable: bool,
    /// Bytes written at its start (header, discard segment).
    content: Vec<u8>,
}

/// A placed buffer.
#[derive(Clone, Copy, Debug)]
struct Placed {
    addr: u64,
    len: u32,
    writable: bool,
}

fn header(type_: u32, ioprio: u32, sector: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(16);
    h.extend_from_slice(&type_.to_le_bytes());
    h.extend_from_slice(&ioprio.to_le_bytes());
    h.extend_from_slice(&sector.to_le_bytes());
    h
}

fn desc(addr: u64, len: u32, flags: u16, next: u16) -> [u8; 16] {
    let mut d = [0u8; 16];
    d[0..8].copy_from_slice(&addr.to_le_bytes());
    d[8..12].copy_from_slice(&len.to_le_bytes());
    d[12..14].copy_from_slice(&flags.to_le_bytes());
    d[14..16].copy_from_slice(&next.to_le_bytes());
    d
}

/// A first sector for a range of `sectors`: mostly inside the disk, sometimes just past
/// it, sometimes anything.
fn pick_sector(inp: &mut Input, capacity: u64, sectors: u64) -> u64 {
    match inp.below(8) {
        6 => capacity.saturating_sub(sectors).saturating_add(1),
        7 => inp.u64(),
        _ => match capacity.checked_sub(sectors) {
            Some(room) => inp.below(room.saturating_add(1)),
            None => 0,
        },
    }
}

/// A length that is not what a driver sends.
fn odd_len(inp: &mut Input) -> u32 {
    inp.pick(&[0, 1, 511, 513, 16, 0x8000, 0x8000_0000, u32::MAX])
}

/// An address that is not a buffer's: in a hole, straddling the end of memory, at the
/// top of the address space, over the tables.
fn odd_addr(inp: &mut Input, len: u32) -> u64 {
    let half = u64::from(len / 2);
    inp.pick(&[
        BUF_END,
        BUF_END - 8,
        TABLES_END.wrapping_sub(half),
        TOP,
        TOP_END.wrapping_sub(half),
        u64::MAX - 4,
        TABLE,
        INDIRECT,
    ])
}

/// Descriptor-contributing count of `len` stream bytes starting `skip` bytes into
/// `pieces`.
fn buffers_used(pieces: &[Piece], skip: u64, len: u64) -> u64 {
    let mut at = 0u64;
    let mut n = 0;
    for p in pieces {
        let (start, end) = (at, at + u64::from(p.len));
        at = end;
        if start.max(skip) < end.min(skip + len) {
            n += 1;
        }
    }
    n
}

/// Build one case in `g` (reset by the caller).
pub fn build(g: &mut Guest, inp: &mut Input) -> Case {
    let f = inp.u8();
    let max_sectors = [0x3f_ffff, 8, 1, 0, u32::MAX, 1024];
    let limits = Limits {
        capacity: inp.pick(&[1 << 21, 2048, 8, 1, 0, 1 << 40, u64::MAX >> 9, 64]),
        seg_max: inp.pick(&[254, 1, 2, 3, 8, 16, 126, 128]),
        read_only: f & 1 != 0,
        flush: f & 2 == 0,
        discard: f & 4 == 0,
        write_zeroes: f & 8 == 0,
        max_discard_sectors: inp.pick(&max_sectors),
        max_write_zeroes_sectors: inp.pick(&max_sectors),
    };
    let mut indirect_ok = f & 16 == 0;
    let mut qsize: u16 = inp.pick(&[256, 128, 64, 16, 8, 4, 2, 1]);
    let mut unknown = false;

    // The request, as two streams of pieces.
    let type_ = match inp.below(8) {
        0 | 6 => req_type::IN,
        1 => req_type::OUT,
        2 => req_type::FLUSH,
        3 => req_type::GET_ID,
        4 => req_type::DISCARD,
        5 => req_type::WRITE_ZEROES,
        _ => inp.u32(),
    };
    let ioprio = u32::from(inp.u8());
    let mut readable_body: Vec<Piece> = Vec::new();
    let mut writable_body: Vec<Piece> = Vec::new();
    let mut sector = 0u64;
    let mut range: Option<(u64, u32, u32)> = None; // discard / write-zeroes segment
    let mut range_count = 1u64;
    match type_ {
        req_type::IN | req_type::OUT => {
            let most = u64::from(limits.seg_max).min(MAX_DATA_SEGS);
            let mut count = 1 + inp.below(most);
            if inp.rare() {
                count = inp.pick(&[0, most + 1, MAX_DATA_SEGS]).min(MAX_DATA_SEGS);
            }
            let mut total = 0u64;
            for _ in 0..count {
                let mut len = 512 * (1 + inp.below(8) as u32);
                if inp.rare() {
                    len = odd_len(inp);
                }
                total += u64::from(len);
                let p = Piece {
                    len,
                    writable: type_ == req_type::IN,
                    content: Vec::new(),
                };
                if type_ == req_type::IN {
                    writable_body.push(p);
                } else {
                    readable_body.push(p);
                }
            }
            sector = pick_sector(inp, limits.capacity, total / 512);
        }
        req_type::GET_ID => {
            let len = inp.pick(&[20, 20, 20, 20, 512, 1, 0, 64]);
            if len > 0 {
                writable_body.push(Piece {
                    len,
                    writable: true,
                    content: Vec::new(),
                });
            }
        }
        req_type::DISCARD | req_type::WRITE_ZEROES => {
            let max = if type_ == req_type::DISCARD {
                limits.max_discard_sectors
            } else {
                limits.max_write_zeroes_sectors
            };
            let mut num = if max == 0 {
                0
            } else {
                1 + inp.below(u64::from(max.min(4096))) as u32
            };
            if inp.rare() {
                num = inp.pick(&[0, max.saturating_add(1), u32::MAX]);
            }
            let seg_sector = pick_sector(inp, limits.capacity, u64::from(num));
            let fb = inp.u8();
            let mut flags = if type_ == req_type::WRITE_ZEROES && fb & 1 != 0 {
                SEGMENT_FLAG_UNMAP
            } else {
                0
            };
            if inp.rare() {
                flags = inp.u32();
            }
            if inp.rare() {
                range_count = inp.pick(&[0, 2]);
            }
            let mut content = Vec::new();
            for _ in 0..range_count {
                content.extend_from_slice(&seg_sector.to_le_bytes());
                content.extend_from_slice(&num.to_le_bytes());
                content.extend_from_slice(&flags.to_le_bytes());
            }
            if range_count > 0 {
                readable_body.push(Piece {
                    len: content.len() as u32,
                    writable: false,
                    content,
                });
            }
            range = Some((seg_sector, num, flags));
        }
        _ => {}
    }
    if inp.rare() {
        readable_body.push(Piece {
            len: 512,
            writable: false,
            content: Vec::new(),
        });
    }
    if inp.rare() {
        writable_body.push(Piece {
            len: 512,
            writable: true,
            content: Vec::new(),
        });
    }

    let data_in: u64 = readable_body.iter().map(|p| u64::from(p.len)).sum();
    let data_out: u64 = writable_body.iter().map(|p| u64::from(p.len)).sum();

    // Shapes: the header alone, merged with the next readable buffer, or split; the
    // status alone or at the end of the last data buffer.
    let hdr = Piece {
        len: 16,
        writable: false,
        content: header(type_, ioprio, sector),
    };
    let mut readable = vec![hdr];
    match inp.below(4) {
        1 if !readable_body.is_empty() => {
            let next = readable_body.remove(0);
            match next.len.checked_add(16) {
                Some(len) => {
                    let mut content = readable[0].content.clone();
                    content.extend_from_slice(&next.content);
                    readable[0] = Piece {
                        len,
                        writable: false,
                        content,
                    };
                }
                None => readable_body.insert(0, next),
            }
        }
        2 | 3 => {
            let cut = if inp.u8() & 1 == 0 {
                8
            } else {
                1 + inp.below(15) as usize
            };
            let c = readable[0].content.clone();
            readable = vec![
                Piece {
                    len: cut as u32,
                    writable: false,
                    content: c[..cut].to_vec(),
                },
                Piece {
                    len: 16 - cut as u32,
                    writable: false,
                    content: c[cut..].to_vec(),
                },
            ];
        }
        _ => {}
    }
    readable.extend(readable_body);
    let mut writable = writable_body;
    let merge_status = inp.u8() & 1 != 0;
    match writable.last_mut() {
        Some(last) if merge_status && last.len < u32::MAX => last.len += 1,
        _ => writable.push(Piece {
            len: 1,
            writable: true,
            content: Vec::new(),
        }),
    }

    // What a device must do with it.
    let pieces: Vec<Piece> = readable.iter().chain(writable.iter()).cloned().collect();
    let mut intent = intent_of(
        type_,
        sector,
        range,
        range_count,
        data_in,
        data_out,
        &readable,
        &writable,
        &limits,
    );

    // Place the buffers.
    let mut at = inp.pick(&[
        0x100,
        0x100,
        0x100,
        BUF_SPLIT - 8,
        BUF_SPLIT - 0x200,
        0x3ff0,
    ]);
    let mut placed = Vec::with_capacity(pieces.len());
    for p in &pieces {
        match inp.below(8) {
            1 => at += 16,
            2 => at = (at + 511) & !511,
            3 => at += 0x1000,
            _ => {}
        }
        let addr = if inp.rare() {
            unknown = true;
            odd_addr(inp, p.len)
        } else {
            if at + u64::from(p.len) > BUF_END {
                at = BUF_START;
            }
            let addr = at;
            at += u64::from(p.len);
            if at > BUF_END {
                unknown = true; // longer than the buffer area
            }
            addr
        };
        placed.push(Placed {
            addr,
            len: p.len,
            writable: p.writable,
        });
    }
    for (p, d) in pieces.iter().zip(&placed) {
        let n = p.content.len().min(p.len as usize);
        if n > 0 {
            g.write(d.addr, &p.content[..n]);
        }
    }

    // Link them: direct, or an indirect table (sometimes after a few direct buffers).
    let n = placed.len();
    let mut use_indirect = inp.below(4) < 2 && n > 1;
    if use_indirect && !indirect_ok {
        if inp.rare() {
            unknown = true; // indirect though it was not negotiated
        } else {
            use_indirect = false;
        }
    }
    let prefix = if use_indirect {
        if inp.rare() {
            unknown = true;
            inp.below(n as u64) as usize
        } else {
            0
        }
    } else {
        n
    };
    let direct_count = prefix + usize::from(use_indirect);
    if direct_count > usize::from(qsize) {
        qsize = direct_count.next_power_of_two().min(256) as u16;
    }
    let table = match inp.below(16) {
        0..=11 => TABLE,
        12 => TABLE_SPILL - 0x800,
        13 => TABLE_SPILL - 8,
        14 => {
            unknown = true;
            TABLES_END - 0x80
        }
        _ => {
            unknown = true;
            BUF_END + 0x1000
        }
    };
    let mut used = [false; 256];
    let mut slot = |inp: &mut Input, size: u16| {
        let mut i = inp.below(u64::from(size)) as usize;
        while used[i] {
            i = (i + 1) % usize::from(size);
        }
        used[i] = true;
        i as u16
    };
    // (table address, index) of every descriptor of the chain, in chain order.
    let mut slots: Vec<(u64, u16)> = Vec::with_capacity(n + 1);
    for _ in 0..direct_count {
        slots.push((table, slot(inp, qsize)));
    }
    let head = slots[0].1;
    if use_indirect {
        let entries = n - prefix;
        let extra = if inp.rare() { inp.below(4) as usize } else { 0 };
        let size = (entries + extra) as u16;
        let ind_table = match inp.below(16) {
            0..=13 => INDIRECT,
            14 => {
                unknown = true;
                TABLES_END - 0x40
            }
            _ => {
                unknown = true;
                BUF_SPLIT - 0x20
            }
        };
        let shuffle = inp.rare();
        let mut used = [false; 1024];
        used[0] = true;
        slots.push((ind_table, 0));
        for i in 1..entries {
            let idx = if shuffle {
                let mut j = inp.below(u64::from(size)) as usize;
                while used[j] {
                    j = (j + 1) % usize::from(size);
                }
                j
            } else {
                i
            };
            used[idx] = true;
            slots.push((ind_table, idx as u16));
        }
        let d = desc(ind_table, 16 * u32::from(size), F_INDIRECT, 0);
        let (t, i) = slots[prefix];
        g.write(t + 16 * u64::from(i), &d);
    }
    // The buffers' descriptors: slots[..prefix] direct, the rest after the indirect one.
    for (k, p) in placed.iter().enumerate() {
        let (t, i) = if k < prefix {
            slots[k]
        } else {
            slots[k + usize::from(use_indirect)]
        };
        let last_of_table = k + 1 == n || (use_indirect && k + 1 == prefix);
        let next = if k + 1 == prefix && use_indirect {
            slots[prefix].1
        } else if k + 1 < n {
            slots[k + 1 + usize::from(use_indirect && k >= prefix)].1
        } else {
            0
        };
        let mut flags = if p.writable { F_WRITE } else { 0 };
        if !last_of_table || (use_indirect && k + 1 == prefix) {
            flags |= F_NEXT;
        }
        g.write(t + 16 * u64::from(i), &desc(p.addr, p.len, flags, next));
    }

    let mut ring = RingInfo {
        desc_table: vm_memory::GuestAddress(table),
        size: qsize,
        indirect: indirect_ok,
        max_indirect: RingInfo::max_indirect_for(qsize, limits.seg_max),
    };
    let mut head = head;

    // Rarely, break it.
    for _ in 0..4 {
        if !inp.rare() {
            break;
        }
        unknown = true;
        let (t, i) = slots[inp.below(slots.len() as u64) as usize];
        let at = t.wrapping_add(16 * u64::from(i));
        let mut d = [0u8; 16];
        g.read(at, &mut d);
        let flags = u16::from_le_bytes([d[12], d[13]]);
        let set_flags = |d: &mut [u8; 16], f: u16| d[12..14].copy_from_slice(&f.to_le_bytes());
        match inp.below(12) {
            0 => set_flags(&mut d, flags ^ F_WRITE),
            1 => set_flags(&mut d, flags ^ F_NEXT),
            2 => d[14..16].copy_from_slice(&inp.u16().to_le_bytes()),
            3 => {
                // A loop back to an earlier descriptor of the same table.
                let (_, back) = slots[inp.below(slots.len() as u64) as usize];
                set_flags(&mut d, flags | F_NEXT);
                d[14..16].copy_from_slice(&back.to_le_bytes());
            }
            4 => {
                let len = u32::from_le_bytes([d[8], d[9], d[10], d[11]]);
                d[0..8].copy_from_slice(&odd_addr(inp, len).to_le_bytes());
            }
            5 => d[8..12].copy_from_slice(&odd_len(inp).to_le_bytes()),
            6 => set_flags(&mut d, flags | F_INDIRECT),
            7 => {
                let max = 16 * u32::from(ring.max_indirect);
                let len = inp.pick(&[0, 8, 17, max + 16, !15, 16]);
                d[8..12].copy_from_slice(&len.to_le_bytes());
            }
            8 => {
                let raw = inp.bytes(16);
                d.copy_from_slice(&raw);
            }
            9 => head = inp.u16(),
            10 => ring.max_indirect = inp.u16(),
            _ => {
                indirect_ok = !indirect_ok;
                ring.indirect = indirect_ok;
            }
        }
        g.write(at, &d);
    }
    if unknown {
        intent = Intent::Unknown;
    }
    let mut other = || {
        let h = inp.u16();
        if h & 0x8000 == 0 {
            h % qsize
        } else {
            h
        }
    };
    let other_heads = [other(), other()];
    Case {
        ring,
        head,
        limits,
        intent,
        other_heads,
    }
}

/// What a device must do with the request the builder laid out (before breakage).
#[allow(clippy::too_many_arguments)]
fn intent_of(
    type_: u32,
    sector: u64,
    range: Option<(u64, u32, u32)>,
    range_count: u64,
    data_in: u64,
    data_out: u64,
    readable: &[Piece],
    writable: &[Piece],
    limits: &Limits,
) -> Intent {
    let in_disk = |sector: u64, sectors: u64| {
        sector
            .checked_add(sectors)
            .is_some_and(|end| end <= limits.capacity)
    };
    let ok = |cond: bool, kind, sector, len| {
        if cond {
            Intent::Valid { kind, sector, len }
        } else {
            Intent::Invalid
        }
    };
    match type_ {
        req_type::IN => ok(
            data_in == 0
                && data_out.is_multiple_of(512)
                && data_out < u64::from(u32::MAX)
                && in_disk(sector, data_out / 512)
                && buffers_used(writable, 0, data_out) <= u64::from(limits.seg_max),
            RequestKind::In,
            sector,
            data_out,
        ),
        req_type::OUT => ok(
            !limits.read_only
                && data_out == 0
                && data_in.is_multiple_of(512)
                && data_in < u64::from(u32::MAX)
                && in_disk(sector, data_in / 512)
                && buffers_used(readable, 16, data_in) <= u64::from(limits.seg_max),
            RequestKind::Out,
            sector,
            data_in,
        ),
        req_type::FLUSH => ok(
            limits.flush && data_in == 0 && data_out == 0,
            RequestKind::Flush,
            sector,
            0,
        ),
        req_type::GET_ID => {
            let len = data_out.min(20);
            ok(
                data_in == 0
                    && data_out > 0
                    && buffers_used(writable, 0, len) <= u64::from(limits.seg_max),
                RequestKind::GetId,
                sector,
                len,
            )
        }
        req_type::DISCARD | req_type::WRITE_ZEROES => {
            let discard = type_ == req_type::DISCARD;
            let (negotiated, max) = if discard {
                (limits.discard, limits.max_discard_sectors)
            } else {
                (limits.write_zeroes, limits.max_write_zeroes_sectors)
            };
            let Some((seg_sector, num, flags)) = range else {
                return Intent::Invalid;
            };
            let allowed = if discard { 0 } else { SEGMENT_FLAG_UNMAP };
            let kind = if discard {
                RequestKind::Discard
            } else {
                RequestKind::WriteZeroes {
                    unmap: flags & SEGMENT_FLAG_UNMAP != 0,
                }
            };
            ok(
                negotiated
                    && !limits.read_only
                    && data_out == 0
                    && range_count == 1
                    && data_in == 16
                    && flags & !allowed == 0
                    && num <= max
                    && in_disk(seg_sector, u64::from(num)),
                kind,
                seg_sector,
                u64::from(num) * 512,
            )
        }
        _ => Intent::Invalid,
    }
}
