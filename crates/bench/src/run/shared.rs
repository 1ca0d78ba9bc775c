//! Several clones on one thread (`--job-threads`): one loop fills every clone's lane, polls
//! each for completions, spins while I/O is in flight, and then sleeps on all of the lanes
//! at once (each lane's call eventfd and device socket in one `ppoll`), or until the next
//! I/O the rate holds back is due. This is how one guest vCPU, an SPDK reactor or one
//! io_uring loop drives several disks: no thread per disk, no context switch between them.

use std::time::{Duration, Instant};

use super::clone::{CloneArgs, CloneRun};
use super::{Progress, Window};
use crate::job::JobSpec;
use crate::lane::{Done, Lane};
use crate::run::CloneResult;
use crate::stats::Cpu;

/// Sleep until a descriptor in `fds` is ready or `until` passes (None: no limit).
fn sleep_on(fds: &mut [libc::pollfd], until: Option<Instant>) -> Result<(), String> {
    let ts = until.map(|t| {
        let left = t.saturating_duration_since(Instant::now());
        libc::timespec {
            tv_sec: left.as_secs() as libc::time_t,
            tv_nsec: libc::c_long::from(left.subsec_nanos() as i32),
        }
    });
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: fds is a valid, writable array of fds.len() pollfd structs and tsp is null or
    // points to a timespec that lives across the call; no signal mask is passed.
    let r = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            tsp,
            std::ptr::null(),
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(format!("ppoll: {e}"));
        }
    }
    Ok(())
}

/// The error of a thread whose clones' devices held their I/O for `limit`.
fn stalled(clones: &[CloneRun], live: &[bool], limit: Duration) -> String {
    let held: Vec<String> = clones
        .iter()
        .zip(live)
        .filter(|(c, &l)| l && c.in_flight > 0)
        .map(|(c, _)| format!("clone {}: {}", c.index(), c.in_flight))
        .collect();
    format!(
        "no I/O completed for {:.1} s with I/O in flight ({}): the devices hold them (stalled or stopped; --io-timeout sets how long to wait)",
        limit.as_secs_f64(),
        held.join(", ")
    )
}

/// Run `members` (a clone's arguments and its lane each) on the calling thread until all
/// are over. The thread's CPU time in the measured window is shared out among the clones
/// by the I/Os each completed in it.
pub(super) fn run_together(
    spec: &JobSpec,
    members: &mut [(CloneArgs, Box<dyn Lane>)],
    spin: Duration,
    w: &Window,
    progress: &Progress,
) -> Result<Vec<CloneResult>, String> {
    let mut clones = Vec::with_capacity(members.len());
    for (a, lane) in members.iter_mut() {
        clones.push(CloneRun::new(spec, lane.as_mut(), *a, w, progress)?);
    }
    let n = clones.len();
    let mut live = vec![true; n];
    let mut dues: Vec<Option<Instant>> = vec![None; n];
    let depth = members.iter().map(|(_, l)| l.depth()).max().unwrap_or(1);
    let mut done: Vec<Done> = Vec::with_capacity(depth);
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(2 * n);
    let mut armed: Vec<usize> = Vec::with_capacity(n);
    let mut cpu0 = Cpu::this_thread();
    let mut measuring = false;
    // When the loop last found nothing to do with I/O in flight (None: it found some).
    let mut idle_since: Option<Instant> = None;
    // When an I/O last completed, or nothing was in flight: a device that holds its I/O
    // longer than the clones' --io-timeout fails the job rather than hanging the thread.
    let limit = w.io_timeout;
    let mut progress_at = Instant::now();
    std::thread::sleep(w.start.saturating_duration_since(Instant::now()));
    loop {
        let mut got = false;
        let mut in_flight = false;
        for (i, c) in clones.iter_mut().enumerate() {
            if !live[i] {
                continue;
            }
            let lane = members[i].1.as_mut();
            dues[i] = c.fill(lane)?;
            if c.over(dues[i]) {
                live[i] = false;
                continue;
            }
            if c.in_flight > 0 {
                done.clear();
                lane.wait(0, &mut done, limit)?;
                if !done.is_empty() {
                    let tc = crate::clock::Clock::get().now_ns();
                    c.complete(lane, &done, tc)?;
                    got = true;
                }
            }
            in_flight |= c.in_flight > 0;
        }
        if !measuring && clones.iter().any(|c| c.measuring) {
            measuring = true;
            cpu0 = Cpu::this_thread();
        }
        if !live.contains(&true) {
            break;
        }
        if got {
            idle_since = None;
            progress_at = Instant::now();
            continue;
        }
        let next_due = (0..n).filter(|&i| live[i]).filter_map(|i| dues[i]).min();
        if !in_flight {
            progress_at = Instant::now();
            // Every clone is held back by its rate.
            if let Some(t) = next_due {
                std::thread::sleep(t.saturating_duration_since(Instant::now()));
            }
            continue;
        }
        let now = Instant::now();
        if now.duration_since(progress_at) >= limit {
            return Err(stalled(&clones, &live, limit));
        }
        let since = *idle_since.get_or_insert(now);
        if now.duration_since(since) < spin {
            std::hint::spin_loop();
            continue;
        }
        // Nothing came for the spin bound: sleep on every lane with I/O in flight. A lane
        // that cannot be slept on (completions waiting, or a kind of lane whose completions
        // only polling finds) keeps the loop polling.
        fds.clear();
        armed.clear();
        let mut poll_again = false;
        for (i, c) in clones.iter().enumerate() {
            if !live[i] || c.in_flight == 0 {
                continue;
            }
            match members[i].1.arm() {
                Some([call, sock]) => {
                    armed.push(i);
                    fds.push(libc::pollfd {
                        fd: call,
                        events: libc::POLLIN,
                        revents: 0,
                    });
                    fds.push(libc::pollfd {
                        fd: sock,
                        events: libc::POLLRDHUP,
                        revents: 0,
                    });
                }
                None => {
                    poll_again = true;
                    break;
                }
            }
        }
        let slept = if poll_again {
            Ok(())
        } else {
            let until = progress_at + limit;
            sleep_on(&mut fds, Some(next_due.map_or(until, |t| t.min(until))))
        };
        for &i in &armed {
            members[i].1.disarm();
        }
        slept?;
        idle_since = None;
    }
    let cpu = Cpu::this_thread().since(&cpu0);
    let total: u64 = clones.iter().map(|c| c.ios()).sum();
    let mut out = Vec::with_capacity(n);
    for (c, (_, lane)) in clones.into_iter().zip(members.iter_mut()) {
        let share = cpu.share(c.ios(), total.max(1));
        out.push(c.finish(lane.as_mut(), share)?);
    }
    Ok(out)
}
