//! A testing aid: the metadata owner stopped at the end of a batch of jobs, after it
//! changed mappings and before it writes them to the file ([`Image::hold_mappings`]).
//! That is the window in which no worker may write a newly given cluster in place: the
//! tests hold the owner there and check what the workers do meanwhile. Unheld, it costs
//! the owner one relaxed load per batch that changed a mapping.
//!
//! [`Image::hold_mappings`]: super::Image::hold_mappings

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Shared by an image and its owner.
#[derive(Default)]
pub(crate) struct Hold {
    on: AtomicBool,
    /// (held, the owner is stopped at it)
    state: Mutex<(bool, bool)>,
    changed: Condvar,
}

impl Hold {
    /// The owner's side: wait here while held.
    pub(crate) fn pause(&self) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.1 = true;
        self.changed.notify_all();
        while s.0 {
            s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        s.1 = false;
    }
}

/// The owner is held while this lives ([`super::Image::hold_mappings`]).
pub struct MappingsHeld {
    hold: Arc<Hold>,
}

impl MappingsHeld {
    pub(crate) fn new(hold: Arc<Hold>) -> MappingsHeld {
        *hold.state.lock().unwrap_or_else(PoisonError::into_inner) = (true, false);
        hold.on.store(true, Ordering::Relaxed);
        MappingsHeld { hold }
    }

    /// Wait up to `timeout` for the owner to stop with changed mappings not yet in the
    /// file; whether it did.
    pub fn wait_until_stopped(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut s = self
            .hold
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while !s.1 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            s = self
                .hold
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }
}

impl Drop for MappingsHeld {
    fn drop(&mut self) {
        self.hold.on.store(false, Ordering::Relaxed);
        self.hold
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0 = false;
        self.hold.changed.notify_all();
    }
}
