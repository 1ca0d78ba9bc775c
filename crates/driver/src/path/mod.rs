//! I/O paths: what goes to the ring, and when the device is told.
//!
//! These are the paths the Linux virtio-blk debates compared, as things you can run:
//!
//! - [`PathKind::Bio`]: each I/O becomes its own virtio request(s), published with a
//!   notification at once (virtio_blk `use_bio=1`, 2011-2012).
//! - [`PathKind::Batch`]: as bio, but requests are gathered and published with one
//!   notification when the caller unplugs, when the batch is full, or before the queue
//!   waits (the 2011 RFC's bio batching).
//! - [`PathKind::Request`]: the block layer's request-based path. I/Os gather in a plug,
//!   adjacent ones of the same kind merge (back and front) into one request, and an
//!   elevator ([`ElevatorKind`]) decides the dispatch order, within a device queue depth.
//! - [`PathKind::Passthru`]: raw virtio-blk commands through a submission/completion ring
//!   pair with polled completions; a different API ([`crate::Passthru`]). Through
//!   [`crate::Queue`]'s own API it behaves as `bio`.
//! - [`PathKind::Auto`]: the driver picks among bio, batch and request (at the configured
//!   depth or a shallow one) per disk from what the device reports and what it measures
//!   ([`crate::AutoReport`] says what it chose).
//!
//! Every path keeps the same promises: each I/O completes exactly once, flushes are not
//! overtaken by I/O submitted after them, and FUA writes complete only once durable.

pub(crate) mod auto;
mod bfq;
mod deadline;
mod noop;
pub(crate) mod request;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Which I/O path a queue uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
pub enum PathKind {
    /// One I/O, its own request(s), one notification.
    #[default]
    Bio,
    /// Plugged: one publication and notification per batch.
    Batch,
    /// Plug, merge, elevator.
    Request,
    /// Raw commands, polled completions ([`crate::Passthru`]).
    Passthru,
    /// Chosen per queue from the device's hints and measurements.
    Auto,
}

impl PathKind {
    /// Every path, in the order a comparison lists them.
    pub const ALL: [PathKind; 5] = [
        PathKind::Bio,
        PathKind::Batch,
        PathKind::Request,
        PathKind::Passthru,
        PathKind::Auto,
    ];

    /// The path's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PathKind::Bio => "bio",
            PathKind::Batch => "batch",
            PathKind::Request => "request",
            PathKind::Passthru => "passthru",
            PathKind::Auto => "auto",
        }
    }
}

impl fmt::Display for PathKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PathKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        PathKind::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!("unknown I/O path {s:?} (expected bio, batch, request, passthru or auto)")
            })
    }
}

/// The request path's I/O scheduler (Linux's `queue/scheduler`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
pub enum ElevatorKind {
    /// FIFO with merging (Linux's `none`, formerly `noop`).
    Noop,
    /// mq-deadline: sector-sorted batches, per-direction FIFOs with expiry, reads
    /// preferred up to `writes_starved`.
    #[default]
    Deadline,
    /// Proportional share between flows (B-WF2Q+ on sectors served, as BFQ schedules its
    /// queues; without BFQ's idling).
    Bfq,
}

impl ElevatorKind {
    /// Every elevator.
    pub const ALL: [ElevatorKind; 3] = [
        ElevatorKind::Noop,
        ElevatorKind::Deadline,
        ElevatorKind::Bfq,
    ];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ElevatorKind::Noop => "noop",
            ElevatorKind::Deadline => "deadline",
            ElevatorKind::Bfq => "bfq",
        }
    }
}

impl fmt::Display for ElevatorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ElevatorKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = match s {
            "none" => "noop",
            "mq-deadline" => "deadline",
            s => s,
        };
        ElevatorKind::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown elevator {s:?} (expected noop, deadline or bfq)"))
    }
}

/// Tunables of the request path, named after Linux's sysfs files (`queue/…` and
/// `queue/iosched/…`), with Linux's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RequestOptions {
    /// The I/O scheduler (`queue/scheduler`).
    pub elevator: ElevatorKind,
    /// Largest merged request in KiB (`queue/max_sectors_kb`; 1280 in Linux). An I/O
    /// larger than this on its own is still sent whole (split only by the device's limits).
    pub max_sectors_kb: u32,
    /// 0: merge in the plug and the elevator; 1: only with the last request of the plug
    /// (a one-hit merge); 2: never (`queue/nomerges`).
    pub nomerges: u8,
    /// Requests the plug gathers before it is flushed (Linux: 32).
    pub plug_count: u16,
    /// A request at least this large flushes the plug (Linux's BLK_PLUG_FLUSH_SIZE, 128 KiB).
    pub plug_flush_bytes: u32,
    /// Requests the path keeps on the ring at most; more wait in the elevator, which is
    /// where it can reorder (the device's queue depth; 0: the ring size).
    pub queue_depth: u16,
    /// deadline: requests dispatched in sector order before the FIFOs are looked at again.
    pub fifo_batch: u32,
    /// deadline: how long a read may wait before it is served first.
    pub read_expire: Duration,
    /// deadline: how long a write may wait before it is served first.
    pub write_expire: Duration,
    /// deadline: read batches served while writes wait before a write batch.
    pub writes_starved: u32,
    /// deadline: allow front merges (`iosched/front_merges`).
    pub front_merges: bool,
}

impl Default for RequestOptions {
    fn default() -> Self {
        RequestOptions {
            elevator: ElevatorKind::Deadline,
            max_sectors_kb: 1280,
            nomerges: 0,
            plug_count: 32,
            plug_flush_bytes: 128 << 10,
            queue_depth: 0,
            fifo_batch: 16,
            read_expire: Duration::from_millis(500),
            write_expire: Duration::from_secs(5),
            writes_starved: 2,
            front_merges: true,
        }
    }
}

impl RequestOptions {
    /// Set one tunable by its sysfs name (`scheduler`, `max_sectors_kb`, `nomerges`,
    /// `plug_count`, `queue_depth`, `fifo_batch`, `read_expire` (ms), `write_expire` (ms),
    /// `writes_starved`, `front_merges`); dashes may stand for underscores.
    pub fn set(&mut self, name: &str, value: &str) -> Result<(), String> {
        let num = |v: &str| -> Result<u64, String> {
            v.parse::<u64>()
                .map_err(|_| format!("{name}: {v:?} is not a whole number"))
        };
        let small = |v: &str, max: u64| -> Result<u64, String> {
            let n = num(v)?;
            if n > max {
                return Err(format!("{name}: {n} is above the limit of {max}"));
            }
            Ok(n)
        };
        match name.replace('-', "_").as_str() {
            "scheduler" | "elevator" => self.elevator = value.parse()?,
            "max_sectors_kb" => self.max_sectors_kb = small(value, 1 << 20)?.max(1) as u32,
            "nomerges" => self.nomerges = small(value, 2)? as u8,
            "plug_count" => self.plug_count = small(value, 4096)?.max(1) as u16,
            "queue_depth" | "nr_requests" => self.queue_depth = small(value, 32768)? as u16,
            "fifo_batch" => self.fifo_batch = small(value, 1 << 20)?.max(1) as u32,
            "read_expire" => self.read_expire = Duration::from_millis(num(value)?),
            "write_expire" => self.write_expire = Duration::from_millis(num(value)?),
            "writes_starved" => self.writes_starved = small(value, 1 << 20)? as u32,
            "front_merges" => self.front_merges = small(value, 1)? == 1,
            other => {
                return Err(format!(
                    "unknown request-path tunable {other:?} (expected scheduler, max_sectors_kb, \
                     nomerges, plug_count, queue_depth, fifo_batch, read_expire, write_expire, \
                     writes_starved or front_merges)"
                ))
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for p in PathKind::ALL {
            assert_eq!(p.name().parse::<PathKind>(), Ok(p));
        }
        assert!("elevator"
            .parse::<PathKind>()
            .unwrap_err()
            .contains("bio, batch, request, passthru or auto"));
        assert_eq!("none".parse::<ElevatorKind>(), Ok(ElevatorKind::Noop));
        assert_eq!(
            "mq-deadline".parse::<ElevatorKind>(),
            Ok(ElevatorKind::Deadline)
        );
    }

    #[test]
    fn tunables_by_sysfs_name_with_clear_errors() {
        let mut o = RequestOptions::default();
        o.set("fifo-batch", "4").unwrap();
        o.set("read_expire", "20").unwrap();
        o.set("scheduler", "bfq").unwrap();
        assert_eq!(o.fifo_batch, 4);
        assert_eq!(o.read_expire, Duration::from_millis(20));
        assert_eq!(o.elevator, ElevatorKind::Bfq);
        assert!(o.set("nomerges", "3").unwrap_err().contains("limit of 2"));
        assert!(o
            .set("fifo_batch", "x")
            .unwrap_err()
            .contains("whole number"));
        assert!(o.set("quantum", "1").unwrap_err().contains("unknown"));
    }
}
