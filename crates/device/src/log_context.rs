//! Which disk a thread works for, so that a daemon of many disks can say it in every
//! log line: a disk's own thread (its sessions) says it for good, a pool thread while it
//! serves one disk's worker. The program's logger reads it ([`with_current_disk`]) and
//! prefixes lines that do not name a disk already.

use std::cell::Cell;
use std::marker::PhantomData;

thread_local! {
    /// The name of the disk this thread works for now.
    static DISK: Cell<Option<*const str>> = const { Cell::new(None) };
}

/// Call `f` with the name of the disk this thread works for now, if any.
pub fn with_current_disk<R>(f: impl FnOnce(Option<&str>) -> R) -> R {
    DISK.with(|d| {
        // SAFETY: a pointer is stored only by a `Working` guard, which borrows the
        // string for its whole life and puts the previous pointer back when dropped,
        // on this thread: a stored pointer always points to a live string.
        let name = d.get().map(|p| unsafe { &*p });
        f(name)
    })
}

/// While alive, this thread works for the disk it names.
pub(crate) struct Working<'a> {
    prev: Option<*const str>,
    _name: PhantomData<&'a str>,
}

impl<'a> Working<'a> {
    pub(crate) fn new(name: &'a str) -> Working<'a> {
        let prev = DISK.with(|d| d.replace(Some(name as *const str)));
        Working {
            prev,
            _name: PhantomData,
        }
    }
}

impl Working<'static> {
    /// A guard for a name the caller keeps alive otherwise.
    ///
    /// # Safety
    ///
    /// `name` must point to a live string until the guard is dropped.
    pub(crate) unsafe fn from_raw(name: *const str) -> Working<'static> {
        let prev = DISK.with(|d| d.replace(Some(name)));
        Working {
            prev,
            _name: PhantomData,
        }
    }
}

impl Drop for Working<'_> {
    fn drop(&mut self) {
        DISK.with(|d| d.set(self.prev));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disk_is_named_while_a_guard_lives_and_nests() {
        assert_eq!(with_current_disk(|d| d.map(str::to_owned)), None);
        let a = String::from("a");
        {
            let _a = Working::new(&a);
            assert_eq!(
                with_current_disk(|d| d.map(str::to_owned)).as_deref(),
                Some("a")
            );
            {
                let _b = Working::new("b");
                assert_eq!(
                    with_current_disk(|d| d.map(str::to_owned)).as_deref(),
                    Some("b")
                );
            }
            assert_eq!(
                with_current_disk(|d| d.map(str::to_owned)).as_deref(),
                Some("a")
            );
        }
        assert_eq!(with_current_disk(|d| d.map(str::to_owned)), None);
    }
}
