//! Opening a qcow2 image to serve it: its header and L1 table checked, its backing chain
//! opened from the files the command line names (never from a name the image holds on
//! its own), the translation table sized, the metadata owner started.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use super::fileio::FileIo;
use super::header::Header;
use super::meta::{Meta, Source};
use super::owner::{Answer, Job, Mailbox, Owner};
use super::refcount::Refcounts;
use super::table::Table;
use super::write::Writer;
use crate::backend::{Backend, OpenOptions};
use crate::error::Error;
use crate::format::Format;

/// A backing file named on the command line: `PATH[,format=raw|qcow2]`. Without a
/// format, the one the image's header records for its backing file is used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackingFile {
    /// The file.
    pub path: PathBuf,
    /// Its format, when the user says.
    pub format: Option<Format>,
}

impl std::str::FromStr for BackingFile {
    type Err = String;

    fn from_str(s: &str) -> Result<BackingFile, String> {
        let (path, format) = match s.rsplit_once(",format=") {
            Some((p, f)) => (p, Some(f.parse::<Format>()?)),
            None => (s, None),
        };
        if path.is_empty() {
            return Err(format!("{s:?}: expected PATH or PATH,format=raw|qcow2"));
        }
        Ok(BackingFile {
            path: PathBuf::from(path),
            format,
        })
    }
}

impl std::fmt::Display for BackingFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.path.display())?;
        if let Some(format) = self.format {
            write!(f, ",format={format}")?;
        }
        Ok(())
    }
}

/// The most L2 slices the translation table holds (4 KiB each): 8 MiB, which maps
/// 64 GiB of guest space with 64 KiB clusters, as QEMU's largest default L2 cache does.
const MAX_TABLE_SLICES: u64 = 2048;
/// The owner's metadata cache by default: 8 MiB of L2 entries (taken as slices are
/// loaded), as the translation table. The owner looks every allocation up there; a miss
/// is a synchronous read on its thread, so a cache smaller than what the guest writes
/// over turns every allocation into a read of the disk.
pub const DEFAULT_CACHE_BYTES: usize = 8 << 20;
/// Jobs waiting at an image's owner, from all its engines (an engine whose job does not
/// fit retries at its next submit or reap).
const JOB_QUEUE: usize = 1024;

/// What an image's metadata owner did since the image was opened.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Data clusters allocated.
    pub(crate) allocated: AtomicU64,
    /// L2 slices read from the file (metadata cache misses).
    pub(crate) l2_reads: AtomicU64,
    /// Changed mappings written back (each ends with an fdatasync).
    pub(crate) writebacks: AtomicU64,
    /// Guest writes the owner wrote itself, on its thread.
    pub(crate) owner_writes: AtomicU64,
}

/// An image's figures for `vblk stats`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageStats {
    /// Served writable.
    pub writable: bool,
    /// The image file's size in bytes.
    pub file_size: u64,
    /// Data clusters allocated since the image was opened.
    pub clusters_allocated: u64,
    /// L2 slices (4 KiB of entries) read from the file: misses of the metadata cache.
    pub l2_slices_read: u64,
    /// The metadata cache's capacity in bytes (`--qcow2-cache`).
    pub cache_bytes: u64,
    /// Times the changed mappings were written back (a FLUSH, a second after a change,
    /// or many changes).
    pub writebacks: u64,
    /// Guest writes the metadata thread wrote itself, one at a time (a copy-on-write, a
    /// write-through write that changes a mapping, a zero cluster's own cluster): the
    /// others are written by the workers, in parallel.
    pub owner_writes: u64,
}

/// An opened qcow2 image, shared by every engine on it.
pub struct Image {
    /// The virtual size (grown by [`Image::grow`]).
    pub(crate) size: AtomicU64,
    /// Served writable (the owner allocates; workers write owned clusters in place).
    pub(crate) writable: bool,
    pub(crate) cluster_bits: u32,
    pub(crate) table: Arc<Table>,
    pub(crate) backing: Option<Arc<Backend>>,
    pub(crate) backing_size: u64,
    pub(crate) container: Arc<Backend>,
    header: Header,
    backing_format: Option<Format>,
    jobs: Mutex<Option<SyncSender<Job>>>,
    owner: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
    cache_bytes: u64,
    hold: Arc<super::hold::Hold>,
}

impl Image {
    /// A sender of jobs for a new engine.
    pub(crate) fn jobs(&self) -> SyncSender<Job> {
        let jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        match jobs.as_ref() {
            Some(j) => j.clone(),
            // Unreachable while the image lives; a sender whose receiver is gone makes
            // every job fail with EIO, never hang.
            None => sync_channel(0).0,
        }
    }

    /// Make every completed write durable, mappings included (a writable image; a
    /// read-only one has nothing to flush). Blocks until the owner has done it.
    pub(crate) fn flush(&self) -> std::io::Result<()> {
        if !self.writable {
            return Ok(());
        }
        self.ask(|reply| Job::Flush { sub: 0, reply }).map(drop)
    }

    /// Take the image over from another daemon (`active`: its metadata read again), or
    /// let go of it (everything durable, no more writes): qcow2/handoff.rs. The caller
    /// holds, or has just released, the file's write locks. Nothing for a read-only image.
    /// Taking over adopts the virtual size the header now records (another program may
    /// have resized the image while this daemon held no lock on it): returned.
    pub(crate) fn hand_over(&self, active: bool) -> std::io::Result<u64> {
        if !self.writable {
            return Ok(self.size());
        }
        let size = self.ask(|reply| Job::Handoff { active, reply })?;
        if active {
            self.size.store(size, Ordering::Relaxed);
        }
        Ok(self.size())
    }

    /// Grow the image to `size` bytes (qcow2/resize.rs); blocks until the owner has
    /// written it. Requests may reach the new bytes once this returns.
    pub(crate) fn grow(&self, size: u64) -> std::io::Result<()> {
        self.ask(|reply| Job::Resize { size, reply })?;
        self.size.fetch_max(size, Ordering::Relaxed);
        Ok(())
    }

    /// The virtual size in bytes.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    /// Send the owner the job `make` builds and wait for its answer (checking every
    /// second that the owner still runs).
    fn ask(&self, make: impl FnOnce(Arc<Mailbox>) -> Job) -> std::io::Result<u64> {
        let reply = Arc::new(Mailbox::new(1)?);
        if self.jobs().send(make(Arc::clone(&reply))).is_err() {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        let mut answers = std::collections::VecDeque::new();
        loop {
            let mut pfd = libc::pollfd {
                fd: reply.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd; bounded so that a dead owner is noticed.
            unsafe { libc::poll(&mut pfd, 1, 1000) };
            reply.take(&mut answers);
            if let Some(Answer::Done { result, .. }) = answers.pop_front() {
                return result.map_err(std::io::Error::from_raw_os_error);
            }
            if !self.owner_alive() {
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
        }
    }

    /// Whether the owner thread still runs.
    pub(crate) fn owner_alive(&self) -> bool {
        self.owner.as_ref().is_some_and(|h| !h.is_finished())
    }

    /// The image's header as it was opened (the virtual size since: [`Image::size`]).
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The backing file, opened read-only, and its format.
    pub fn backing(&self) -> Option<(&Arc<Backend>, Format)> {
        self.backing
            .as_ref()
            .map(|b| (b, self.backing_format.unwrap_or(Format::Raw)))
    }

    /// The image file's size in bytes.
    pub fn file_size(&self) -> u64 {
        self.container.size()
    }

    /// Testing aid: the metadata owner stops at the end of its next batch of jobs that
    /// changed a mapping, before it writes the mappings to the file, until the returned
    /// value is dropped.
    pub fn hold_mappings(&self) -> super::MappingsHeld {
        super::MappingsHeld::new(Arc::clone(&self.hold))
    }

    /// What the image's metadata owner did since it was opened.
    pub fn stats(&self) -> ImageStats {
        let c = &self.counters;
        ImageStats {
            writable: self.writable,
            file_size: self.file_size(),
            clusters_allocated: c.allocated.load(Ordering::Relaxed),
            l2_slices_read: c.l2_reads.load(Ordering::Relaxed),
            cache_bytes: self.cache_bytes,
            writebacks: c.writebacks.load(Ordering::Relaxed),
            owner_writes: c.owner_writes.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // The owner returns once every sender is gone; engines (which hold theirs) are
        // gone already, as they hold the image.
        self.jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = self.owner.take() {
            let _ = h.join();
        }
    }
}

/// Open the qcow2 image in `container` (the file at `path`, opened and locked as a raw
/// file, read-only). `align` is what O_DIRECT needs of the owner's I/O: (memory, file
/// offsets and lengths), (1, 1) without it.
/// `chain` holds the (device, inode) of every image above this one.
pub(crate) fn open(
    path: &Path,
    container: Backend,
    align: (u64, u64),
    opts: &OpenOptions,
    chain: &mut Vec<(u64, u64)>,
) -> Result<Image, Error> {
    let fail = |why: String| Error::Qcow2 {
        path: path.to_owned(),
        why,
    };
    let Some(file) = container.file.as_ref() else {
        return Err(fail("not a file".into()));
    };
    let st = file.metadata().map_err(|e| fail(format!("fstat: {e}")))?;
    if chain.contains(&(st.dev(), st.ino())) {
        return Err(chain_loop(path));
    }
    chain.push((st.dev(), st.ino()));
    let reader = FileIo::new(file, align.0, align.1);
    let file_size = container.size();
    let mut head = vec![0u8; file_size.min(2 << 20) as usize];
    reader
        .read_exact_at(&mut head, 0)
        .map_err(|e| fail(format!("reading the header: {e}")))?;
    let header = Header::parse(&head, file_size).map_err(|e| fail(e.to_string()))?;
    if header.size == 0 {
        return Err(fail("its virtual size is 0".into()));
    }
    if header.cluster_size() < align.1 {
        return Err(fail(format!(
            "its clusters ({} bytes) are smaller than what O_DIRECT needs here ({} bytes): serve it with --cache writeback",
            header.cluster_size(),
            align.1
        )));
    }
    let cache_slices = (opts.qcow2_cache / 4096).max(1);
    let meta =
        Meta::open(&reader, header.clone(), cache_slices).map_err(|e| fail(e.to_string()))?;
    // A migration destination (`incoming`) reads no refcount and writes nothing until it
    // takes the image over (qcow2/handoff.rs): the source still writes it.
    let inactive = opts.image.incoming && !opts.read_only;
    if inactive && opts.image.lock == crate::ImageLock::Off {
        return Err(fail(
            "a qcow2 image is handed from a migration's source to its destination together with its image locks: --incoming needs locking on (without --image-lock off)".into(),
        ));
    }
    let refs = if opts.read_only {
        None
    } else if container.kind() == crate::BackendKind::BlockDevice {
        return Err(fail(
            "vblk writes qcow2 images in files only (it allocates at the end of the file); serve this one read-only".into(),
        ));
    } else if inactive {
        header.check_writable().map_err(&fail)?;
        Refcounts::check_width(&header).map_err(&fail)?;
        Some(Refcounts::unloaded(&header))
    } else {
        Some(prepare_writing(&reader, &header, file_size, meta.l2_tables()).map_err(fail)?)
    };
    drop(reader);

    let (backing, backing_format) = open_backing(path, &header, opts, chain, &fail)?;
    let per_slice = meta.slice_clusters();
    let clusters = header.size.div_ceil(header.cluster_size());
    let slices = clusters.div_ceil(per_slice).min(MAX_TABLE_SLICES);
    let table = Arc::new(Table::new(slices as usize, per_slice));
    let (tx, rx) = sync_channel(JOB_QUEUE);
    let container = Arc::new(container);
    let writer = match refs {
        None => None,
        Some(refs) => {
            // Copy-on-write reads the backing file on the owner's thread, synchronously.
            let sync = match &backing {
                Some(b) => Some(b.engine(crate::EngineKind::Sync, 4)?),
                None => None,
            };
            Some(Writer::new(
                refs,
                sync,
                backing.as_ref().map_or(0, |b| b.size()),
                Arc::clone(&container),
                header.version,
                header.cluster_size(),
            ))
        }
    };
    let owner = Owner {
        meta,
        table: Arc::clone(&table),
        name: path.display().to_string(),
        input: Vec::new(),
        cluster: vec![0; header.cluster_size() as usize],
        inflater: Box::default(),
        writer,
        entries: Vec::new(),
        mappings: Vec::new(),
        counters: Arc::default(),
        outbox: Vec::with_capacity(64),
        posted: Vec::new(),
        hold: Arc::default(),
        inactive,
        failures: (0, 0, None),
    };
    let counters = Arc::clone(&owner.counters);
    let hold = Arc::clone(&owner.hold);
    let c = Arc::clone(&container);
    let handle = std::thread::Builder::new()
        .name("vblk-qcow2".into())
        .spawn(move || {
            if let Some(file) = c.file.as_ref() {
                owner.run(&FileIo::new(file, align.0, align.1), rx);
            }
        })
        .map_err(|e| fail(format!("starting its metadata thread: {e}")))?;
    log::info!(
        "{}: qcow2 version {}, {} bytes virtual, clusters of {} bytes, translation table of {slices} slices{}",
        path.display(),
        header.version,
        header.size,
        header.cluster_size(),
        match &backing {
            Some(b) => format!(
                ", backing file {}",
                b.path().map(|p| p.display().to_string()).unwrap_or_default()
            ),
            None => String::new(),
        }
    );
    Ok(Image {
        size: AtomicU64::new(header.size),
        writable: !opts.read_only,
        cluster_bits: header.cluster_bits,
        table,
        backing_size: backing.as_ref().map_or(0, |b| b.size()),
        backing,
        container,
        header,
        backing_format,
        jobs: Mutex::new(Some(tx)),
        owner: Some(handle),
        counters,
        cache_bytes: cache_slices as u64 * 4096,
        hold,
    })
}

/// What writing needs, checked and loaded: the header allows it, the refcounts are
/// 16-bit and loaded, and autoclear feature bits (whose extensions vblk does not keep up
/// to date, e.g. persistent bitmaps) are cleared in the file, as QEMU clears them. At
/// open, and again when the image is taken over from another daemon.
pub(crate) fn prepare_writing(
    io: &FileIo<'_>,
    header: &Header,
    file_size: u64,
    l2_tables: impl Iterator<Item = u64>,
) -> Result<Refcounts, String> {
    header.check_writable()?;
    // Bit 0: the bitmaps extension is consistent. Clearing it (as a QEMU that does not
    // know bitmaps would) silently voids every incremental backup built on them.
    let bitmaps = header
        .other_extensions
        .iter()
        .filter(|(kind, _, _)| *kind == super::header::ext::BITMAPS)
        .count();
    if header.version >= 3 && header.autoclear & 1 != 0 && bitmaps > 0 {
        return Err(
            "it has persistent dirty bitmaps (`qemu-img info` lists them), which vblk does not keep up to date: writing would make them inconsistent, and incremental backups built on them with them; serve it --read-only, or remove them first (qemu-img bitmap --remove IMAGE NAME)"
                .into(),
        );
    }
    let refs = Refcounts::open(io, header, file_size, l2_tables)?;
    if header.version >= 3 && header.autoclear != 0 {
        io.write_all_at(&0u64.to_be_bytes(), 88)
            .and_then(|()| io.sync())
            .map_err(|e| format!("clearing its autoclear feature bits: {e}"))?;
        log::info!(
            "autoclear feature bits {:#x} cleared (their extensions are not kept up to date while vblk writes)",
            header.autoclear
        );
    }
    Ok(refs)
}

/// A chain that comes back to a file already in it.
pub(crate) fn chain_loop(path: &Path) -> Error {
    Error::Qcow2 {
        path: path.to_owned(),
        why: "the backing chain comes back to this file: a loop (each --backing must be a different file)".into(),
    }
}

/// The backing file the header names, opened from the first `--backing`.
fn open_backing(
    path: &Path,
    header: &Header,
    opts: &OpenOptions,
    chain: &mut Vec<(u64, u64)>,
    fail: &dyn Fn(String) -> Error,
) -> Result<(Option<Arc<Backend>>, Option<Format>), Error> {
    let named = header
        .backing_name
        .as_deref()
        .map(|n| String::from_utf8_lossy(n).into_owned());
    let recorded = header
        .backing_format
        .as_deref()
        .map(|n| String::from_utf8_lossy(n).into_owned());
    let given = opts.backing.first();
    let (name, b) = match (named, given) {
        (None, None) => return Ok((None, None)),
        (None, Some(b)) => {
            return Err(fail(format!(
                "it has no backing file, yet --backing names {} (one --backing per image below it, in order)",
                b.path.display()
            )))
        }
        (Some(name), None) => {
            return Err(fail(format!(
                "its header names the backing file {name:?}{}; vblk opens only backing files named on its command line: add --backing PATH (it is opened read-only)",
                recorded
                    .as_deref()
                    .map(|f| format!(" (format {f})"))
                    .unwrap_or_default()
            )))
        }
        (Some(name), Some(b)) => (name, b),
    };
    let format = match (b.format, recorded.as_deref()) {
        // The header's record wins where it is one vblk knows: format= is for images
        // that record none (or one vblk does not know). A base read in the wrong format
        // shows the guest another image's metadata as its data.
        (Some(f), Some(r)) => match r.parse::<Format>() {
            Ok(known) if known != f => {
                return Err(fail(format!(
                    "its header records the backing format {r}, and --backing {},format={f} says otherwise: leave format= out (it is for images whose header records none)",
                    b.path.display()
                )))
            }
            _ => f,
        },
        (Some(f), None) => f,
        (None, Some(f)) => f.parse::<Format>().map_err(|e| {
            fail(format!(
                "its header records the backing format {e}; name it: --backing {},format=raw|qcow2",
                b.path.display()
            ))
        })?,
        (None, None) => {
            return Err(fail(format!(
                "its header does not record its backing file's format: name it, --backing {},format=raw or ,format=qcow2",
                b.path.display()
            )))
        }
    };
    // The header's name, resolved as QEMU resolves it (relative to the image's
    // directory), is only looked at, never opened: it must not be a different file
    // than the one named on the command line, if it exists.
    let resolved = match Path::new(&name) {
        p if p.is_absolute() => p.to_owned(),
        p => path.parent().unwrap_or(Path::new(".")).join(p),
    };
    let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    // A file handed over open is the one given (its path may not even be the client's).
    let handed = opts.backing_files.first();
    let given_id = match handed {
        Some(f) => f.metadata().ok().map(|m| (m.dev(), m.ino())),
        None => id(&b.path),
    }
    .ok_or_else(|| fail(format!("--backing {}: no such file", b.path.display())))?;
    if let Some(named_id) = id(&resolved) {
        if named_id != given_id {
            return Err(fail(format!(
                "its header names the backing file {name:?} ({}), which is not {} given by --backing; if the base moved, `qemu-img rebase -u -b NEW -F FORMAT` records where",
                resolved.display(),
                b.path.display()
            )));
        }
    }
    let mut o = opts.clone();
    o.read_only = true;
    o.image.format = Some(format);
    o.image.incoming = false;
    o.backing = opts.backing[1..].to_vec();
    o.backing_files = opts.backing_files.iter().skip(1).cloned().collect();
    let backing = match handed {
        Some(f) => crate::backend::handed_in_chain(&b.path, f, &o, chain)?,
        None => crate::backend::open_in_chain(&b.path, &o, chain)?,
    };
    Ok((Some(Arc::new(backing)), Some(format)))
}
