//! A testing aid: once confined, try something the sandbox must stop, and say what
//! happened (`VBLK_SANDBOX_SELFTEST`, read by the daemon after it confined itself). With
//! `--seccomp kill`, `execve` and `socket-inet` end the process (SIGSYS); `open-passwd`
//! fails with EACCES (Landlock). The tests run the daemon with it and check.

use std::os::fd::FromRawFd;

/// Try `what` and log the outcome.
pub fn selftest(what: &str) {
    match what {
        "execve" => {
            let path = c"/bin/true";
            let argv = [path.as_ptr(), std::ptr::null()];
            let envp = [std::ptr::null()];
            // SAFETY: NUL-terminated path and NULL-terminated argument arrays.
            let rc = unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
            log::error!(
                "sandbox self-test: execve(/bin/true) returned {rc}: {}",
                std::io::Error::last_os_error()
            );
        }
        "open-passwd" => match std::fs::File::open("/etc/passwd") {
            Ok(_) => log::error!("sandbox self-test: opened /etc/passwd"),
            Err(e) => log::info!("sandbox self-test: open(/etc/passwd) refused: {e}"),
        },
        "socket-inet" => {
            // SAFETY: socket takes integers; a returned fd is closed at once.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
            if fd >= 0 {
                // SAFETY: fd was just made and is owned by nothing else.
                drop(unsafe { std::fs::File::from_raw_fd(fd) });
                log::error!("sandbox self-test: socket(AF_INET) succeeded");
            } else {
                log::info!(
                    "sandbox self-test: socket(AF_INET) refused: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
        other => log::warn!("sandbox self-test: unknown test {other:?}"),
    }
}
