//! A whole qcow2 image the fuzzer chooses, opened writable through the storage crate's
//! public API and driven by the requests it chooses: the L1 table, refcount table and
//! blocks, L2 tables and data are all its bytes.
//!
//! Input: two bytes (little endian) giving the image's length N, N bytes of image file,
//! then the requests. The seeds (`fuzz/seeds/qcow2_image/`) are images `qemu-img`
//! wrote, so mutations land in valid tables; a header the parser refuses ends the run
//! early (the `qcow2_header` target covers the parser). A backing file the header names
//! is served by a raw file of the fuzzer's size, named on the "command line" as a user
//! would; the image never opens a file by its own name.
//!
//! What must hold: opening returns an error or a disk; no request panics or hangs (the
//! owner thread too: libFuzzer aborts on a panic in any thread and its timeout catches a
//! hang); every read and write that succeeds moved exactly its length; a successful
//! write read back at once (nothing in between) gives the written bytes; closing
//! returns.

use std::fs::{self, File};
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use storage::qcow2::{BackingFile, Header};
use storage::{Backend, CacheMode, DiskSpec, Engine, EngineKind, Format, Op, OpenOptions};

use crate::input::Input;
use crate::trace;

/// The most requests one input makes.
const MAX_REQUESTS: usize = 32;
/// The largest request: 64 KiB, a few clusters of the small sizes the seeds use; one in
/// sixteen may reach 1 MiB, more L2 slices than the smallest translation table holds
/// at once (16 slices of 32 KiB with 512-byte clusters).
const MAX_LEN: u64 = 64 << 10;
const MAX_RARE_LEN: u64 = 1 << 20;

/// The per-process directory the image (and its backing file) is written into: on tmpfs
/// when there is one (no O_DIRECT is asked; the page cache is the device here).
fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if fs::metadata("/dev/shm").is_ok() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let d = base.join(format!("vblk-fuzz-qcow2-{}", std::process::id()));
        fs::create_dir_all(&d).expect("the fuzz scratch directory");
        d
    })
}

pub fn run(data: &[u8]) {
    let Some((len, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let n = usize::from(u16::from_le_bytes(*len)).min(rest.len());
    let (image, rest) = rest.split_at(n);
    let mut input = Input::new(rest);
    let Ok(header) = Header::parse(image, image.len() as u64) else {
        return;
    };
    let path = dir().join("image.qcow2");
    write_file(&path, image);
    let mut options = OpenOptions {
        // One image in four read-only: images vblk refuses to write (other refcount
        // widths, a dirty or corrupt flag) are still served read-only.
        read_only: input.below(4) == 0,
        cache: CacheMode::Writeback,
        // The smallest cache: every slice past the first is an eviction, so the writer's
        // eviction paths run as often as its lookups.
        qcow2_cache: 4096 * (1 + input.below(4) as usize),
        ..OpenOptions::default()
    };
    options.image.format = Some(Format::Qcow2);
    if header.backing_name.is_some() {
        let base = dir().join("base.raw");
        let len = 512 * input.below(4096);
        write_file(&base, &vec![0x5a; len as usize]);
        options.backing.push(BackingFile {
            path: base,
            format: Some(Format::Raw),
        });
    }
    let backend = match Backend::open(&DiskSpec::File(path), &options) {
        Ok(b) => Arc::new(b),
        Err(e) => {
            if trace() {
                eprintln!("open refused: {e}");
            }
            return;
        }
    };
    let size = backend.size();
    if trace() {
        eprintln!("opened: {size} bytes, cluster {}", header.cluster_size());
    }
    let mut engine = backend
        .engine(EngineKind::Sync, 8)
        .expect("a sync engine over an open image");
    for _ in 0..1 + input.below(MAX_REQUESTS as u64) {
        if input.is_empty() {
            break;
        }
        request(&mut *engine, &mut input, size);
    }
    drop(engine);
    drop(backend);
}

fn write_file(path: &PathBuf, bytes: &[u8]) {
    let mut f = File::create(path).expect("the fuzz scratch file");
    f.write_all(bytes).expect("writing the fuzz scratch file");
}

/// One request the input chooses, run to completion, with its checks.
fn request(engine: &mut dyn Engine, input: &mut Input<'_>, size: u64) {
    let sectors = size / 512;
    if sectors == 0 {
        return;
    }
    let start = input.below(sectors);
    let longest = if input.rare() { MAX_RARE_LEN } else { MAX_LEN };
    let max = (longest / 512).min(sectors - start);
    let len = 512 * (1 + input.below(max));
    let offset = start * 512;
    let kind = input.below(6);
    if trace() {
        eprintln!("request {kind} at {offset} len {len}");
    }
    match kind {
        0 => {
            let _ = read(engine, offset, len);
        }
        1 | 2 => {
            let fill = input.u8();
            let data = vec![fill; len as usize];
            let durable = kind == 2;
            if write(engine, offset, &data, durable).is_ok() {
                if let Ok(back) = read(engine, offset, len) {
                    assert!(
                        back == data,
                        "a write of {len} bytes at {offset} read back differently"
                    );
                }
            }
        }
        3 => {
            let unmap = input.u8() & 1 == 1;
            let op = Op::WriteZeroes {
                offset,
                len,
                unmap,
                durable: false,
            };
            if complete(engine, op).is_ok() {
                if let Ok(back) = read(engine, offset, len) {
                    assert!(
                        back.iter().all(|&b| b == 0),
                        "write-zeroes of {len} bytes at {offset} read back non-zero"
                    );
                }
            }
        }
        4 => {
            let _ = complete(
                engine,
                Op::Discard {
                    offset,
                    len,
                    durable: false,
                },
            );
        }
        _ => {
            let _ = complete(engine, Op::Flush);
        }
    }
}

/// Runs `op` to completion; its result.
fn complete(engine: &mut dyn Engine, op: Op) -> std::io::Result<u64> {
    // SAFETY: every buffer `op` names is owned by the caller, which keeps it until this
    // returns, and this returns only once the op is reaped.
    unsafe { engine.push(1, op) }.expect("an idle engine takes a request");
    engine.submit().expect("submitting to a sync engine");
    let mut out = None;
    while out.is_none() {
        engine.reap(&mut |c| out = Some(c.result));
        if out.is_none() {
            engine.wait().expect("waiting for a request");
        }
    }
    let r = out.unwrap_or(Ok(0));
    if trace() {
        eprintln!("  -> {r:?}");
    }
    r
}

fn read(engine: &mut dyn Engine, offset: u64, len: u64) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0xa5u8; len as usize];
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let n = complete(
        engine,
        Op::Read {
            offset,
            iov: &iov,
            iovcnt: 1,
        },
    )?;
    assert_eq!(n, len, "a read of {len} bytes at {offset} moved {n}");
    Ok(buf)
}

fn write(engine: &mut dyn Engine, offset: u64, data: &[u8], durable: bool) -> std::io::Result<()> {
    let iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    };
    let n = complete(
        engine,
        Op::Write {
            offset,
            iov: &iov,
            iovcnt: 1,
            durable,
        },
    )?;
    let len = data.len() as u64;
    assert_eq!(n, len, "a write of {len} bytes at {offset} moved {n}");
    Ok(())
}
