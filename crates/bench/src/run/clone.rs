//! One clone's I/O loop as a state machine: [`CloneRun::fill`] submits what the depth and
//! the rate allow, [`CloneRun::complete`] takes finished I/Os. A clone on a thread of its
//! own drives it with [`run_alone`], blocking in its lane's `wait`; several clones on one
//! thread are driven by `shared::run_together`, which polls all their lanes in one loop.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{DirResult, Progress, Window};
use crate::clock::{Clock, Mark};
use crate::job::JobSpec;
use crate::lane::{Done, Lane};
use crate::pace::Pacer;
use crate::run::CloneResult;
use crate::stats::Cpu;
use crate::verify::{self, WrittenMap};
use crate::workload::{Generator, IoDir, IoUnit};

struct Slot {
    dir: IoDir,
    offset: u64,
    len: u64,
    /// Before and after its submission, on the [`Clock`].
    t0: u64,
    t1: u64,
}

/// Whether `u` overlaps an I/O in flight: a slot that is not in `free`.
fn overlaps_in_flight(slots: &[Slot], free: &[usize], u: &IoUnit) -> bool {
    slots.iter().enumerate().any(|(i, s)| {
        u.offset < s.offset + s.len && s.offset < u.offset + u.len && !free.contains(&i)
    })
}

/// Fill `buf` with pseudo-random bytes from `seed` (xorshift64*; never all zero).
fn fill_random(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// Where a clone works: its index, its region of the device, the device's block size and
/// the seed of its generator.
#[derive(Clone, Copy, Debug)]
pub(super) struct CloneArgs {
    pub index: u32,
    pub region: (u64, u64),
    pub align: u64,
    pub seed: u64,
}

/// One clone's state between two steps of its loop.
pub(super) struct CloneRun<'a> {
    progress: &'a Progress,
    index: u32,
    gen: Generator,
    slots: Vec<Slot>,
    free: Vec<usize>,
    read: DirResult,
    write: DirResult,
    written: Option<WrittenMap>,
    generation: u64,
    verified: u64,
    batch_submit: usize,
    /// Completions the clone waits for at a time (`iodepth_batch_complete`).
    pub batch_complete: usize,
    byte_limit: Option<u64>,
    issued: u64,
    /// I/Os submitted and not completed.
    pub in_flight: usize,
    /// The runtime, the size or Ctrl-C ended the clone: it submits no more.
    pub stopping: bool,
    /// Past the ramp: completions count.
    pub measuring: bool,
    clock: &'static Clock,
    ramp_mark: Mark,
    ramp_end: u64,
    deadline: Option<Mark>,
    first_measured: Option<u64>,
    last_done: u64,
    pacer: Option<Pacer>,
    /// The next I/O, drawn but held back by the rate or by an overlap.
    pending: Option<IoUnit>,
    /// The longest the clone waits with I/O in flight and none completing.
    pub io_timeout: Duration,
}

impl<'a> CloneRun<'a> {
    /// A clone on `lane`, its buffers filled when it writes.
    pub fn new(
        spec: &JobSpec,
        lane: &mut dyn Lane,
        a: CloneArgs,
        w: &Window,
        progress: &'a Progress,
    ) -> Result<CloneRun<'a>, String> {
        let (start, len) = a.region;
        let gen = Generator::new(spec, start, len, a.align, a.seed)?;
        let depth = lane.depth();
        let verifying = spec.verify.is_some();
        if spec.rw.writes() && !verifying {
            // Written payloads are pseudo-random bytes, filled once, as fio's buffers are
            // by default: a target that compresses, deduplicates or skips zeroes must not
            // be handed zeroes (they were all zero). A mixed job's write may carry what a
            // read brought into its buffer, as in fio.
            let max = gen.max_block() as usize;
            for slot in 0..depth {
                fill_random(lane.buf(slot, max), a.seed ^ ((slot as u64) << 32));
            }
        }
        let clock = Clock::get();
        Ok(CloneRun {
            progress,
            index: a.index,
            gen,
            slots: (0..depth)
                .map(|_| Slot {
                    dir: IoDir::Read,
                    offset: 0,
                    len: 0,
                    t0: 0,
                    t1: 0,
                })
                .collect(),
            free: (0..depth).rev().collect(),
            read: DirResult::new(),
            write: DirResult::new(),
            written: verifying.then(|| WrittenMap::new(start, len)),
            generation: 0,
            verified: 0,
            batch_submit: spec.iodepth_batch_submit.max(1) as usize,
            batch_complete: spec.iodepth_batch_complete.max(1) as usize,
            byte_limit: if spec.time_based { None } else { Some(len) },
            issued: 0,
            in_flight: 0,
            stopping: false,
            measuring: false,
            clock,
            ramp_mark: Mark::new(clock, w.ramp_end),
            ramp_end: 0,
            deadline: w.deadline.map(|d| Mark::new(clock, d)),
            first_measured: None,
            last_done: clock.now_ns(),
            pacer: Pacer::of(spec, w.start),
            pending: None,
            io_timeout: w.io_timeout,
        })
    }

    /// Submit until the depth is full, the rate says wait or the clone stops, and let it
    /// all reach the device. Returns when the next I/O held back by the rate is due.
    pub fn fill(&mut self, lane: &mut dyn Lane) -> Result<Option<Instant>, String> {
        let clock = self.clock;
        let now = clock.now_ns();
        self.ramp_end = self.ramp_mark.ns(clock, now);
        if !self.measuring && now >= self.ramp_end {
            self.measuring = true;
            self.first_measured = Some(now);
        }
        if self
            .deadline
            .as_mut()
            .is_some_and(|d| now >= d.ns(clock, now))
            || self.progress.stop.load(Ordering::Relaxed)
        {
            self.stopping = true;
        }
        let verifying = self.written.is_some();
        let depth = self.slots.len();
        let mut unsent = 0;
        let mut due = None;
        while !self.stopping && self.in_flight < depth && !self.free.is_empty() {
            let u = self.pending.take().unwrap_or_else(|| self.gen.next());
            // Verified I/O never overlaps I/O in flight (fio's serialize_overlap): a read
            // racing a write of the same sectors may find either, or a sector half
            // written, and the written map would say which it must be only afterwards.
            if verifying && overlaps_in_flight(&self.slots, &self.free, &u) {
                self.pending = Some(u);
                break;
            }
            if let Some(p) = self.pacer.as_mut() {
                let now = Instant::now();
                if let Some(t) = p.due(u.dir, now) {
                    self.pending = Some(u);
                    due = Some(t);
                    break;
                }
                p.started(u.dir, u.len, now);
            }
            let Some(slot) = self.free.pop() else { break };
            if u.dir == IoDir::Write && verifying {
                self.generation += 1;
                verify::fill(lane.buf(slot, u.len as usize), u.offset, self.generation);
            }
            let t0 = clock.now_ns();
            lane.submit(slot, u.dir, u.offset, u.len)?;
            let t1 = clock.now_ns();
            self.slots[slot] = Slot {
                dir: u.dir,
                offset: u.offset,
                len: u.len,
                t0,
                t1,
            };
            self.in_flight += 1;
            self.issued += u.len;
            // Counted rather than `n % batch_submit`: no division per I/O.
            unsent += 1;
            if unsent == self.batch_submit {
                unsent = 0;
                lane.unplug()?;
            }
            if self.byte_limit.is_some_and(|l| self.issued >= l) {
                self.stopping = true;
            }
        }
        lane.unplug()?;
        Ok(due)
    }

    /// Whether the clone is over: nothing in flight, and nothing more to send (it stopped,
    /// or no rate holds an I/O back).
    pub fn over(&self, due: Option<Instant>) -> bool {
        self.in_flight == 0 && (self.stopping || due.is_none())
    }

    /// Take the finished I/Os in `done`, reaped at `tc` on the [`Clock`].
    pub fn complete(&mut self, lane: &mut dyn Lane, done: &[Done], tc: u64) -> Result<(), String> {
        let mut bytes = 0;
        for &(slot, ref result) in done {
            self.in_flight -= 1;
            self.free.push(slot);
            let s = &self.slots[slot];
            if let Err(e) = result {
                return Err(format!(
                    "{:?} of {} bytes at offset {} failed: {e}",
                    s.dir, s.len, s.offset
                ));
            }
            if let Some(map) = self.written.as_mut() {
                match s.dir {
                    IoDir::Write => map.mark(s.offset, s.len),
                    IoDir::Read => {
                        self.verified +=
                            verify::check(lane.buf(slot, s.len as usize), s.offset, map)
                                .map_err(|e| e.to_string())?
                    }
                }
            }
            bytes += s.len;
            // Throughput counts every I/O that completes in the measured window (as fio
            // does: its statistics restart at the ramp's end); latency only those sent in
            // it, so that none has part of its latency cut off. (Counting only I/Os sent
            // after the ramp left a window's first QD completions out: 2 % of a 3 s run of
            // a disk limited to 256 IOPS at QD16.)
            if self.measuring {
                let d = if s.dir == IoDir::Read {
                    &mut self.read
                } else {
                    &mut self.write
                };
                d.ios += 1;
                d.bytes += s.len;
                if s.t0 >= self.ramp_end {
                    let slat = s.t1.saturating_sub(s.t0);
                    let clat = tc.saturating_sub(s.t1);
                    d.slat.record(slat.max(1));
                    d.clat.record(clat.max(1));
                    d.lat.record((slat + clat).max(1));
                }
            }
        }
        self.last_done = tc;
        self.progress
            .ios
            .fetch_add(done.len() as u64, Ordering::Relaxed);
        self.progress.bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// The clone's number in its job.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// I/Os completed in the measured window.
    pub fn ios(&self) -> u64 {
        self.read.ios + self.write.ios
    }

    /// The clone's figures, with `cpu` the driver CPU it used in the measured window; a
    /// verifying clone first reads back everything it wrote.
    pub fn finish(self, lane: &mut dyn Lane, cpu: Cpu) -> Result<CloneResult, String> {
        let runtime = self.first_measured.map_or(Duration::ZERO, |f| {
            Duration::from_nanos(self.last_done.saturating_sub(f))
        });
        let mut verified = self.verified;
        if let Some(map) = &self.written {
            verified += verify_pass(lane, map, self.gen.max_block(), self.io_timeout)?;
        }
        Ok(CloneResult {
            index: self.index,
            read: self.read,
            write: self.write,
            runtime,
            cpu,
            verified,
        })
    }
}

/// Run one clone on a thread of its own: between fills, block in the lane's `wait`.
pub(super) fn run_alone(
    spec: &JobSpec,
    lane: &mut dyn Lane,
    a: CloneArgs,
    w: &Window,
    progress: &Progress,
) -> Result<CloneResult, String> {
    let mut c = CloneRun::new(spec, lane, a, w, progress)?;
    let mut done: Vec<Done> = Vec::with_capacity(lane.depth());
    let mut cpu0 = Cpu::this_thread();
    std::thread::sleep(w.start.saturating_duration_since(Instant::now()));
    loop {
        let measuring = c.measuring;
        let due = c.fill(lane)?;
        if c.measuring && !measuring {
            cpu0 = Cpu::this_thread();
        }
        if c.over(due) {
            break;
        }
        if c.in_flight == 0 {
            // Held back by the rate with nothing in flight: sleep until it is due.
            if let Some(t) = due {
                std::thread::sleep(t.saturating_duration_since(Instant::now()));
            }
            continue;
        }
        done.clear();
        lane.wait(c.batch_complete.min(c.in_flight), &mut done, c.io_timeout)?;
        let tc = c.clock.now_ns();
        c.complete(lane, &done, tc)?;
    }
    let cpu = Cpu::this_thread().since(&cpu0);
    c.finish(lane, cpu)
}

/// Read back everything this clone wrote and check it.
fn verify_pass(
    lane: &mut dyn Lane,
    map: &WrittenMap,
    chunk: u64,
    limit: Duration,
) -> Result<u64, String> {
    let mut checked = 0;
    let mut done = Vec::with_capacity(1);
    for (off, len) in map.extents() {
        let mut at = off;
        while at < off + len {
            let n = (off + len - at).min(chunk);
            lane.submit(0, IoDir::Read, at, n)?;
            lane.unplug()?;
            done.clear();
            lane.wait(1, &mut done, limit)?;
            if let Some((_, Err(e))) = done.first() {
                return Err(format!(
                    "verify read of {n} bytes at offset {at} failed: {e}"
                ));
            }
            checked +=
                verify::check(lane.buf(0, n as usize), at, map).map_err(|e| e.to_string())?;
            at += n;
        }
    }
    Ok(checked)
}
