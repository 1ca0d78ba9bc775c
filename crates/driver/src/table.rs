//! The in-flight table: every caller I/O from submission to completion, and which I/Os each
//! virtio request on the ring serves.
//!
//! The relation is many-to-many in one direction at a time: an I/O larger than one request
//! can carry is split into several requests (its `remaining` counts them), and requests
//! merged by the request path carry several whole I/Os (linked through `next`, first one
//! named by the ring head). An I/O is never both split and merged: the request path merges
//! only I/Os that fit one request together.
//!
//! FUA emulation lives here too: a FUA write that completes on a device with a volatile
//! write cache is parked until a flush submitted after its completion finishes; that flush
//! (hidden from the caller) completes every write parked before it was sent.
//!
//! Entries and their free list grow to the high-water mark of I/Os in flight and are reused
//! after that: no allocation per I/O once warm.

use std::collections::VecDeque;

use crate::error::ErrorKind;
use crate::io::{Bufs, Completion, Io, Op};

/// No entry (end of a list, free ring head).
pub(crate) const NONE: u32 = u32::MAX;

/// One caller I/O (or a hidden one of the driver's own: a post-flush, a GET_ID).
#[derive(Debug)]
pub(crate) struct Entry {
    pub token: u64,
    pub bufs: Bufs,
    pub result: Result<(), ErrorKind>,
    /// Requests still outstanding for this I/O.
    pub remaining: u32,
    /// The next I/O in the same list: the members of one merged request, the I/Os staged
    /// together by the request path, or the FUA writes one post-flush completes.
    pub next: u32,
    pub op: Op,
    /// First 512-byte sector.
    pub sector: u64,
    /// Bytes of data, or of the range of a discard / write-zeroes.
    pub bytes: u64,
    /// Descriptors the data needs (buffers cut at size_max).
    pub pieces: u32,
    pub fua: bool,
    pub flow: u16,
    /// The caller never sees this I/O (a post-flush).
    pub hidden: bool,
    /// For a post-flush: the first FUA write it completes.
    pub waiters: u32,
}

impl Entry {
    /// An entry that serves nothing (a flush with no request outstanding).
    fn vacant() -> Entry {
        Entry {
            token: 0,
            bufs: Bufs::None,
            result: Ok(()),
            remaining: 0,
            next: NONE,
            op: Op::Flush,
            sector: 0,
            bytes: 0,
            pieces: 0,
            fua: false,
            flow: 0,
            hidden: false,
            waiters: NONE,
        }
    }
}

/// Every I/O in flight on one queue.
#[derive(Debug)]
pub(crate) struct Table {
    entries: Vec<Entry>,
    free: Vec<u32>,
    /// Per ring head: the first I/O the request on it serves.
    heads: Vec<u32>,
    /// Finished I/Os the caller has not taken yet.
    pub ready: VecDeque<Completion>,
    /// Caller I/Os submitted and not yet taken (staged, on the ring, parked or ready).
    pub in_flight: usize,
    /// The device has a volatile write cache: FUA writes need a post-flush.
    write_cache: bool,
    /// FUA writes completed on the device, waiting for a post-flush to be sent.
    parked: u32,
    parked_tail: u32,
    /// A post-flush is on the ring.
    pub post_flush_busy: bool,
    /// I/Os a blocking call gave up on ([`Table::abandon`]): still with the device; when
    /// they complete their buffers are freed and nothing is handed out. Nearly always
    /// empty: one length check per completion.
    abandoned: Vec<u32>,
}

impl Table {
    pub(crate) fn new(ring_size: u16, write_cache: bool) -> Table {
        let n = usize::from(ring_size);
        Table {
            entries: Vec::with_capacity(n + 1),
            free: Vec::with_capacity(n + 1),
            heads: vec![NONE; n],
            ready: VecDeque::with_capacity(2 * n),
            in_flight: 0,
            write_cache,
            parked: NONE,
            parked_tail: NONE,
            post_flush_busy: false,
            abandoned: Vec::new(),
        }
    }

    /// Give up on the caller I/Os with `token` that are out (a blocking call's, after it
    /// timed out): they stay with the device, which may still write their buffers; when
    /// they complete, the buffers are freed and no completion is handed out. Returns how
    /// many. A scan of the table: only after a timeout.
    pub(crate) fn abandon(&mut self, token: u64) -> usize {
        let live = |i: usize, e: &Entry| {
            e.token == token && !e.hidden && e.remaining > 0 && !self.free.contains(&(i as u32))
        };
        let ids: Vec<u32> = (self.entries.iter().enumerate())
            .filter(|(i, e)| live(*i, e))
            .map(|(i, _)| i as u32)
            .collect();
        let n = ids.len();
        self.abandoned.extend(ids);
        n
    }

    /// I/Os given up on and still with the device.
    pub(crate) fn abandoned(&self) -> usize {
        self.abandoned.len()
    }

    pub(crate) fn get(&self, id: u32) -> &Entry {
        &self.entries[id as usize]
    }

    pub(crate) fn get_mut(&mut self, id: u32) -> &mut Entry {
        &mut self.entries[id as usize]
    }

    /// Enter `io` (starting at `sector`, needing `pieces` descriptors of data) with
    /// `remaining` requests to come.
    pub(crate) fn insert(&mut self, io: Io, sector: u64, bytes: u64, pieces: u32) -> u32 {
        self.in_flight += 1;
        // Written field by field into its slot rather than built on the stack and moved:
        // the move reads back, in wide loads, fields just stored narrow, which the store
        // buffer cannot forward (perf: a tenth of the driver's time at 4 M IOPS).
        let id = match self.free.pop() {
            Some(i) => i,
            None => self.put(Entry::vacant()),
        };
        let e = &mut self.entries[id as usize];
        e.token = io.token;
        e.bufs = io.bufs;
        e.result = Ok(());
        e.remaining = 1;
        e.next = NONE;
        e.op = io.op;
        e.sector = sector;
        e.bytes = bytes;
        e.pieces = pieces;
        e.fua = io.fua && io.op == Op::Write;
        e.flow = io.flow;
        e.hidden = false;
        e.waiters = NONE;
        id
    }

    fn put(&mut self, e: Entry) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.entries[i as usize] = e;
                i
            }
            None => {
                self.entries.push(e);
                (self.entries.len() - 1) as u32
            }
        }
    }

    /// Nothing was sent for `id`: remove it and give its buffers back.
    pub(crate) fn withdraw(&mut self, id: u32) -> Bufs {
        let e = &mut self.entries[id as usize];
        if !e.hidden {
            self.in_flight -= 1;
        }
        let bufs = std::mem::take(&mut e.bufs);
        self.free.push(id);
        bufs
    }

    /// `id` was never sent and never will be: it completes with `kind` (an I/O the path
    /// held after its submission returned).
    pub(crate) fn fail(&mut self, id: u32, kind: ErrorKind) {
        let e = &mut self.entries[id as usize];
        e.result = Err(kind);
        e.remaining = 1;
        e.fua = false;
        self.account(id, Err(kind));
    }

    /// The request on ring `head` serves the I/Os listed from `first`.
    pub(crate) fn bind(&mut self, head: u16, first: u32) {
        self.heads[usize::from(head)] = first;
    }

    /// The request on `head` finished with `result`: account it to every I/O it served.
    pub(crate) fn finish_head(&mut self, head: u16, result: Result<(), ErrorKind>) {
        let mut id = std::mem::replace(&mut self.heads[usize::from(head)], NONE);
        while id != NONE {
            let Some(e) = self.entries.get_mut(id as usize) else {
                return;
            };
            // A split I/O's requests all name it alone; a merged request's members are
            // linked, each with one request outstanding.
            let next = if e.remaining > 1 { NONE } else { e.next };
            self.account(id, result);
            id = next;
        }
    }

    /// One request of `id` finished with `result`.
    pub(crate) fn account(&mut self, id: u32, result: Result<(), ErrorKind>) {
        let e = &mut self.entries[id as usize];
        if e.result.is_ok() {
            e.result = result;
        }
        e.remaining -= 1;
        if e.remaining > 0 {
            return;
        }
        if e.fua && self.write_cache && e.result.is_ok() {
            // Durable only after a flush that follows: park until one is sent.
            e.next = NONE;
            if self.parked_tail == NONE {
                self.parked = id;
            } else {
                self.entries[self.parked_tail as usize].next = id;
            }
            self.parked_tail = id;
            return;
        }
        if e.hidden && e.op == Op::Flush {
            self.post_flush_busy = false;
            let mut w = e.waiters;
            let flushed = e.result;
            self.free.push(id);
            while w != NONE {
                let next = self.entries[w as usize].next;
                self.entries[w as usize].result = flushed;
                self.complete(w);
                w = next;
            }
            return;
        }
        self.complete(id);
    }

    fn complete(&mut self, id: u32) {
        if !self.abandoned.is_empty() {
            if let Some(k) = self.abandoned.iter().position(|&a| a == id) {
                // Given up on: the device is done with its buffers now; nobody takes it.
                self.abandoned.swap_remove(k);
                drop(std::mem::take(&mut self.entries[id as usize].bufs));
                self.free.push(id);
                self.in_flight -= 1;
                return;
            }
        }
        let e = &mut self.entries[id as usize];
        let c = Completion {
            token: e.token,
            result: e.result,
            bufs: std::mem::take(&mut e.bufs),
        };
        self.free.push(id);
        self.ready.push_back(c);
    }

    /// FUA writes wait for a post-flush that is not yet on the ring.
    pub(crate) fn needs_post_flush(&self) -> bool {
        self.parked != NONE && !self.post_flush_busy
    }

    /// Make the hidden flush that completes every parked FUA write; the caller sends it.
    pub(crate) fn take_post_flush(&mut self) -> u32 {
        let waiters = std::mem::replace(&mut self.parked, NONE);
        self.parked_tail = NONE;
        self.post_flush_busy = true;
        self.put(Entry {
            token: u64::MAX,
            remaining: 1,
            hidden: true,
            waiters,
            ..Entry::vacant()
        })
    }

    /// The post-flush `id` could not be sent: its waiters fail with `kind`.
    pub(crate) fn fail_post_flush(&mut self, id: u32, kind: ErrorKind) {
        let e = &mut self.entries[id as usize];
        e.result = Err(kind);
        self.account(id, Err(kind));
    }

    /// Every parked FUA write fails with `kind` (the device is gone).
    pub(crate) fn fail_parked(&mut self, kind: ErrorKind) {
        let mut w = std::mem::replace(&mut self.parked, NONE);
        self.parked_tail = NONE;
        while w != NONE {
            let next = self.entries[w as usize].next;
            self.entries[w as usize].result = Err(kind);
            self.complete(w);
            w = next;
        }
    }

    /// Take a finished I/O.
    pub(crate) fn pop_ready(&mut self) -> Option<Completion> {
        let c = self.ready.pop_front()?;
        self.in_flight -= 1;
        Some(c)
    }

    /// Complete an I/O that needed no request (a flush on a device without a cache).
    pub(crate) fn complete_at_once(&mut self, token: u64, result: Result<(), ErrorKind>) {
        self.in_flight += 1;
        self.ready.push_back(Completion {
            token,
            result,
            bufs: Bufs::None,
        });
    }

    /// Buffers still lent to a device that may write them must never be freed: leak them.
    pub(crate) fn leak_buffers(&mut self) {
        for e in self.entries.drain(..) {
            std::mem::forget(e.bufs);
        }
    }
}
