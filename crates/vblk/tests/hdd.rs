//! `vblk serve --blk-file hdd:SIZE:xN` end to end: the simulated hard disk behind the real
//! daemon, two workers sharing its one head, our driver writing and reading back through
//! both queues. (The model's arithmetic is tested in `storage/src/hdd/tests.rs`.)

mod support;

use std::time::Duration;

use driver::{Disk, DiskOptions};
use support::daemon::{Backend, Daemon, Export};
use support::util::{temp_dir, within};

#[test]
fn a_simulated_hard_disk_serves_data_through_two_workers() {
    within(Duration::from_secs(120), "the test", || {
        let dir = temp_dir("hdd");
        let socket = dir.path().join("vblk.sock");
        let d = Daemon::start(
            Backend::Vblk,
            "vblk",
            &Export::new("hdd:64M:x20", 2).args(&["--threads", "2"]),
            &socket,
            &dir.path().join("vblk.log"),
        );
        let disk = Disk::attach(
            &socket,
            &DiskOptions {
                num_queues: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(disk.info().capacity_bytes, 64 << 20);
        assert_eq!(disk.info().serial, "vblk-hdd");
        let queues: Vec<_> = (0..2).map(|i| disk.take_queue(i).unwrap()).collect();
        let handles: Vec<_> = queues
            .into_iter()
            .enumerate()
            .map(|(i, mut q)| {
                std::thread::spawn(move || {
                    // Far apart, so every request seeks: each queue its own half.
                    for k in 0..8u64 {
                        let at = (i as u64) * (32 << 20) + k * (3 << 20) + 4096 * i as u64;
                        let data = vec![(i as u8) * 16 + k as u8; 16384];
                        q.write_at(at, &data).unwrap();
                        let mut back = vec![0u8; 16384];
                        q.read_at(at, &mut back).unwrap();
                        assert!(back == data, "queue {i}, write {k}: read back differs");
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        drop(disk);
        assert!(d.warnings().is_empty(), "{:?}", d.warnings());
    });
}
