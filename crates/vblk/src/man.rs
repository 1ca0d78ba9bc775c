//! `vblk man --out DIR` (hidden): writes the manual pages, generated from the same clap
//! definitions as `--help`, so the two never disagree: vblk(1) and one page per
//! subcommand, vblk-serve(1), vblk-info(1), vblk-bench(1), vblk-stats(1), vblk-disk(1),
//! and one per subcommand of those (vblk-disk-add(1), ...).

use std::error::Error;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, CommandFactory};

use crate::cli::Cli;

/// Write vblk's manual pages (section 1, roff) into a directory.
#[derive(Debug, Args)]
pub struct ManArgs {
    /// The directory to write vblk.1, vblk-serve.1, ... into (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

/// `vblk man`.
pub fn run(args: ManArgs) -> Result<(), Box<dyn Error>> {
    for path in write_pages(&args.out)? {
        outln!("{}", path.display());
    }
    Ok(())
}

/// Every page's file name without the section: `vblk`, then `vblk-SUBCOMMAND` for each
/// subcommand that is not hidden, each followed by `vblk-SUBCOMMAND-SUB` for its own.
pub fn page_names() -> Vec<String> {
    let cmd = Cli::command();
    let mut names = vec!["vblk".to_owned()];
    for s in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        names.push(format!("vblk-{}", s.get_name()));
        for t in s
            .get_subcommands()
            .filter(|t| !t.is_hide_set() && t.get_name() != "help")
        {
            names.push(format!("vblk-{}-{}", s.get_name(), t.get_name()));
        }
    }
    names
}

/// Writes the pages into `dir`; returns their paths.
pub fn write_pages(dir: &Path) -> Result<Vec<PathBuf>, Box<dyn Error>> {
    let io = |what: &Path, e: std::io::Error| format!("{}: {e}", what.display());
    fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let mut cmd = Cli::command().disable_help_subcommand(true);
    // Propagates the global flags (--log-level) into each subcommand and names them
    // `vblk-serve` (the page) and `vblk serve` (the synopsis).
    cmd.build();
    let version = env!("CARGO_PKG_VERSION");
    let mut pages = vec![cmd.clone()];
    for s in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        pages.push(s.clone().version(version));
        for t in s
            .get_subcommands()
            .filter(|t| !t.is_hide_set() && t.get_name() != "help")
        {
            pages.push(t.clone().version(version));
        }
    }
    let names = page_names();
    let mut written = Vec::new();
    for page in pages {
        let man = clap_mangen::Man::new(page).manual("vblk manual");
        let path = dir.join(man.get_filename());
        let mut text = Vec::new();
        man.render(&mut text).map_err(|e| io(&path, e))?;
        let this = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        see_also(&mut text, &this, &names).map_err(|e| io(&path, e))?;
        fs::write(&path, text).map_err(|e| io(&path, e))?;
        written.push(path);
    }
    Ok(written)
}

/// A SEE ALSO section naming the other pages and the guides in the source tree.
fn see_also(w: &mut Vec<u8>, this: &str, names: &[String]) -> std::io::Result<()> {
    writeln!(w, ".SH \"SEE ALSO\"")?;
    let others: Vec<String> = names
        .iter()
        .filter(|n| n.as_str() != this)
        .map(|n| format!("\\fB{}\\fR(1)", n.replace('-', "\\-")))
        .collect();
    writeln!(w, "{}", others.join(", "))?;
    writeln!(w, ".PP")?;
    writeln!(
        w,
        "The README, docs/libvirt.md (libvirt and Cloud Hypervisor) and contrib/systemd \
         (socket-activated units) in vblk's source tree."
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_page_per_visible_subcommand() {
        assert_eq!(
            page_names(),
            [
                "vblk",
                "vblk-serve",
                "vblk-info",
                "vblk-bench",
                "vblk-stats",
                "vblk-disk",
                "vblk-disk-list",
                "vblk-disk-add",
                "vblk-disk-remove",
                "vblk-disk-set",
                "vblk-disk-resize",
                "vblk-disk-group",
                "vblk-disk-sync"
            ]
        );
        let dir = tempfile::tempdir().unwrap();
        let written = write_pages(dir.path()).unwrap();
        let files: Vec<String> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            files,
            [
                "vblk.1",
                "vblk-serve.1",
                "vblk-info.1",
                "vblk-bench.1",
                "vblk-stats.1",
                "vblk-disk.1",
                "vblk-disk-list.1",
                "vblk-disk-add.1",
                "vblk-disk-remove.1",
                "vblk-disk-set.1",
                "vblk-disk-resize.1",
                "vblk-disk-group.1",
                "vblk-disk-sync.1"
            ]
        );
        let serve = fs::read_to_string(dir.path().join("vblk-serve.1")).unwrap();
        assert!(serve.starts_with(".ie \\n(.g .ds Aq") || serve.contains(".TH vblk-serve 1"));
        assert!(
            serve.contains("\\-\\-blk\\-file"),
            "serve's flags are there"
        );
        assert!(serve.contains("\\-\\-log\\-level"), "global flags too");
        assert!(serve.contains("SEE ALSO") && serve.contains("\\fBvblk\\-stats\\fR(1)"));
        assert!(!serve.contains("\\fBvblk\\-serve\\fR(1)"), "not itself");
        let top = fs::read_to_string(dir.path().join("vblk.1")).unwrap();
        assert!(
            !top.contains("vblk\\-man"),
            "the hidden man command has no page"
        );
    }
}
