//! The filesystem layer: Landlock.
//!
//! The ruleset handles every filesystem access right of the kernel's Landlock ABI and
//! grants two: removing files in the directories of the daemon's own sockets (they are
//! removed at exit, and only if still ours), and reading files and directories under
//! /proc (the names of an image lock's holders). With ABI 4 it also handles TCP bind and
//! connect, and grants connects to the ports of the NBD servers in use (a TCP NBD disk
//! reconnects when its server restarts); no bind. Unix sockets are not a filesystem access
//! Landlock controls: NBD servers on Unix sockets are reached as before.
//!
//! Landlock confines the calling thread and the threads it starts later; `confine` runs
//! on the main thread before the daemon starts its other threads.

use landlock::{
    Access, AccessFs, AccessNet, NetPort, PathBeneath, PathFd, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, ABI,
};

use super::{Needs, SandboxError};

/// The newest ABI this code knows; the kernel's may be older (the ruleset then handles
/// what it has, and the report says which ABI applied).
const ABI_WANTED: ABI = ABI::V5;

/// Apply the ruleset to this thread; a line for the report.
pub(crate) fn confine(needs: &Needs) -> Result<String, SandboxError> {
    let err = |e: &dyn std::fmt::Display| SandboxError::Landlock(e.to_string());
    let fs_all = AccessFs::from_all(ABI_WANTED);
    let mut ruleset = Ruleset::default()
        .handle_access(fs_all)
        .map_err(|e| err(&e))?
        .handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp)
        .map_err(|e| err(&e))?
        .create()
        .map_err(|e| err(&e))?;
    let mut dirs: Vec<_> = needs
        .removable
        .iter()
        .filter_map(|p| p.parent())
        // A bare name (`--socket-path s.sock`) has the empty path as its parent, which
        // cannot be opened: it is the working directory.
        .map(|d| {
            if d.as_os_str().is_empty() {
                std::path::PathBuf::from(".")
            } else {
                d.to_path_buf()
            }
        })
        .collect();
    dirs.sort();
    dirs.dedup();
    for d in &dirs {
        let fd = PathFd::new(d).map_err(|e| err(&e))?;
        ruleset = ruleset
            .add_rule(PathBeneath::new(fd, AccessFs::RemoveFile))
            .map_err(|e| err(&e))?;
    }
    if let Ok(fd) = PathFd::new("/proc") {
        ruleset = ruleset
            .add_rule(PathBeneath::new(fd, AccessFs::ReadFile | AccessFs::ReadDir))
            .map_err(|e| err(&e))?;
    }
    for &port in &needs.tcp_ports {
        ruleset = ruleset
            .add_rule(NetPort::new(port, AccessNet::ConnectTcp))
            .map_err(|e| err(&e))?;
    }
    let status = ruleset.restrict_self().map_err(|e| err(&e))?;
    Ok(match status.ruleset {
        RulesetStatus::FullyEnforced => {
            "filesystem confined (Landlock: nothing but the socket directories and /proc)"
                .to_string()
        }
        RulesetStatus::PartiallyEnforced => {
            "filesystem confined, partly (this kernel's Landlock lacks some of the rights vblk asks for)"
                .to_string()
        }
        RulesetStatus::NotEnforced => {
            log::warn!(
                "the filesystem is NOT confined: this kernel has no Landlock (CONFIG_SECURITY_LANDLOCK, and `landlock` in the lsm= boot list); the daemon can open any file its user may"
            );
            "filesystem NOT confined (no Landlock in this kernel)".to_string()
        }
    })
}
