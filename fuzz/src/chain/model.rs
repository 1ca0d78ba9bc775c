//! A second, deliberately plain reading of the rules `proto` implements: a chain walker
//! that reads every descriptor through vm-memory's checked accessors, and a request
//! checker that says, for any chain, whether the device must accept it, answer it with an
//! error status, or return it unanswered — and, when it accepts, exactly which guest bytes
//! the payload iovecs must cover. The target compares `proto` with it on every input.
//!
//! Written from the spec and `proto`'s documentation, not from its code: no fast paths,
//! no scratch buffers, no reuse.

use proto::wire::{req_type, SEGMENT_FLAG_UNMAP};
use proto::{Limits, Request, RequestKind, RingInfo};

use super::guest::Guest;

/// One buffer of a chain: (guest address, length, device-writable).
pub type Seg = (u64, u32, bool);

/// What the device must do with a chain.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Accept it as this.
    Accept(Expected),
    /// Refuse it with a status written at this host address.
    Answer(*mut u8),
    /// Return it unanswered.
    Unanswerable,
}

/// An accepted request.
#[derive(Debug, PartialEq, Eq)]
pub struct Expected {
    /// Kind.
    pub kind: RequestKind,
    /// First sector.
    pub sector: u64,
    /// Payload or range bytes.
    pub len: u64,
    /// The payload as (guest address, length) pieces, one per buffer and region.
    pub iov: Vec<(u64, u64)>,
    /// Buffers the payload uses.
    pub buffers: u64,
    /// Host address of the status byte.
    pub status: *mut u8,
}

/// Walk the chain at `head`: its buffers, or None if any rule of §2.7.5 is broken.
pub fn walk(g: &Guest, ring: RingInfo, head: u16) -> Option<Vec<Seg>> {
    if head >= ring.size {
        return None;
    }
    let mut out = Vec::new();
    let (mut table, mut entries, mut index) = (ring.desc_table.0, ring.size, head);
    let mut in_indirect = false;
    let mut seen = 0u32;
    loop {
        seen += 1;
        if seen > u32::from(entries) {
            return None; // longer than its table: a loop
        }
        let at = table.checked_add(16 * u64::from(index))?;
        let mut d = [0u8; 16];
        if !g.read(at, &mut d) {
            return None;
        }
        let addr = u64::from_le_bytes(d[0..8].try_into().ok()?);
        let len = u32::from_le_bytes(d[8..12].try_into().ok()?);
        let flags = u16::from_le_bytes([d[12], d[13]]);
        let next = u16::from_le_bytes([d[14], d[15]]);
        if flags & 4 != 0 {
            if in_indirect || !ring.indirect || flags & 1 != 0 {
                return None;
            }
            if len == 0 || len % 16 != 0 || len / 16 > u32::from(ring.max_indirect) {
                return None;
            }
            (table, entries, index) = (addr, (len / 16) as u16, 0);
            in_indirect = true;
            seen = 0;
            continue;
        }
        out.push((addr, len, flags & 2 != 0));
        if flags & 1 == 0 {
            return Some(out);
        }
        if next >= entries {
            return None;
        }
        index = next;
    }
}

/// `n` bytes of the stream `segs`, from `skip` bytes in; None if any is outside memory.
fn read_stream(g: &Guest, segs: &[Seg], mut skip: u64, n: usize) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(n);
    for &(addr, len, _) in segs {
        if out.len() == n {
            break;
        }
        let len = u64::from(len);
        if skip >= len {
            skip -= len;
            continue;
        }
        let take = ((len - skip) as usize).min(n - out.len());
        let mut buf = vec![0u8; take];
        if !g.read(addr.checked_add(skip)?, &mut buf) {
            return None;
        }
        out.extend_from_slice(&buf);
        skip = 0;
    }
    Some(out)
}

/// The payload pieces for `len` bytes of `segs` from `skip` bytes in, split where they
/// cross regions, with the number of buffers used; None if the request must be refused.
fn map(g: &Guest, segs: &[Seg], mut skip: u64, len: u64, seg_max: u32) -> Option<Expected> {
    let mut iov = Vec::new();
    let mut buffers = 0u64;
    let mut left = len;
    for &(addr, slen, _) in segs {
        let slen = u64::from(slen);
        if left == 0 {
            break;
        }
        if skip >= slen {
            skip -= slen;
            continue;
        }
        let n = (slen - skip).min(left);
        buffers += 1;
        let mut at = addr.checked_add(skip)?;
        let mut rest = n;
        while rest > 0 {
            let (start, rlen, _) = g.region_of(at)?;
            let room = rlen - (at - start);
            let k = room.min(rest);
            iov.push((at, k));
            at = at.checked_add(k)?;
            rest -= k;
        }
        skip = 0;
        left -= n;
    }
    if buffers > u64::from(seg_max) || iov.len() > Request::max_iovecs(seg_max) {
        return None;
    }
    Some(Expected {
        kind: RequestKind::In,
        sector: 0,
        len,
        iov,
        buffers,
        status: std::ptr::null_mut(),
    })
}

/// What the device must do with the chain at `head`.
pub fn parse(g: &Guest, ring: RingInfo, head: u16, limits: &Limits) -> Outcome {
    let Some(segs) = walk(g, ring, head) else {
        return Outcome::Unanswerable;
    };
    let status = match segs.last() {
        Some(&(addr, len, true)) if len > 0 => addr
            .checked_add(u64::from(len) - 1)
            .and_then(|a| g.host(a, 1)),
        _ => None,
    };
    let Some(status) = status else {
        return Outcome::Unanswerable;
    };
    match accept(g, &segs, limits) {
        Some(mut e) => {
            e.status = status;
            Outcome::Accept(e)
        }
        None => Outcome::Answer(status),
    }
}

fn accept(g: &Guest, segs: &[Seg], limits: &Limits) -> Option<Expected> {
    let first_w = segs.iter().position(|s| s.2).unwrap_or(segs.len());
    let (readable, writable) = segs.split_at(first_w);
    if writable.iter().any(|s| !s.2) {
        return None;
    }
    let r_len: u64 = readable.iter().map(|s| u64::from(s.1)).sum();
    let w_len: u64 = writable.iter().map(|s| u64::from(s.1)).sum();
    if r_len < 16 {
        return None;
    }
    let h = read_stream(g, readable, 0, 16)?;
    let type_ = u32::from_le_bytes(h[0..4].try_into().ok()?);
    let sector = u64::from_le_bytes(h[8..16].try_into().ok()?);
    let (data_in, data_out) = (r_len - 16, w_len - 1);
    let in_disk = |sector: u64, sectors: u64| {
        sector
            .checked_add(sectors)
            .is_some_and(|end| end <= limits.capacity)
    };
    let seg_max = limits.seg_max;
    let mut e = match type_ {
        req_type::IN => {
            let ok = data_in == 0
                && data_out % 512 == 0
                && data_out < u64::from(u32::MAX)
                && in_disk(sector, data_out / 512);
            let e = ok.then(|| map(g, writable, 0, data_out, seg_max))??;
            Expected {
                kind: RequestKind::In,
                ..e
            }
        }
        req_type::OUT => {
            let ok = !limits.read_only
                && data_out == 0
                && data_in % 512 == 0
                && data_in < u64::from(u32::MAX)
                && in_disk(sector, data_in / 512);
            let e = ok.then(|| map(g, readable, 16, data_in, seg_max))??;
            Expected {
                kind: RequestKind::Out,
                ..e
            }
        }
        req_type::FLUSH if limits.flush && data_in == 0 && data_out == 0 => Expected {
            kind: RequestKind::Flush,
            ..map(g, &[], 0, 0, seg_max)?
        },
        req_type::GET_ID if data_in == 0 && data_out > 0 => Expected {
            kind: RequestKind::GetId,
            ..map(g, writable, 0, data_out.min(20), seg_max)?
        },
        req_type::DISCARD | req_type::WRITE_ZEROES => {
            let discard = type_ == req_type::DISCARD;
            let (negotiated, max) = if discard {
                (limits.discard, limits.max_discard_sectors)
            } else {
                (limits.write_zeroes, limits.max_write_zeroes_sectors)
            };
            if !negotiated || limits.read_only || data_out != 0 || data_in != 16 {
                return None;
            }
            let s = read_stream(g, readable, 16, 16)?;
            let seg_sector = u64::from_le_bytes(s[0..8].try_into().ok()?);
            let num = u32::from_le_bytes(s[8..12].try_into().ok()?);
            let flags = u32::from_le_bytes(s[12..16].try_into().ok()?);
            let allowed = if discard { 0 } else { SEGMENT_FLAG_UNMAP };
            if flags & !allowed != 0 || num > max || !in_disk(seg_sector, u64::from(num)) {
                return None;
            }
            let kind = if discard {
                RequestKind::Discard
            } else {
                RequestKind::WriteZeroes {
                    unmap: flags & SEGMENT_FLAG_UNMAP != 0,
                }
            };
            return Some(Expected {
                kind,
                sector: seg_sector,
                len: u64::from(num) * 512,
                iov: Vec::new(),
                buffers: 0,
                status: std::ptr::null_mut(),
            });
        }
        _ => return None,
    };
    e.sector = sector;
    Some(e)
}
