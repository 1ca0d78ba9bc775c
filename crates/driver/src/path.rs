//! I/O paths: how requests reach the ring and when the device is told about them.
//!
//! This is the seam where the paths the Linux virtio-blk debates compared plug in. A path
//! sees every request as it is put on the ring and decides when to publish and notify.
//!
//! - [`PathKind::Bio`]: each I/O becomes one virtio request and the device is notified at
//!   once (virtio_blk `use_bio=1`, 2011-2012).
//! - [`PathKind::Batch`]: requests are gathered (the queue is "plugged") and published with
//!   one notification when the caller unplugs, when the batch is full, or before the queue
//!   waits (the 2011 RFC's bio batching).

use std::fmt;
use std::str::FromStr;

/// Which I/O path a queue uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
pub enum PathKind {
    /// One request, one notification.
    #[default]
    Bio,
    /// Plugged: one publication and notification per batch.
    Batch,
}

impl PathKind {
    /// Every path, in the order a comparison lists them.
    pub const ALL: [PathKind; 2] = [PathKind::Bio, PathKind::Batch];

    /// The path's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PathKind::Bio => "bio",
            PathKind::Batch => "batch",
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
            .ok_or_else(|| format!("unknown I/O path {s:?} (expected bio or batch)"))
    }
}

/// A path's state on one queue.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Path {
    kind: PathKind,
    batch: u16,
}

impl Path {
    pub(crate) fn new(kind: PathKind, batch: u16) -> Path {
        Path {
            kind,
            batch: batch.max(1),
        }
    }

    pub(crate) fn kind(&self) -> PathKind {
        self.kind
    }

    /// A request was put on the ring; `unpublished` requests are now waiting. True when the
    /// path wants them published and the device notified now.
    pub(crate) fn after_add(&self, unpublished: u16) -> bool {
        match self.kind {
            PathKind::Bio => true,
            PathKind::Batch => unpublished >= self.batch,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bio_notifies_every_request_batch_every_n() {
        let bio = Path::new(PathKind::Bio, 8);
        assert!(bio.after_add(1));
        let batch = Path::new(PathKind::Batch, 4);
        assert!(!batch.after_add(1));
        assert!(!batch.after_add(3));
        assert!(batch.after_add(4));
        assert_eq!("batch".parse::<PathKind>(), Ok(PathKind::Batch));
        assert!("elevator"
            .parse::<PathKind>()
            .unwrap_err()
            .contains("bio or batch"));
    }
}
