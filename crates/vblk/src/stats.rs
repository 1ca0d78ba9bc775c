//! `vblk stats`: read a running `vblk serve`'s statistics from its control socket.

use std::error::Error;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use serde_json::{json, Value};

/// Show a running `vblk serve`'s statistics (it must run with `--control-socket PATH`).
///
/// Without `--interval`: for each disk (or the one `--disk` names), counters since the
/// disk was added, per queue — requests and
/// MiB by type, average completion latency, requests in flight, malformed (rejected) and
/// failed requests — then completion-latency percentiles (fio's clat, in µs), the disk's
/// QoS (its limits, its throttle group, how many requests waited for them and how long),
/// each throttle group's limits, disks and waits (and the share of the group a disk gave
/// up: group time it was behind beyond 2 ms when it came back from having nothing
/// waiting), and each worker thread's polling hits and misses.
///
/// With `--interval SECS`: one line per active queue of each disk every SECS seconds, with the rates
/// of that interval in `iostat -x`'s names and units: r/s, rkB/s, r_await (ms), w/s,
/// wkB/s, w_await, f/s (flushes), d/s (discards and write-zeroes), aqu-sz (requests in
/// flight at the end of the interval).
///
/// Examples:
///
///   vblk serve --socket-path /run/vm1.sock --blk-file disk.img --control-socket /run/vm1.stats
///   vblk stats /run/vm1.stats
///   vblk stats /run/vm1.stats --interval 1 --count 10
///   vblk stats /run/vm1.stats --json
#[derive(Debug, Args)]
#[command(verbatim_doc_comment)]
pub struct StatsArgs {
    /// The daemon's control socket (`vblk serve --control-socket PATH`).
    #[arg(value_name = "PATH")]
    pub socket: PathBuf,

    /// Only this disk (its id: `vblk disk list`).
    #[arg(long, value_name = "ID")]
    pub disk: Option<String>,

    /// Print the daemon's JSON snapshot as it is.
    #[arg(long, conflicts_with = "interval")]
    pub json: bool,

    /// Print rates every SECS seconds (like `iostat -x SECS`).
    #[arg(long, value_name = "SECS")]
    pub interval: Option<f64>,

    /// With --interval: stop after N reports [default: until interrupted].
    #[arg(long, value_name = "N", requires = "interval")]
    pub count: Option<u64>,
}

/// One snapshot from the daemon (of disk `id` only, if given).
fn fetch(path: &Path, id: Option<&str>) -> Result<Value, Box<dyn Error>> {
    let mut body = json!({"op": "stats"});
    if let Some(id) = id {
        body["id"] = json!(id);
    }
    let v = crate::disk::request(path, &body, &[], Duration::from_secs(5))?;
    if v["vblk_stats"] != 1 {
        return Err(format!("{}: not a vblk statistics socket", path.display()).into());
    }
    Ok(v)
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// The latency percentile `p` (0..1) of a log2-ns histogram, in µs (upper bound of its
/// bucket, as a histogram can tell no better).
fn percentile(lat: &Value, p: f64) -> Option<f64> {
    let buckets: Vec<u64> = lat["log2_ns"].as_array()?.iter().map(u).collect();
    let total: u64 = buckets.iter().sum();
    if total == 0 {
        return None;
    }
    let want = ((total as f64) * p).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (i, n) in buckets.iter().enumerate() {
        seen += n;
        if seen >= want {
            return Some((1u64 << (i + 1)) as f64 / 1000.0);
        }
    }
    None
}

fn op<'a>(q: &'a Value, name: &str) -> &'a Value {
    &q["ops"][name]
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Average latency of an op in µs.
fn avg_us(o: &Value) -> f64 {
    let n = u(&o["ios"]);
    if n == 0 {
        return 0.0;
    }
    u(&o["lat"]["sum_ns"]) as f64 / n as f64 / 1000.0
}

/// The disks of a snapshot: every entry of `disks`, or the document itself (a daemon
/// from before several disks).
fn disks(v: &Value) -> Vec<Value> {
    match v["disks"].as_array() {
        Some(d) => d.clone(),
        None => vec![v.clone()],
    }
}

fn print_snapshot(v: &Value) {
    let all = disks(v);
    for (i, d) in all.iter().enumerate() {
        if i > 0 {
            outln!();
        }
        // Each disk's own uptime (since it was added); a daemon from before several
        // disks has only its own.
        let up = d.get("uptime_ns").unwrap_or(&v["uptime_ns"]);
        print_disk(d, u(up));
    }
    print_groups(v);
    print_workers(v);
}

/// QoS limits as QEMU writes them (`iops-total=2000,bps-read=104857600`), or "none".
fn limits_text(limits: &Value) -> String {
    let items: Vec<String> = limits
        .as_object()
        .map(|m| m.iter().map(|(k, v)| format!("{k}={v}")).collect())
        .unwrap_or_default();
    if items.is_empty() {
        "none".into()
    } else {
        items.join(",")
    }
}

/// How many requests waited for QoS limits (the disk's or its group's) and for how long:
/// "N requests waited, M ms on average".
fn waited_text(t: &Value) -> String {
    let (n, ns) = (u(&t["delayed"]), u(&t["wait_ns"]));
    let avg = if n > 0 {
        ns as f64 / n as f64 / 1e6
    } else {
        0.0
    };
    format!("{n} requests waited, {avg:.2} ms on average")
}

/// A disk's QoS: its limits, its group, what waiting they caused.
fn print_throttle(t: &Value) {
    if t.is_null() {
        return;
    }
    let limits = limits_text(&t["limits"]);
    let group = t["group"].as_str();
    if limits == "none" && group.is_none() {
        return;
    }
    outln!(
        "QoS: limits {limits}{}; {} (for these limits or the group's)",
        group
            .map(|g| format!(", throttle group {g}"))
            .unwrap_or_default(),
        waited_text(t)
    );
}

fn print_groups(v: &Value) {
    for g in v["throttle_groups"].as_array().cloned().unwrap_or_default() {
        let members: Vec<&str> = g["members"]
            .as_array()
            .map(|m| m.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        // Members that gave up group time by coming back too far behind (idle, or
        // slower than their share): "; given up while idle: a 12.5 ms".
        let forfeited: Vec<String> = g["forfeited_ns"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter(|(_, ns)| u(ns) > 0)
                    .map(|(id, ns)| format!("{id} {:.1} ms", u(ns) as f64 / 1e6))
                    .collect()
            })
            .unwrap_or_default();
        outln!(
            "throttle group {}: limits {}, disks {}; of their requests {}{}",
            g["name"].as_str().unwrap_or("?"),
            limits_text(&g["limits"]),
            if members.is_empty() {
                "none".to_string()
            } else {
                members.join(" ")
            },
            waited_text(&g),
            if forfeited.is_empty() {
                String::new()
            } else {
                format!(
                    "; share given up while idle beyond 2 ms behind: {}",
                    forfeited.join(", ")
                )
            }
        );
    }
}

fn print_workers(v: &Value) {
    for w in v["workers"].as_array().cloned().unwrap_or_default() {
        outln!(
            "worker {}: polling found work {} times, ran out {} times; slept {} times; a sleep costs {:.1} µs of CPU, polling window {:.1} µs{}",
            u(&w["worker"]),
            u(&w["poll_hits"]),
            u(&w["poll_misses"]),
            u(&w["sleeps"]),
            u(&w["sleep_cost_ns"]) as f64 / 1e3,
            u(&w["poll_window_ns"]) as f64 / 1e3,
            match w["poll_regime"].as_str() {
                Some("poll") => {
                    "; polling kept on at the window's bound (the last trial found it paid)"
                }
                // A measured sleep: the default mode chose it (`--poll-us 0` never measures).
                Some("lean") if u(&w["sleep_cost_ns"]) > 0 => {
                    "; only a grace of a few µs (polling cost more CPU per request than it bought)"
                }
                Some("lean") => "; only a grace of a few µs",
                Some("coalesce") => {
                    "; coalescing: sleeps with kicks off for up to --coalesce-us (the last trial found it the cheapest per request, and no other regime made the guest enough faster to pay)"
                }
                _ => "",
            }
        );
        let coalesced = u(&w["coalesced_sleeps"]);
        if coalesced > 0 {
            outln!(
                "worker {}: {coalesced} of its sleeps left kicks off for up to --coalesce-us",
                u(&w["worker"])
            );
        }
    }
}

fn print_disk(v: &Value, uptime_ns: u64) {
    outln!(
        "vblk serve: {}{} ({}), up {:.1} s, {} queues offered",
        v["id"]
            .as_str()
            .map(|id| format!("disk {id}: "))
            .unwrap_or_default(),
        v["disk"].as_str().unwrap_or("?"),
        crate::disk::size_text(u(&v["capacity_bytes"])),
        uptime_ns as f64 / 1e9,
        u(&v["num_queues"])
    );
    if v["image"]["format"] == "qcow2" {
        let i = &v["image"];
        let chain: Vec<String> = i["backing"]
            .as_array()
            .map(|b| {
                b.iter()
                    .map(|l| {
                        format!(
                            "{} ({})",
                            l["path"].as_str().unwrap_or("?"),
                            l["format"].as_str().unwrap_or("?")
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let cluster = u(&i["cluster_size"]);
        let allocated = u(&i["clusters_allocated"]);
        outln!(
            "image: qcow2 version {}, clusters of {}, file {}, {}, backing chain: {}",
            u(&i["version"]),
            crate::disk::size_text(cluster),
            crate::disk::size_text(u(&i["file_size"])),
            if i["read_only"] == true {
                "read-only"
            } else {
                "writable"
            },
            if chain.is_empty() {
                "none".to_owned()
            } else {
                chain.join(" over ")
            }
        );
        outln!(
            "image since start: {allocated} clusters allocated ({:.1} MiB), mappings written back {} times, {} writes done on the metadata thread (copy-on-write, write-through); L2 cache of {} KiB, {} slices read from the file",
            (allocated * cluster) as f64 / (1u64 << 20) as f64,
            u(&i["writebacks"]),
            u(&i["owner_writes"]),
            u(&i["cache_bytes"]) / 1024,
            u(&i["l2_slices_read"]),
        );
    }
    let queues = v["queues"].as_array().cloned().unwrap_or_default();
    if queues.is_empty() {
        outln!("no requests yet");
    } else {
        outln!(
            "{:>5} {:>10} {:>9} {:>11} {:>10} {:>9} {:>11} {:>8} {:>8} {:>8} {:>9} {:>8} {:>7}",
            "queue",
            "reads",
            "read MiB",
            "r_avg(us)",
            "writes",
            "write MiB",
            "w_avg(us)",
            "flushes",
            "discards",
            "wzeroes",
            "in_flight",
            "rejected",
            "failed"
        );
        for q in &queues {
            let (r, w) = (op(q, "read"), op(q, "write"));
            outln!(
                "{:>5} {:>10} {:>9.1} {:>11.1} {:>10} {:>9.1} {:>11.1} {:>8} {:>8} {:>8} {:>9} {:>8} {:>7}",
                u(&q["queue"]),
                u(&r["ios"]),
                mib(u(&r["bytes"])),
                avg_us(r),
                u(&w["ios"]),
                mib(u(&w["bytes"])),
                avg_us(w),
                u(&op(q, "flush")["ios"]),
                u(&op(q, "discard")["ios"]),
                u(&op(q, "write_zeroes")["ios"]),
                u(&q["in_flight"]),
                u(&q["rejected"]),
                u(&q["failed"]),
            );
        }
        outln!("completion latency percentiles (usec, clat; upper bounds of log2 buckets):");
        for q in &queues {
            for name in ["read", "write", "flush"] {
                let lat = &op(q, name)["lat"];
                let ps: Vec<String> = [0.5, 0.9, 0.99, 0.999]
                    .iter()
                    .filter_map(|&p| percentile(lat, p).map(|x| format!("{:.0}", x.max(1.0))))
                    .collect();
                if ps.len() == 4 {
                    outln!(
                        "  queue {:>3} {:<6} p50 {:>8}  p90 {:>8}  p99 {:>8}  p99.9 {:>8}",
                        u(&q["queue"]),
                        name,
                        ps[0],
                        ps[1],
                        ps[2],
                        ps[3]
                    );
                }
            }
        }
    }
    let l = &v["lifecycle"];
    if !l.is_null() {
        outln!(
            "rings stopped {} times, {} waited for requests in flight (longest {:.1} ms), {} ran out of time",
            u(&l["stops"]),
            u(&l["drains"]),
            u(&l["drain_wait_ns_max"]) as f64 / 1e6,
            u(&l["drains_timed_out"]),
        );
        outln!(
            "reset fence: {} requests from before a reset still out; {} queues waited for them (longest {:.1} ms, {:.1} ms in all)",
            u(&l["old_requests"]),
            u(&l["fenced_starts"]),
            u(&l["fence_wait_ns_max"]) as f64 / 1e6,
            u(&l["fence_wait_ns_total"]) as f64 / 1e6,
        );
        if l["log_active"].as_bool() == Some(true) || u(&l["logged_pages"]) > 0 {
            outln!(
                "dirty logging (live migration): {}; {} page marks since start",
                if l["log_active"].as_bool() == Some(true) {
                    "on"
                } else {
                    "off"
                },
                u(&l["logged_pages"]),
            );
        }
        let (broken, w, lost, failed) = (
            u(&l["broken_sessions"]),
            u(&l["wedged_fds"]),
            u(&l["lost_workers"]),
            u(&l["failed_setups"]),
        );
        if broken + w + lost + failed > 0 {
            outln!(
                "sessions ended: {broken} broken by the frontend (a bad message, a deadline, guest memory truncated), {w} for a wedged descriptor, {lost} for a worker that did not answer; {failed} connections could not be set up"
            );
        }
    }
    print_throttle(&v["throttle"]);
}

/// One queue's counters, for differences.
fn counters(q: &Value) -> [u64; 10] {
    let (r, w, f) = (op(q, "read"), op(q, "write"), op(q, "flush"));
    let (d, z) = (op(q, "discard"), op(q, "write_zeroes"));
    [
        u(&r["ios"]),
        u(&r["bytes"]),
        u(&r["lat"]["sum_ns"]),
        u(&w["ios"]),
        u(&w["bytes"]),
        u(&w["lat"]["sum_ns"]),
        u(&f["ios"]),
        u(&d["ios"]) + u(&z["ios"]),
        u(&q["in_flight"]),
        u(&q["queue"]),
    ]
}

fn print_rates(prev: &Value, now: &Value, secs: f64) {
    let before = disks(prev);
    let after = disks(now);
    let many = after.len() > 1;
    outln!(
        "{}{:>5} {:>9} {:>9} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8} {:>7}",
        if many {
            format!("{:<16} ", "disk")
        } else {
            String::new()
        },
        "queue",
        "r/s",
        "rkB/s",
        "r_await",
        "w/s",
        "wkB/s",
        "w_await",
        "f/s",
        "d/s",
        "aqu-sz"
    );
    for d in &after {
        let id = d["id"].as_str().unwrap_or("");
        let p = before
            .iter()
            .find(|b| b["id"].as_str().unwrap_or("") == id)
            .cloned()
            .unwrap_or(Value::Null);
        let label = if many {
            format!("{id:<16} ")
        } else {
            String::new()
        };
        print_disk_rates(&label, &p, d, secs);
    }
}

fn print_disk_rates(label: &str, prev: &Value, now: &Value, secs: f64) {
    let find = |v: &Value, i: u64| {
        v["queues"]
            .as_array()
            .and_then(|qs| qs.iter().find(|q| u(&q["queue"]) == i).cloned())
    };
    for q in now["queues"].as_array().cloned().unwrap_or_default() {
        let c = counters(&q);
        let p = find(prev, c[9]).map_or([0; 10], |q| counters(&q));
        let d = |i: usize| c[i].saturating_sub(p[i]) as f64;
        let await_ms = |ios: f64, ns: f64| if ios > 0.0 { ns / ios / 1e6 } else { 0.0 };
        outln!(
            "{label}{:>5} {:>9.1} {:>9.1} {:>8.3} {:>9.1} {:>9.1} {:>8.3} {:>8.1} {:>8.1} {:>7}",
            c[9],
            d(0) / secs,
            d(1) / 1024.0 / secs,
            await_ms(d(0), d(2)),
            d(3) / secs,
            d(4) / 1024.0 / secs,
            await_ms(d(3), d(5)),
            d(6) / secs,
            d(7) / secs,
            c[8]
        );
    }
}

/// `vblk stats`.
pub fn run(args: StatsArgs) -> Result<(), Box<dyn Error>> {
    let id = args.disk.as_deref();
    let first = fetch(&args.socket, id)?;
    if args.json {
        outln!("{first}");
        return Ok(());
    }
    let Some(secs) = args.interval else {
        print_snapshot(&first);
        return Ok(());
    };
    if !(secs > 0.0 && secs <= 3600.0) {
        return Err(format!("--interval {secs}: must be between 0 and 3600 seconds").into());
    }
    let mut prev = first;
    let mut n = 0;
    while args.count.is_none_or(|c| n < c) {
        std::thread::sleep(Duration::from_secs_f64(secs));
        let now = fetch(&args.socket, id)?;
        let elapsed = (u(&now["uptime_ns"]).saturating_sub(u(&prev["uptime_ns"]))) as f64 / 1e9;
        print_rates(&prev, &now, elapsed.max(1e-9));
        prev = now;
        n += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_come_from_the_buckets() {
        let mut b = vec![0u64; 40];
        b[10] = 90; // 1.024-2.048 µs
        b[20] = 10; // ~1-2 ms
        let lat = serde_json::json!({ "log2_ns": b, "sum_ns": 0 });
        assert_eq!(percentile(&lat, 0.5), Some(2.048));
        assert_eq!(percentile(&lat, 0.9), Some(2.048));
        assert_eq!(percentile(&lat, 0.99), Some(2097.152));
        let empty = serde_json::json!({ "log2_ns": vec![0u64; 40], "sum_ns": 0 });
        assert_eq!(percentile(&empty, 0.5), None);
    }
}
