//! Target `chain`: descriptor-chain walking and request parsing over guest memory.
//!
//! Each input builds one mostly valid request in guest memory ([`build`]), then parses
//! the chain at its head and at two other heads with `proto`, and checks every result
//! against [`model`] and the invariants the device relies on:
//!
//! - `proto::chain::walk` and the model's walker agree on every chain, buffer by buffer;
//! - `Parser::parse` accepts, answers or drops exactly the chains the model does, with the
//!   same status pointer, kind, sector and length, and payload iovecs that cover exactly
//!   the model's guest bytes (so nothing outside the request is ever handed to an engine);
//! - an accepted request: iovecs and status byte inside guest memory, the status byte the
//!   last byte of a device-writable buffer, data inside the disk and a multiple of 512,
//!   at most `seg_max` buffers, nothing a read-only disk or the negotiated features forbid;
//! - what the builder meant: a request a driver may send is accepted as built, one that
//!   breaks a rule of the format is refused.

pub mod build;
pub mod guest;
pub mod model;

use std::cell::RefCell;

use proto::chain::Segment;
use proto::wire::SECTOR_SIZE;
use proto::{Parser, Rejected, Request, RequestKind, RingInfo};

use crate::input::Input;
use build::{Case, Intent};
use guest::Guest;
use model::Outcome;

struct State {
    g: Guest,
    parser: Parser,
    req: Request,
    segs: Vec<Segment>,
}

thread_local! {
    static STATE: RefCell<Option<State>> = const { RefCell::new(None) };
}

/// Run one input.
pub fn run(data: &[u8]) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let s = s.get_or_insert_with(|| State {
            g: Guest::new(),
            // Small on purpose: parse must grow it for larger rings (once).
            parser: Parser::new(4),
            req: Request::with_capacity(4),
            segs: Vec::new(),
        });
        s.g.reset();
        let mut inp = Input::new(data);
        let case = build::build(&mut s.g, &mut inp);
        check(s, &case, case.head, true);
        for h in case.other_heads {
            check(s, &case, h, false);
        }
        check_max_indirect(&mut inp);
    });
}

fn check(s: &mut State, case: &Case, head: u16, built: bool) {
    let ring = case.ring;
    // The walker against the model's.
    s.segs = Vec::with_capacity(ring.max_segments());
    let walked = proto::chain::walk(&s.g.mem, ring, head, &mut s.segs);
    let modelled = model::walk(&s.g, ring, head);
    match (&walked, &modelled) {
        (Ok(()), Some(m)) => {
            let got: Vec<model::Seg> = s
                .segs
                .iter()
                .map(|x| (x.addr.0, x.len, x.writable))
                .collect();
            assert_eq!(
                &got, m,
                "walk and the model disagree on the buffers of {case:?}"
            );
        }
        (Err(_), None) => {}
        _ => panic!(
            "walk says {walked:?}, the model {:?}, for head {head} of {case:?}",
            modelled.map(|m| m.len())
        ),
    }

    let got = s
        .parser
        .parse(&s.g.mem, ring, head, &case.limits, &mut s.req);
    let want = model::parse(&s.g, ring, head, &case.limits);
    if crate::trace() {
        eprintln!("head {head} (built: {built}): {got:?} / model {want:?}\n  {case:?}");
    }
    let req = &s.req;
    match (&got, &want) {
        (Ok(()), Outcome::Accept(e)) => {
            assert_eq!(
                (req.kind, req.sector, req.len, req.status_ptr),
                (e.kind, e.sector, e.len, e.status),
                "parse accepted a different request than the model for {case:?}"
            );
            let iov: Vec<(u64, u64)> = req
                .iov
                .iter()
                .map(|v| {
                    let (gpa, room) = s
                        .g
                        .gpa_of(v.iov_base as *const u8)
                        .unwrap_or_else(|| panic!("iovec {v:?} is not in guest memory ({case:?})"));
                    assert!(
                        v.iov_len as u64 <= room,
                        "iovec {v:?} runs past its region ({case:?})"
                    );
                    (gpa, v.iov_len as u64)
                })
                .collect();
            assert_eq!(
                iov, e.iov,
                "payload iovecs differ from the model ({case:?})"
            );
            invariants(s, case, e.buffers);
        }
        (Err(Rejected::Answer { status_ptr, .. }), Outcome::Answer(p)) => {
            assert_eq!(
                *status_ptr, *p,
                "refusal answered at the wrong byte ({case:?})"
            );
        }
        (Err(Rejected::Unanswerable(_)), Outcome::Unanswerable) => {}
        _ => panic!("parse says {got:?}, the model {want:?}, for head {head} of {case:?}"),
    }
    if let Err(Rejected::Unanswerable(e)) = &got {
        // Only a broken chain or a missing status byte is unanswerable.
        assert!(
            walked.is_err()
                || matches!(e, proto::request::RequestError::NoStatus)
                || matches!(e, proto::request::RequestError::BadAddress { .. }),
            "unanswerable for {e:?} ({case:?})"
        );
    }

    if built {
        match case.intent {
            Intent::Valid { kind, sector, len } => {
                assert!(
                    got.is_ok(),
                    "a valid request was refused: {got:?} ({case:?})"
                );
                assert_eq!((req.kind, req.sector, req.len), (kind, sector, len));
            }
            Intent::Invalid => assert!(got.is_err(), "an invalid request was accepted ({case:?})"),
            Intent::Unknown => {}
        }
    }
}

/// What must hold for any accepted request, whatever the model says.
fn invariants(s: &State, case: &Case, buffers: u64) {
    let (req, l) = (&s.req, &case.limits);
    let status = s.g.gpa_of(req.status_ptr);
    assert!(
        status.is_some(),
        "status byte outside guest memory ({case:?})"
    );
    assert!(buffers <= u64::from(l.seg_max), "more than seg_max buffers");
    assert!(req.iov.len() <= Request::max_iovecs(l.seg_max));
    let total: u64 = req.iov.iter().map(|v| v.iov_len as u64).sum();
    let in_disk = |sectors: u64| {
        req.sector
            .checked_add(sectors)
            .is_some_and(|end| end <= l.capacity)
    };
    match req.kind {
        RequestKind::In | RequestKind::Out => {
            assert_eq!(total, req.len);
            assert_eq!(
                req.len % SECTOR_SIZE,
                0,
                "unaligned data request ({case:?})"
            );
            assert!(in_disk(req.len / SECTOR_SIZE), "past capacity ({case:?})");
            assert!(!(l.read_only && req.kind == RequestKind::Out));
            let used = if req.kind == RequestKind::In {
                req.len + 1
            } else {
                1
            };
            assert_eq!(u64::from(req.used_len_ok()), used);
        }
        RequestKind::GetId => {
            assert!(total == req.len && (1..=20).contains(&total));
            assert_eq!(u64::from(req.used_len_ok()), req.len + 1);
        }
        RequestKind::Flush => {
            assert!(l.flush && req.iov.is_empty());
        }
        RequestKind::Discard | RequestKind::WriteZeroes { .. } => {
            assert!(!l.read_only && req.iov.is_empty());
            assert!(in_disk(req.len / SECTOR_SIZE), "past capacity ({case:?})");
            if req.kind == RequestKind::Discard {
                assert!(l.discard);
            } else {
                assert!(l.write_zeroes);
            }
        }
    }
    // The byte range the engine gets does not wrap.
    if !matches!(req.kind, RequestKind::Flush | RequestKind::GetId) {
        let end = req
            .sector
            .checked_mul(SECTOR_SIZE)
            .and_then(|o| o.checked_add(req.len));
        assert!(end.is_some(), "byte range wraps ({case:?})");
    }
}

/// `RingInfo::max_indirect_for` is at least what Linux, QEMU and the ring itself need,
/// and a table that long fits the walker's bound.
fn check_max_indirect(inp: &mut Input) {
    let (size, seg_max) = (inp.u16(), inp.u32());
    let m = RingInfo::max_indirect_for(size, seg_max);
    assert!(m <= 32768);
    assert!(u32::from(m) >= seg_max.saturating_add(2).min(32768));
    assert!(m >= size.min(32768) && m >= 1024);
}
