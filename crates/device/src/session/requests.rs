//! The vhost-user requests, one method each (`messages` decodes them and calls these):
//! each checks what the frontend sent before it changes anything, and refuses what it
//! cannot take with a message that names it.

use std::fs::File;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use log::{debug, info, warn};
use proto::config::WRITEBACK_OFFSET;
use proto::wire::feature;

use super::{refuse, Answer, Session, Vring, ANSWER_TIMEOUT};
use crate::dirty_log::DirtyLog;
use crate::inflight::InflightRegion;
use crate::memory::{GuestMemory, RegionDesc};
use crate::ring::RingAddrs;
use crate::vring_fd::VringFd;
use crate::wire::BackendChannel;
use crate::worker::Command;

impl Session {
    pub(super) fn set_owner(&mut self) -> Answer<()> {
        if self.owner {
            return Err(refuse("SET_OWNER: the session already has an owner".into()));
        }
        self.owner = true;
        Ok(())
    }

    pub(super) fn reset_owner(&mut self) -> Answer<()> {
        for i in 0..self.vrings.len() {
            self.stop(i)?;
        }
        self.vrings.iter_mut().for_each(|v| *v = Vring::default());
        self.owner = false;
        self.features_set = false;
        self.inflight = None;
        self.log = None;
        self.log_fd = None;
        self.blk.acked.store(0, Ordering::Relaxed);
        self.update_logging()?;
        self.blk.acked.store(0, Ordering::Relaxed);
        Ok(())
    }

    pub(super) fn set_features(&mut self, features: u64) -> Answer<()> {
        let unknown = features & !self.blk.features;
        if unknown != 0 {
            return Err(refuse(format!(
                "SET_FEATURES {features:#x}: bits {unknown:#x} were not offered ({:#x})",
                self.blk.features
            )));
        }
        if self.vrings.iter().any(|v| v.started) && self.features_set {
            let old = self.blk.acked.load(Ordering::Relaxed);
            let ring_bits =
                feature::bit(feature::RING_EVENT_IDX) | feature::bit(feature::RING_INDIRECT_DESC);
            if (old ^ features) & ring_bits != 0 {
                return Err(refuse(format!(
                    "SET_FEATURES {features:#x}: ring features changed from {old:#x} while rings run"
                )));
            }
        }
        debug!("driver acked features {features:#x}");
        self.blk.acked.store(features, Ordering::Relaxed);
        self.features_set = true;
        self.update_logging()
    }

    /// SET_LOG_BASE: the dirty bitmap (LOG_SHMFD).
    pub(super) fn set_log_base(&mut self, file: File, size: u64, offset: u64) -> Answer<()> {
        let marked = self.lifecycle.logged_pages.clone();
        let log = DirtyLog::map(file, size, offset, &self.poison, marked)
            .map_err(|e| refuse(format!("SET_LOG_BASE: {e}")))?;
        info!(
            "dirty log: {} bytes, covering {} MiB of guest memory",
            log.len(),
            (log.len() as u64 * 8 * crate::dirty_log::LOG_PAGE) >> 20
        );
        // A new bitmap while logging (QEMU resizes it as memory grows): the workers move
        // to it now.
        self.log = Some(Arc::new(log));
        self.update_logging()
    }

    /// SET_LOG_FD: kept, unused (vhost-user frontends read the shared bitmap).
    pub(super) fn set_log_fd(&mut self, file: File) {
        self.log_fd = Some(file);
    }

    pub(super) fn set_mem_table(&mut self, regions: Vec<(RegionDesc, File)>) -> Answer<()> {
        let mem = GuestMemory::replaced(regions, &self.poison)
            .map_err(|e| refuse(format!("SET_MEM_TABLE: {e}")))?;
        info!("memory table: {} regions", mem.len());
        self.publish_memory(mem)
    }

    pub(super) fn set_vring_num(&mut self, index: u32, num: u32) -> Answer<()> {
        let max = self.blk.max_queue_size;
        let v = self.vring(index, "SET_VRING_NUM")?;
        if v.started {
            return Err(refuse(format!("SET_VRING_NUM: queue {index} is running")));
        }
        if num == 0 || !num.is_power_of_two() || num > u32::from(max) {
            return Err(refuse(format!(
                "SET_VRING_NUM: queue {index} size {num} must be a power of two between 1 and {max}"
            )));
        }
        v.size = Some(num as u16);
        Ok(())
    }

    /// SET_VRING_ADDR: the three parts' frontend addresses, and whether (and where) the
    /// used ring's writes are logged. On a running ring only the logging may change (QEMU
    /// sends the same addresses with the log flag when a migration starts or ends).
    pub(super) fn set_vring_addr(
        &mut self,
        index: u32,
        (desc, used, avail): (u64, u64, u64),
        log_used: Option<u64>,
    ) -> Answer<()> {
        let mem = self.mem.clone();
        let v = self.vring(index, "SET_VRING_ADDR")?;
        let gpa = |va: u64, part: &str| {
            mem.va_to_gpa(va).ok_or_else(|| {
                refuse(format!(
                    "SET_VRING_ADDR: queue {index}'s {part} at frontend address {va:#x} is in no memory region"
                ))
            })
        };
        let addrs = RingAddrs {
            desc: gpa(desc, "descriptor table")?,
            avail: gpa(avail, "available ring")?,
            used: gpa(used, "used ring")?,
        };
        if v.started {
            if v.addrs != Some(addrs) {
                return Err(refuse(format!(
                    "SET_VRING_ADDR: queue {index} is running and the addresses changed"
                )));
            }
            v.log_used = log_used;
            let queue = index as usize;
            // Answered once the worker logs there (QEMU waits for the reply before it
            // counts on the log).
            self.workers[queue % self.threads]
                .ask(ANSWER_TIMEOUT, |reply| Command::LogRing {
                    queue,
                    used_gpa: log_used,
                    reply,
                })
                .map_err(|e| self.lost(e))?;
            return Ok(());
        }
        v.addrs = Some(addrs);
        v.log_used = log_used;
        Ok(())
    }

    pub(super) fn set_vring_base(&mut self, index: u32, base: u32) -> Answer<()> {
        let v = self.vring(index, "SET_VRING_BASE")?;
        if v.started {
            return Err(refuse(format!("SET_VRING_BASE: queue {index} is running")));
        }
        let base = u16::try_from(base).map_err(|_| {
            refuse(format!(
                "SET_VRING_BASE: queue {index} base {base:#x} does not fit a split ring's 16-bit index"
            ))
        })?;
        v.base = base;
        Ok(())
    }

    /// GET_VRING_BASE: stop the ring; the next available index.
    pub(super) fn get_vring_base(&mut self, index: u32) -> Answer<u16> {
        self.vring(index, "GET_VRING_BASE")?;
        let next = self.stop(index as usize)?;
        self.maybe_hand_over();
        let v = &mut self.vrings[index as usize];
        v.kick = None;
        v.call = None;
        v.err = None;
        Ok(next)
    }

    pub(super) fn set_vring_kick(&mut self, index: u32, fd: Option<File>) -> Answer<()> {
        let v = self.vring(index, "SET_VRING_KICK")?;
        let Some(fd) = fd else {
            return Err(refuse(format!(
                "SET_VRING_KICK: queue {index} without a kick fd (polling mode) is not supported"
            )));
        };
        let fd = vring_fd(fd, "SET_VRING_KICK", index, "kick")?;
        let queue = index as usize;
        if v.started {
            self.worker(queue).send(Command::SetKick { queue, fd });
            return Ok(());
        }
        v.kick = Some(fd);
        let r = self.try_start(queue);
        if r.is_err() {
            self.vrings[queue].kick = None;
        }
        r
    }

    pub(super) fn set_vring_call(&mut self, index: u32, fd: Option<File>) -> Answer<()> {
        let v = self.vring(index, "SET_VRING_CALL")?;
        let fd = fd
            .map(|f| vring_fd(f, "SET_VRING_CALL", index, "call"))
            .transpose()?;
        let queue = index as usize;
        if v.started {
            self.worker(queue).send(Command::SetCall { queue, fd });
        } else {
            v.call = fd;
        }
        Ok(())
    }

    pub(super) fn set_vring_err(&mut self, index: u32, fd: Option<File>) -> Answer<()> {
        let v = self.vring(index, "SET_VRING_ERR")?;
        let fd = fd
            .map(|f| vring_fd(f, "SET_VRING_ERR", index, "error"))
            .transpose()?;
        let queue = index as usize;
        if v.started {
            self.worker(queue).send(Command::SetErr { queue, fd });
        } else {
            v.err = fd;
        }
        Ok(())
    }

    pub(super) fn set_protocol_features(&mut self, features: u64) -> Answer<()> {
        let offered = self.protocol_offered;
        if features & !offered != 0 {
            return Err(refuse(format!(
                "SET_PROTOCOL_FEATURES {features:#x}: bits {:#x} were not offered ({offered:#x})",
                features & !offered
            )));
        }
        self.acked_protocol = features;
        Ok(())
    }

    pub(super) fn set_vring_enable(&mut self, index: u32, enable: bool) -> Answer<()> {
        let v = self.vring(index, "SET_VRING_ENABLE")?;
        v.enabled = enable;
        if v.started {
            let queue = index as usize;
            self.worker(queue).send(Command::Enable {
                queue,
                enabled: enable,
            });
        }
        Ok(())
    }

    pub(super) fn get_config(&mut self, offset: u32, size: u32) -> Answer<Vec<u8>> {
        if offset == proto::config::HINT_OFFSET && size as usize <= proto::config::HINT_LEN {
            // vblk's hint block: past the virtio configuration space, read only by vblk's
            // driver (QEMU asks for offset 0 and the config's size).
            return Ok(self.blk.hints.to_bytes()[..size as usize].to_vec());
        }
        self.blk.config_space().read(offset, size).ok_or_else(|| {
            refuse(format!(
                "GET_CONFIG: offset {offset} size {size} is out of range"
            ))
        })
    }

    pub(super) fn set_config(&mut self, offset: u32, buf: &[u8]) -> Answer<()> {
        if offset as usize == WRITEBACK_OFFSET && buf.len() == 1 {
            if !self.blk.acked(feature::CONFIG_WCE) {
                warn!("driver wrote writeback without negotiating CONFIG_WCE; ignored");
                return Ok(());
            }
            let wb = buf[0] != 0;
            info!(
                "driver set the cache to {}",
                if wb { "writeback" } else { "writethrough" }
            );
            self.blk.writeback.store(wb, Ordering::Relaxed);
            // Kept with the image, for the daemon that serves it after a live migration
            // (QEMU does not tell it; storage::handoff).
            if !self.disk.remember_writeback(wb)
                && self.disk.holding() != storage::Holding::Unlocked
            {
                warn!("the guest's write-cache setting cannot be kept with this disk: a migration destination would not know it");
            }
            return Ok(());
        }
        Err(refuse(format!(
            "SET_CONFIG of {} bytes at offset {offset}: only the writeback byte (offset {WRITEBACK_OFFSET}) is writable",
            buf.len()
        )))
    }

    /// GET_INFLIGHT_FD: a new region for `num_queues` queues of up to `queue_size`.
    pub(super) fn get_inflight_fd(
        &mut self,
        num_queues: u16,
        queue_size: u16,
    ) -> Answer<Arc<InflightRegion>> {
        let max = self.blk.max_queue_size;
        if num_queues == 0 || usize::from(num_queues) > self.vrings.len() {
            return Err(refuse(format!(
                "GET_INFLIGHT_FD: {num_queues} queues (the device has {})",
                self.vrings.len()
            )));
        }
        if queue_size == 0 || queue_size > max || !queue_size.is_power_of_two() {
            return Err(refuse(format!(
                "GET_INFLIGHT_FD: queue size {queue_size} must be a power of two between 1 and {max}"
            )));
        }
        let region = InflightRegion::create(num_queues, queue_size, &self.poison)
            .map_err(|e| refuse(format!("GET_INFLIGHT_FD: cannot make the region: {e}")))?;
        let region = Arc::new(region);
        self.inflight = Some(region.clone());
        Ok(region)
    }

    /// SET_INFLIGHT_FD: the region to use (ours from GET_INFLIGHT_FD, or an earlier
    /// device's the frontend kept across a restart).
    pub(super) fn set_inflight_fd(
        &mut self,
        file: File,
        mmap_offset: u64,
        mmap_size: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Answer<()> {
        if self.vrings.iter().any(|v| v.started) {
            return Err(refuse("SET_INFLIGHT_FD while rings run".into()));
        }
        if usize::from(num_queues) > self.vrings.len() || queue_size > self.blk.max_queue_size {
            return Err(refuse(format!(
                "SET_INFLIGHT_FD: {num_queues} queues of {queue_size} (the device has {} of up to {})",
                self.vrings.len(),
                self.blk.max_queue_size
            )));
        }
        let region = InflightRegion::open(
            file,
            mmap_offset,
            mmap_size,
            num_queues,
            queue_size,
            &self.poison,
        )
        .map_err(|e| refuse(format!("SET_INFLIGHT_FD: {e}")))?;
        debug!("inflight region: {num_queues} queues of {queue_size}, {mmap_size} bytes");
        self.inflight = Some(Arc::new(region));
        Ok(())
    }

    pub(super) fn set_backend_req_fd(&mut self, sock: UnixStream) {
        self.backend = Some(BackendChannel::new(sock));
    }

    pub(super) fn add_mem_region(&mut self, d: RegionDesc, fd: File) -> Answer<()> {
        let mem = self
            .mem
            .with_region(d, fd, &self.poison)
            .map_err(|e| refuse(format!("ADD_MEM_REG: {e}")))?;
        debug!("memory region added at {:#x} + {:#x}", d.gpa, d.size);
        self.publish_memory(mem)
    }

    pub(super) fn remove_mem_region(&mut self, d: RegionDesc) -> Answer<()> {
        let mem = self
            .mem
            .without_region(d.gpa, d.size)
            .map_err(|e| refuse(format!("REM_MEM_REG: {e}")))?;
        self.publish_memory(mem)
    }
}

/// A kick, call or error descriptor, or the refusal that names what it is instead.
fn vring_fd(f: File, msg: &str, index: u32, role: &str) -> Answer<VringFd> {
    VringFd::new(f, role).map_err(|e| refuse(format!("{msg}: queue {index}: {e}")))
}
