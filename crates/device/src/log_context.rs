//! Which disk a thread works for, so that a daemon of many disks can say it in every
//! log line: a disk's own thread (its sessions) says it for good, a pool thread while it
//! serves one disk's worker. The program's logger reads it ([`with_current_disk`]) and
//! prefixes lines that do not name a disk already.

use std::cell::Cell;

thread_local! {
    /// The name of the disk this thread works for now.
    static DISK: Cell<Option<*const str>> = const { Cell::new(None) };
}

/// Call `f` with the name of the disk this thread works for now, if any.
pub fn with_current_disk<R>(f: impl FnOnce(Option<&str>) -> R) -> R {
    DISK.with(|d| {
        // SAFETY: a pointer is stored only by `with_disk_ptr` (and `with_disk`), for the
        // length of a call during which the caller keeps the string alive, and the
        // previous one is put back when that call ends, however it ends (`Restore`): a
        // stored pointer always points to a live string.
        let name = d.get().map(|p| unsafe { &*p });
        f(name)
    })
}

/// Run `f` as work for the disk `name`.
pub(crate) fn with_disk<R>(name: &str, f: impl FnOnce() -> R) -> R {
    // SAFETY: `name` is borrowed for the whole call.
    unsafe { with_disk_ptr(name, f) }
}

/// [`with_disk`] for a name the caller cannot lend while `f` runs (it lives in what `f`
/// borrows mutably).
///
/// # Safety
///
/// `name` must point to a string that stays alive, unmoved and unchanged until this
/// returns.
pub(crate) unsafe fn with_disk_ptr<R>(name: *const str, f: impl FnOnce() -> R) -> R {
    /// Puts the previous name back, on a return or an unwind alike.
    struct Restore(Option<*const str>);
    impl Drop for Restore {
        fn drop(&mut self) {
            DISK.with(|d| d.set(self.0));
        }
    }
    let _restore = Restore(DISK.with(|d| d.replace(Some(name))));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> Option<String> {
        with_current_disk(|d| d.map(str::to_owned))
    }

    #[test]
    fn the_disk_is_named_during_its_call_and_calls_nest() {
        assert_eq!(now(), None);
        let a = String::from("a");
        with_disk(&a, || {
            assert_eq!(now().as_deref(), Some("a"));
            with_disk("b", || assert_eq!(now().as_deref(), Some("b")));
            assert_eq!(now().as_deref(), Some("a"));
        });
        assert_eq!(now(), None);
        // An unwind puts the previous name back too.
        let r = std::panic::catch_unwind(|| with_disk("c", || panic!("in the call")));
        assert!(r.is_err());
        assert_eq!(now(), None);
    }
}
