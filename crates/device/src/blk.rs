//! The vhost-user-blk backend: what the device offers and how queues map to workers.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use proto::config::{BlkConfig, WRITEBACK_OFFSET};
use proto::wire::{feature, ID_BYTES, SECTOR_SHIFT};
use proto::Limits;
use storage::Backend;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::VhostUserBackend;
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::config::{DeviceConfig, MAX_DISCARD_SECTORS, SIZE_MAX};
use crate::worker::{clear_eventfd, AtomicMem, QueueShared, Shared, Vring, Worker};

/// How long GET_VRING_BASE waits for a queue's requests to finish before it gives up.
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// One vhost-user-blk device for one frontend connection.
pub struct BlkDevice {
    shared: Arc<Shared>,
    workers: Vec<Mutex<Worker>>,
    masks: Vec<u64>,
    features: u64,
    num_queues: usize,
    queue_size: u16,
    blk_size: u32,
    discard: bool,
    event_idx: AtomicBool,
}

impl BlkDevice {
    /// A device serving `disk` as `config` says, on guest memory `mem`.
    pub fn new(
        config: &DeviceConfig,
        disk: &Arc<Backend>,
        mem: GuestMemoryAtomic<vm_memory::GuestMemoryMmap<()>>,
    ) -> Result<BlkDevice, storage::Error> {
        let read_only = config.read_only || disk.read_only();
        let seg_max = u32::from(config.queue_size) - 2;
        let base_limits = Limits {
            capacity: disk.size() >> SECTOR_SHIFT,
            seg_max,
            size_max: SIZE_MAX,
            read_only,
            flush: false,
            discard: false,
            write_zeroes: false,
            max_discard_sectors: MAX_DISCARD_SECTORS,
            max_write_zeroes_sectors: MAX_DISCARD_SECTORS,
        };
        let mut serial = [0u8; ID_BYTES];
        let id = config
            .serial
            .clone()
            .unwrap_or_else(|| disk.default_serial());
        let n = id.len().min(ID_BYTES);
        serial[..n].copy_from_slice(&id.as_bytes()[..n]);
        let num_queues = usize::from(config.num_queues);
        let shared = Arc::new(Shared {
            base_limits,
            acked: AtomicU64::new(0),
            writeback: AtomicBool::new(true),
            serial,
            queues: (0..num_queues).map(|_| QueueShared::default()).collect(),
            mem,
        });
        let masks: Vec<u64> = (0..config.threads).map(|t| config.queue_mask(t)).collect();
        let mut workers = Vec::with_capacity(config.threads);
        for (t, &mask) in masks.iter().enumerate() {
            let owned: Vec<usize> = (0..num_queues).filter(|i| mask & (1 << i) != 0).collect();
            let depth = u32::from(config.queue_size) * owned.len() as u32;
            let engine = disk.engine(config.engine, depth)?;
            workers.push(Mutex::new(Worker::new(
                shared.clone(),
                engine,
                &owned,
                config.queue_size,
                config.poll_us,
                (!config.cpus.is_empty()).then(|| config.cpus[t % config.cpus.len()]),
                config.effective_submit_batch(),
            )));
        }
        let mut features = feature::bit(feature::VERSION_1)
            | feature::bit(feature::RING_EVENT_IDX)
            | feature::bit(feature::RING_INDIRECT_DESC)
            | feature::bit(feature::SEG_MAX)
            | feature::bit(feature::SIZE_MAX)
            | feature::bit(feature::BLK_SIZE)
            | feature::bit(feature::TOPOLOGY)
            | feature::bit(feature::FLUSH)
            | feature::bit(feature::CONFIG_WCE)
            | feature::bit(feature::MQ)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        let discard = !read_only && disk.supports_discard();
        if discard {
            features |= feature::bit(feature::DISCARD);
        }
        if !read_only && disk.supports_write_zeroes() {
            features |= feature::bit(feature::WRITE_ZEROES);
        }
        if read_only {
            features |= feature::bit(feature::RO);
        }
        Ok(BlkDevice {
            shared,
            workers,
            masks,
            features,
            num_queues,
            queue_size: config.queue_size,
            blk_size: disk.logical_block_size(),
            discard,
            event_idx: AtomicBool::new(false),
        })
    }

    /// The data value the worker `t`'s engine eventfd is registered with in its epoll set.
    pub fn wake_event(&self) -> u64 {
        self.num_queues as u64 + 1
    }

    /// Engine completion eventfds, one per worker that has one (worker index, fd).
    pub fn engine_fds(&self) -> Vec<(usize, std::os::fd::RawFd)> {
        self.workers
            .iter()
            .enumerate()
            .filter_map(|(t, w)| lock(w).notify_fd().map(|fd| (t, fd)))
            .collect()
    }

    /// The configuration space as it stands.
    pub fn config_space(&self) -> BlkConfig {
        let limits = self.shared.base_limits;
        let sectors_per_block = (self.blk_size >> SECTOR_SHIFT).max(1);
        BlkConfig {
            capacity: limits.capacity,
            size_max: limits.size_max,
            seg_max: limits.seg_max,
            blk_size: self.blk_size,
            physical_block_exp: 0,
            alignment_offset: 0,
            min_io_size: 1,
            opt_io_size: 0,
            writeback: u8::from(self.shared.writeback.load(Ordering::Relaxed)),
            num_queues: self.num_queues as u16,
            max_discard_sectors: limits.max_discard_sectors,
            max_discard_seg: 1,
            discard_sector_alignment: if self.discard { sectors_per_block } else { 0 },
            max_write_zeroes_sectors: limits.max_write_zeroes_sectors,
            max_write_zeroes_seg: 1,
            write_zeroes_may_unmap: 1,
        }
    }

    /// Counters of one queue: (completed, rejected).
    pub fn queue_counters(&self, queue: usize) -> Option<(u64, u64)> {
        self.shared.queues.get(queue).map(|q| {
            (
                q.completed.load(Ordering::Relaxed),
                q.rejected.load(Ordering::Relaxed),
            )
        })
    }

    /// Run worker `t` over its vrings once (for tests that drive the device without a
    /// frontend).
    #[cfg(test)]
    pub(crate) fn run_worker(&self, t: usize, vrings: &[Vring]) {
        lock(&self.workers[t]).run(vrings);
    }

    /// Whether a queue has been stopped as broken.
    pub fn queue_broken(&self, queue: usize) -> bool {
        self.shared
            .queues
            .get(queue)
            .is_some_and(|q| q.broken.load(Ordering::Acquire))
    }

    /// Acknowledge features without a frontend (tests).
    #[cfg(test)]
    pub(crate) fn ack(&self, features: u64) {
        self.shared.acked.store(features, Ordering::Relaxed);
    }

    /// Whether writes must be durable before they complete (tests).
    #[cfg(test)]
    pub(crate) fn write_through(&self) -> bool {
        self.shared.write_through()
    }
}

/// A poisoned worker lock means a worker panicked; the state is still usable (all
/// invariants are re-established per pass), so carry on rather than panic again.
fn lock(m: &Mutex<Worker>) -> MutexGuard<'_, Worker> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl VhostUserBackend for BlkDevice {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.num_queues
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.queue_size)
    }

    fn features(&self) -> u64 {
        self.features
    }

    fn acked_features(&self, features: u64) {
        debug!("driver acked features {features:#x}");
        self.shared
            .acked
            .store(features & self.features, Ordering::Relaxed);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        self.config_space().read(offset, size).unwrap_or_else(|| {
            warn!("GET_CONFIG offset {offset} size {size} is out of range");
            Vec::new()
        })
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        if offset as usize == WRITEBACK_OFFSET && buf.len() == 1 {
            let acked = self.shared.acked.load(Ordering::Relaxed);
            if acked & feature::bit(feature::CONFIG_WCE) == 0 {
                warn!("driver wrote writeback without negotiating CONFIG_WCE; ignored");
                return Ok(());
            }
            let wb = buf[0] != 0;
            info!(
                "driver set the cache to {}",
                if wb { "writeback" } else { "writethrough" }
            );
            self.shared.writeback.store(wb, Ordering::Relaxed);
            return Ok(());
        }
        warn!(
            "SET_CONFIG of {} bytes at offset {offset}: only the writeback byte (offset {WRITEBACK_OFFSET}) is writable",
            buf.len()
        );
        Err(io::Error::from_raw_os_error(libc::EINVAL))
    }

    fn update_memory(&self, _mem: AtomicMem) -> io::Result<()> {
        // vhost-user-backend updates the same GuestMemoryAtomic the workers load from.
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        self.masks.clone()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC).ok()
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        let Some(qs) = self.shared.queues.get(queue_index as usize) else {
            return Ok(());
        };
        let start = Instant::now();
        while qs.in_flight.load(Ordering::Acquire) > 0 {
            if start.elapsed() > STOP_TIMEOUT {
                warn!(
                    "queue {queue_index}: {} requests still in flight after {}s; stopping anyway",
                    qs.in_flight.load(Ordering::Acquire),
                    STOP_TIMEOUT.as_secs()
                );
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        if qs.broken.swap(false, Ordering::AcqRel) {
            info!("queue {queue_index}: reset by the driver, serving it again");
        }
        let t = self.masks.iter().position(|m| m & (1 << queue_index) != 0);
        if let Some(t) = t {
            lock(&self.workers[t]).reset_queue(queue_index as usize);
        }
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        let Some(worker) = self.workers.get(thread_id) else {
            return Ok(());
        };
        let mut worker = lock(worker);
        if u64::from(device_event) == self.wake_event() {
            if let Some(fd) = worker.notify_fd() {
                clear_eventfd(fd);
            }
        }
        worker.run(vrings);
        Ok(())
    }
}
