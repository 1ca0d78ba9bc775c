//! Handing a writable qcow2 image between two daemons (a live migration over shared
//! storage; storage::handoff for raw images). Only one of them may write the image at a
//! time, and each keeps the image's metadata in memory, so the hand-over is also a hand-
//! over of that state:
//!
//! - **Letting go** (the source at the switchover): every changed mapping and refcount
//!   is written and made durable, the clusters counted ahead of use are given back (a
//!   clean close's order), and the owner refuses writes from then on; the workers'
//!   translation table is emptied and refilled without a cluster they may write in
//!   place. The caller then releases the file's write locks.
//! - **Taking over** (the destination before its rings start; or the source again, when
//!   the guest comes back to it): after the caller took the locks, the owner reads the
//!   header, the L1 table and the refcount table again and forgets every L2 slice it
//!   held, in its metadata cache and in the workers' translation table: the other daemon
//!   may have allocated, freed and grown the file since this one last looked.
//!
//! A migration destination opens its image inactive: it reads the header and the L1
//! table (to fail early on an image it could not serve) but loads no refcount and writes
//! nothing until it takes over. QEMU's block layer does the same for qcow2
//! (`BDRV_O_INACTIVE`, and `qcow2_co_invalidate_cache` at activation).

use std::io;

use super::fileio::FileIo;
use super::header::Header;
use super::image::prepare_writing;
use super::meta::{Meta, Source};
use super::owner::Owner;

impl Owner {
    /// Let go of the image: everything durable, nothing counted ahead, no more writes.
    pub(crate) fn deactivate(&mut self, src: &FileIo<'_>) -> io::Result<()> {
        if self.inactive || self.writer.is_none() {
            self.inactive = true;
            return Ok(());
        }
        self.writeback(src)?;
        self.release_reserved(src)?;
        src.sync()?;
        self.inactive = true;
        // No worker writes a cluster in place from now on: slices come back without
        // owned entries.
        self.table.clear();
        log::info!(
            "{}: handed over: every mapping and refcount is in the file, the clusters counted ahead given back",
            self.name
        );
        Ok(())
    }

    /// Take the image over: its metadata read again, every slice forgotten. The virtual
    /// size the header records now is returned: another program may have resized the
    /// image while this daemon held no lock on it (`qemu-img resize` while no frontend
    /// was attached); the disk takes that size, as a raw file's does.
    pub(crate) fn activate(&mut self, src: &FileIo<'_>) -> io::Result<u64> {
        if !self.inactive {
            return Ok(self.meta.header().size);
        }
        let fail = |why: String| io::Error::other(format!("taking the image over: {why}"));
        let file_size = src.size()?;
        let old = self.meta.header().clone();
        let mut head = vec![0u8; file_size.min(2 << 20) as usize];
        src.read_exact_at(&mut head, 0)?;
        let header = Header::parse(&head, file_size).map_err(|e| fail(e.to_string()))?;
        if header.cluster_bits != old.cluster_bits {
            // The workers' translation table is cut in slices of the old clusters.
            return Err(fail(format!(
                "its cluster size changed while another program wrote it (clusters of {}, now of {}): the image was made again; restart the daemon to serve it",
                old.cluster_size(),
                header.cluster_size()
            )));
        }
        if header.size != old.size {
            log::warn!(
                "{}: its virtual size changed while another program held it: {} bytes, now {}",
                self.name,
                old.size,
                header.size
            );
        }
        let loads = self.meta.loads;
        let mut meta = Meta::open(src, header.clone(), self.meta.capacity())
            .map_err(|e| fail(e.to_string()))?;
        meta.loads = loads;
        if let Some(w) = self.writer.as_mut() {
            let refs = prepare_writing(src, &header, file_size, meta.l2_tables()).map_err(fail)?;
            w.reset(refs);
        }
        self.meta = meta;
        self.table.clear();
        self.inactive = false;
        log::info!(
            "{}: taken over: metadata read again ({file_size} bytes of file)",
            self.name
        );
        Ok(self.meta.header().size)
    }
}
