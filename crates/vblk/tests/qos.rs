//! QoS limits that hold, with the real binary: every limit kind, bursts, a group shared
//! fairly, limits changed while running (twice, and back to unlimited). Rates are
//! measured by `vblk bench` over a few seconds after a ramp (the bucket's initial tenth of
//! a second of credit goes in the ramp), or by the daemon's own counters where two jobs
//! run at once, and must be within 2 % of the limit: the limits are low enough for any
//! machine to reach them. One test at a time (`serial`): run together on a small machine
//! they would measure each other.

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::cli::{
    bench, config, disk_table, ok, rate_within_2pct, s, saturate, serial, stats, vblk, within_2pct,
};
use support::daemon::Daemon;
use support::util::{temp_dir, within};

const LIMIT: Duration = Duration::from_secs(300);

/// Every kind of limit holds to within 2 %: IOPS total, read and write, bytes total, read
/// and write, iops-size. Each disk has its own limit; they run at once.
#[test]
fn every_limit_kind_holds() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("qos-kinds");
        let ctl = dir.path().join("ctl.sock");
        // (limit, job rw, block size, the expected IOPS, or MiB/s for byte limits)
        let cases: [(&str, &str, &str, f64, bool); 7] = [
            ("iops-total = 2000", "randread", "4k", 2000.0, false),
            ("iops-read = 1500", "randread", "4k", 1500.0, false),
            ("iops-write = 1000", "randwrite", "4k", 1000.0, false),
            ("bps-total = \"16M\"", "randread", "64k", 16.0, true),
            ("bps-read = \"4M\"", "randread", "4k", 4.0, true),
            ("bps-write = \"8M\"", "randwrite", "128k", 8.0, true),
            // 16 KiB requests count as four: 250 of them a second.
            (
                "iops-total = 1000\niops-size = 4096",
                "randread",
                "16k",
                250.0,
                false,
            ),
        ];
        let socks: Vec<PathBuf> = (0..cases.len())
            .map(|i| dir.path().join(format!("k{i}.sock")))
            .collect();
        let tables: String = cases
            .iter()
            .zip(&socks)
            .map(|((limit, ..), sock)| disk_table(sock, &format!("[disk.throttle]\n{limit}")))
            .collect();
        let cfg = config(dir.path(), &ctl, &tables);
        let _d = Daemon::start_vblk(
            "vblk",
            &["--config", s(&cfg)],
            socks.last().unwrap(),
            &dir.path().join("vblk.log"),
        );
        let runs: Vec<_> = cases
            .iter()
            .zip(socks)
            .map(|(&(limit, rw, bs, want, bytes), sock)| {
                let measure = move || {
                    let args = saturate(rw, bs);
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    let (iops, mib, _) = bench(&sock, &args);
                    if bytes {
                        mib
                    } else {
                        iops
                    }
                };
                (limit, want, measure.clone(), std::thread::spawn(measure))
            })
            .collect();
        // All at once first; a disk under its limit is measured again alone.
        for (limit, want, measure, first) in runs {
            let mut first = Some(first.join().unwrap());
            rate_within_2pct(&limit.replace('\n', ","), want, || {
                first.take().unwrap_or_else(&measure)
            });
        }
        let st = stats(&ctl);
        assert!(
            st["disks"][0]["throttle"]["delayed"].as_u64().unwrap() > 0,
            "throttled requests are counted: {}",
            st["disks"][0]["throttle"]
        );
    });
}

/// A burst: `-max` for `-max-length` seconds' worth, then the base rate (QEMU's
/// semantics: iops 500, max 2000 for 2 s: the bucket holds 4000 requests, the burst rate
/// fills it in about 2.5 s, 7000 requests in the first 6 s), and then 500 a second.
#[test]
fn a_burst_delivers_its_credit_then_the_base_rate() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("qos-burst");
        let ctl = dir.path().join("ctl.sock");
        let sock = dir.path().join("b.sock");
        let cfg = config(
            dir.path(),
            &ctl,
            &disk_table(
                &sock,
                "throttle = { iops-total = 500, iops-total-max = 2000, iops-total-max-length = 2 }",
            ),
        );
        let _d = Daemon::start_vblk(
            "vblk",
            &["--config", s(&cfg)],
            &sock,
            &dir.path().join("vblk.log"),
        );
        let job = [
            "--rw=randread",
            "--bs=4k",
            "--iodepth=32",
            "--size=64m",
            "--runtime=6",
            "--time_based",
        ];
        let (_, _, ios) = bench(&sock, &job);
        within_2pct("requests in the first 6 s of a burst", ios as f64, 7000.0);
        let args = saturate("randread", "4k");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        rate_within_2pct("IOPS once the burst is spent", 500.0, || {
            bench(&sock, &args).0
        });
    });
}

/// Two saturating disks in a group of 3000 IOPS get 1500 each (± 5 %); alone, one gets
/// all 3000. The group's limit changes while they run.
#[test]
fn a_group_is_shared_fairly_and_changes_live() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("qos-group");
        let ctl = dir.path().join("ctl.sock");
        let (a, b) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
        let tables =
            disk_table(&a, "group = \"g\"") + &disk_table(&b, "throttle = { group = \"g\" }");
        let cfg = config(dir.path(), &ctl, &tables);
        let _d = Daemon::start_vblk(
            "vblk",
            &["--config", s(&cfg)],
            &b,
            &dir.path().join("vblk.log"),
        );
        // Both disks saturate for 8 s; the rates come from the daemon's own counters over
        // a window in which both are running (two processes never start at the same
        // instant, and a disk alone in the group rightly gets all of it).
        let pair_at = |depths: [&'static str; 2]| {
            let runs: Vec<_> = [a.clone(), b.clone()]
                .into_iter()
                .zip(depths)
                .map(|(sock, depth)| {
                    std::thread::spawn(move || {
                        // Sleeping on completions: two jobs spinning after every
                        // submission on a small machine keep each other off the CPU
                        // for milliseconds, and the QD1 one loses the group's time
                        // (bench/qos.sh, docs/design-notes.md).
                        let job = [
                            "--rw=randread",
                            "--bs=4k",
                            depth,
                            "--size=64m",
                            "--spin-us=0",
                        ];
                        let mut args = job.to_vec();
                        args.extend(["--runtime=8", "--time_based"]);
                        bench(&sock, &args).0
                    })
                })
                .collect();
            let completed = || {
                let st = stats(&ctl);
                let per_disk: Vec<u64> = (0..2)
                    .map(|i| {
                        st["disks"][i]["queues"].as_array().map_or(0, |q| {
                            q.iter().filter_map(|q| q["completed"].as_u64()).sum()
                        })
                    })
                    .collect();
                // The window is the daemon's own (its uptime in the same answer), not
                // when each `vblk stats` process happened to return.
                let at = Duration::from_nanos(st["uptime_ns"].as_u64().unwrap_or(0));
                (per_disk[0], per_disk[1], at)
            };
            // Wait until both are being served, then let them settle for a second.
            let deadline = Instant::now() + Duration::from_secs(5);
            let first = completed();
            loop {
                std::thread::sleep(Duration::from_millis(50));
                let now = completed();
                if now.0 > first.0 && now.1 > first.1 {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the two jobs did not both start within 5 s"
                );
            }
            std::thread::sleep(Duration::from_secs(1));
            let s0 = completed();
            std::thread::sleep(Duration::from_secs(3));
            let s1 = completed();
            let secs = (s1.2 - s0.2).as_secs_f64();
            let rates = ((s1.0 - s0.0) as f64 / secs, (s1.1 - s0.1) as f64 / secs);
            for t in runs {
                t.join().unwrap();
            }
            rates
        };
        let pair = || pair_at(["--iodepth=16", "--iodepth=16"]);
        // Each rate here is tried up to three times, as `rate_within_2pct` does, for the
        // same reason: a stall of the host moves one window, not every one.
        let pair_within = |want: [f64; 2], slack: [f64; 2], what: &str| {
            let mut seen = Vec::new();
            let held = (0..3).any(|_| {
                let (x, y) = pair();
                seen.push(format!("{x:.0} + {y:.0}"));
                let total = want[0] + want[1];
                (x + y - total).abs() <= total * 0.02
                    && (x - want[0]).abs() <= slack[0]
                    && (y - want[1]).abs() <= slack[1]
            });
            assert!(
                held,
                "{what}: a + b IOPS in three tries {seen:?}, want {} ± {} + {} ± {} \
                 (the total within 2 %)",
                want[0], slack[0], want[1], slack[1]
            );
        };
        pair_within([1500.0, 1500.0], [75.0, 75.0], "a fair share of 3000 each");
        // A disk at QD1 beside one at QD32 gets its half too (it got 44 %: each of its
        // requests started it level with the other, forgiving what it was behind). Tried
        // up to three times, as the rates are: on a loaded machine the QD1 job may miss
        // its turns in one window (its next request must come within a slot, 333 µs).
        let mut seen = Vec::new();
        let fair = (0..3).any(|_| {
            let (x, y) = pair_at(["--iodepth=1", "--iodepth=32"]);
            seen.push(format!("{x:.0} + {y:.0}"));
            (x + y - 3000.0).abs() <= 60.0
                && (x - 1500.0).abs() <= 75.0
                && (y - 1500.0).abs() <= 75.0
        });
        assert!(
            fair,
            "QD1 (a) beside QD32 (b) in a group of 3000, not 1500 each: {seen:?}"
        );
        let args = saturate("randread", "4k");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        rate_within_2pct("one disk alone in the group", 3000.0, || bench(&a, &args).0);
        // Then b alone: it comes back with nobody waiting, and starts two quanta behind a,
        // not the seconds a ran alone behind (a would have waited those out next); what
        // it gave up is counted, and said.
        let given_up = |st: &Value| u64_of(&st["throttle_groups"][0]["forfeited_ns"]["b"]);
        let before = given_up(&stats(&ctl));
        bench(
            &b,
            &[
                "--rw=randread",
                "--bs=4k",
                "--iodepth=1",
                "--size=64m",
                "--runtime=1",
            ],
        );
        let st = stats(&ctl);
        assert!(
            given_up(&st) > before + 1_000_000_000,
            "b gave up the seconds a ran alone: {}",
            st["throttle_groups"][0]
        );
        let text = ok(&["stats", s(&ctl)]);
        assert!(
            text.contains("; share given up while idle beyond 2 ms behind: "),
            "{text}"
        );
        ok(&["disk", "group", s(&ctl), "g", "iops-total=1000"]);
        rate_within_2pct("the group's total after a change", 1000.0, || {
            let (x, y) = pair();
            x + y
        });
        // A member held to less by its own limit leaves the rest of the group's to the
        // other (it held both to its own pace).
        ok(&["disk", "set", s(&ctl), "a", "iops-total=300,group=g"]);
        pair_within(
            [300.0, 700.0],
            [6.0, 35.0],
            "a capped at 300 in a group of 1000, b taking the 700 it leaves",
        );
        ok(&["disk", "set", s(&ctl), "a", "throttle=none,group=g"]);
        let st = stats(&ctl);
        let g = &st["throttle_groups"][0];
        assert_eq!(g["name"], "g");
        assert_eq!(g["limits"]["iops-total"], 1000);
        assert_eq!(g["members"].as_array().unwrap().len(), 2);
        assert!(
            u64_of(&g["delayed"]) > 0,
            "the group's waits are counted: {g}"
        );
        // The same in words: each disk's group and waits, the group's limits and members.
        let text = ok(&["stats", s(&ctl)]);
        assert!(
            text.contains("QoS: limits none, throttle group g; ")
                && text.contains("throttle group g: limits iops-total=1000, disks a b; "),
            "{text}"
        );
    });
}

fn u64_of(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// A disk's limits change while it runs: twice, then back to unlimited, then into a group
/// and out of it.
#[test]
fn limits_change_while_a_disk_runs() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("qos-set");
        let ctl = dir.path().join("ctl.sock");
        let sock = dir.path().join("s.sock");
        let cfg = config(
            dir.path(),
            &ctl,
            &disk_table(&sock, "throttle = { iops-total = 1000 }"),
        );
        let _d = Daemon::start_vblk(
            "vblk",
            &["--config", s(&cfg)],
            &sock,
            &dir.path().join("vblk.log"),
        );
        let args = saturate("randread", "4k");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let id = "s";
        rate_within_2pct("at first", 1000.0, || bench(&sock, &args).0);
        ok(&["disk", "set", s(&ctl), id, "throttle.iops-total=2000"]);
        rate_within_2pct("after a first change", 2000.0, || bench(&sock, &args).0);
        ok(&["disk", "set", s(&ctl), id, "bps-total=2M"]); // QEMU's bare name
        rate_within_2pct("after a second change (bytes)", 2.0, || {
            bench(&sock, &args).1
        });
        ok(&["disk", "set", s(&ctl), id, "throttle=none"]);
        let free = bench(&sock, &args).0;
        assert!(free > 20_000.0, "unlimited again, yet {free:.0} IOPS");
        ok(&["disk", "set", s(&ctl), id, "throttle.group=g"]);
        rate_within_2pct("in the group", 3000.0, || bench(&sock, &args).0);
        ok(&["disk", "set", s(&ctl), id, "group=none"]);
        assert!(bench(&sock, &args).0 > 20_000.0);
        let (bad, why) = vblk(&[
            "disk",
            "set",
            s(&ctl),
            id,
            "throttle.iops-total=1,throttle.iops-read=1",
        ]);
        assert!(
            !bad && why
                .contains("total values and read/write values cannot be used at the same time"),
            "{why}"
        );
        let (bad, why) = vblk(&["disk", "set", s(&ctl), id, "cache=none"]);
        assert!(!bad && why.contains("remove and add it"), "{why}");
    });
}
