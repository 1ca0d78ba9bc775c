//! The pages rendered from `vblk bench`'s JSON: BENCHMARKS.md (bench/render.py) and
//! docs/experiments.md (bench/experiments/render.py). Each test runs a short comparison,
//! sets the figures the page must judge, renders it and checks what it says against
//! figures recomputed here.

mod support;

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use support::bench::bench_json;
use support::util::temp_dir;

/// BENCHMARKS.md as bench/render.py writes it from the run directory `dir`.
fn render_benchmarks_md(dir: &Path) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/render.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(dir)
        .output()
        .expect("python3 is needed to render BENCHMARKS.md");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// BENCHMARKS.md is written by bench/render.py from the JSON `vblk bench` keeps: the figures
/// it prints are the JSON's (plain or gzipped), rows of repeated variants show their spread,
/// one run says so, and a goal whose table this run did not measure says that rather than a
/// figure.
#[test]
fn benchmarks_md_is_rendered_from_the_runs_json() {
    let dir = temp_dir("render");
    let json = |args: &[&str]| {
        let mut all = vec![
            "--rw=randread",
            "--bs=4k",
            "--iodepth=8",
            "--size=8m",
            "--runtime=300ms",
            "--time_based",
        ];
        all.extend_from_slice(args);
        bench_json(&all)
    };
    let tables = [
        (
            "paths-null-qd32",
            json(&[
                "--disk",
                "null:1G",
                "--compare",
                "path=bio,batch,passthru",
                "--repeat",
                "2",
            ]),
        ),
        (
            "baseline-mem-qd1",
            json(&["--compare", "target=embedded,baseline"]),
        ),
    ];
    let mut manifest = String::new();
    for (id, v) in &tables {
        std::fs::write(dir.path().join(format!("{id}.json")), v.to_string()).unwrap();
        manifest += &format!("{id}\ttitle of {id}\t0.10 0.20 0.30\tvblk bench {id} args\n");
    }
    // bench/all.sh gzips a run's JSON once the page is written: render.py reads either.
    let gz = Command::new("gzip")
        .arg("-9")
        .arg(dir.path().join("baseline-mem-qd1.json"))
        .status()
        .expect("gzip is needed to keep a run's JSON");
    assert!(gz.success());
    std::fs::write(dir.path().join("manifest.tsv"), manifest).unwrap();
    std::fs::write(
        dir.path().join("machine.txt"),
        "mode: quick (test)\ncommand: bash bench/all.sh quick\ncommit: abc1234\n",
    )
    .unwrap();
    // A full run's many-disk output: bench/sharing.sh's goals and bench/qos.sh's table.
    std::fs::create_dir(dir.path().join("sharing-json")).unwrap();
    std::fs::write(
        dir.path().join("sharing-json/goals.json"),
        serde_json::json!({
            "cpu_per_io_us": {"vblk-1x16": 4.5, "vblk-16x1": 5.0, "qsd-1x16": 9.0},
            "cpu_vs_16x1": 0.9,
            "cpu_vs_qsd": 0.5,
            "tail_vs_own": {"ratio": 1.25, "disk": 3, "shared_us": 25.0, "own_us": 20.0},
            "tail_vs_alone": null,
        })
        .to_string(),
    )
    .unwrap();
    // The same table driven by one client thread (`bench/sharing.sh ... thread`).
    std::fs::create_dir(dir.path().join("sharing-thread-json")).unwrap();
    std::fs::write(
        dir.path().join("sharing-thread-json/goals.json"),
        serde_json::json!({
            "cpu_per_io_us": {"vblk-1x16": 1.5, "vblk-16x1": 6.0, "qsd-1x16": 3.0},
            "cpu_vs_16x1": 0.25,
            "cpu_vs_qsd": 0.5,
            "tail_vs_own": {"ratio": 0.5, "disk": 7, "shared_us": 80.0, "own_us": 160.0},
            "tail_vs_alone": {"ratio": 2.5, "worst_us": 250.0, "alone_us": 100.0},
            "steal_pct": {"vblk-1x16": 0.5, "vblk-16x1": 12.25, "vblk-1x1": 0.0},
        })
        .to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("qos.txt"),
        "limit job configured measured unit error\n\
         iops-total=1000 randread 4k 1000 1005.0 IOPS     +0.50 %\n\
         bps-total=1M read 4k 1 0.975 MiB/s    -2.50 %\n",
    )
    .unwrap();
    let md = render_benchmarks_md(dir.path());
    assert!(md.contains("**paths-null-qd32: title of paths-null-qd32** (load average at its start: 0.10 0.20 0.30)"), "{md}");
    assert!(md.contains("vblk bench paths-null-qd32 args"), "{md}");
    // The bio row's IOPS: the JSON's mean, with its spread over the two runs.
    let bio = &tables[0].1[0]["variants"][0];
    assert_eq!(bio["variant"], "path=bio");
    let iops = bio["iops_mean"].as_f64().unwrap();
    let shown = if iops >= 1e6 {
        format!("{:.3} M", iops / 1e6)
    } else {
        format!("{:.3} k", iops / 1e3)
    };
    let row = md
        .lines()
        .find(|l| l.starts_with("| path=bio |"))
        .expect(&md);
    let cell = row.split('|').nth(2).unwrap().trim();
    let figure: f64 = cell.split_whitespace().next().unwrap().parse().unwrap();
    let expected: f64 = shown.split_whitespace().next().unwrap().parse().unwrap();
    assert!(
        (figure - expected).abs() / expected < 0.01 && cell.contains('±'),
        "{row} vs {iops}"
    );
    let one = md
        .lines()
        .find(|l| l.starts_with("| target=embedded |"))
        .expect(&md);
    assert!(one.contains("(1 run)") && !one.contains('±'), "{one}");
    // The headline: computed where this run has the table, "not measured" where not.
    let head = md
        .lines()
        .find(|l| l.starts_with("| null disk QD32 embedded: bio / batch / passthru"))
        .expect(&md);
    assert!(!head.contains("not measured"), "{head}");
    let head = md
        .lines()
        .find(|l| l.starts_with("| null disk QD32, `vblk serve` vs qsd"))
        .expect(&md);
    assert!(
        head.contains("not measured in this run (null-qd32)"),
        "{head}"
    );
    // Issue 21's rows, from the sharing goals and the QoS table.
    let row = |start: &str| {
        md.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no row {start:?} in {md}"))
            .to_string()
    };
    let jobs = "(16 jobs, a process each, on CPU 0)";
    let r = row(&format!(
        "| 16 disks at 5 k IOPS {jobs}: device µs CPU per I/O, one daemon vs 16 daemons"
    ));
    assert!(r.contains("4.50 vs 5.00 | 0.90× | ≤ 0.5× | **no**"), "{r}");
    let r = row(&format!(
        "| 16 disks {jobs}: device µs CPU per I/O, one daemon vs qsd"
    ));
    assert!(r.contains("0.50× | ≤ 1× | yes"), "{r}");
    let r = row(&format!(
        "| 16 disks {jobs}: p99 of the disk it grows most for"
    ));
    assert!(
        r.contains("disk 3: 25.0 vs 20.0 µs | 1.25× | ≤ 2× | yes"),
        "{r}"
    );
    // A figure the run could not measure says so.
    let r = row(&format!(
        "| 16 disks {jobs}: worst disk's p99 in one daemon vs one disk alone"
    ));
    assert!(
        r.contains("not measured in this run (bench/sharing.sh) | – | ≤ 2× | – |"),
        "{r}"
    );
    // The one-thread client's rows, each judged on its own figures.
    let one = "(one client thread drives all 16)";
    let r = row(&format!(
        "| 16 disks at 5 k IOPS {one}: device µs CPU per I/O, one daemon vs 16 daemons"
    ));
    assert!(r.contains("1.50 vs 6.00 | 0.25× | ≤ 0.5× | yes"), "{r}");
    let r = row(&format!(
        "| 16 disks {one}: p99 of the disk it grows most for"
    ));
    assert!(
        r.contains("disk 7: 80.0 vs 160.0 µs (host steal 0.5 % / 12.2 %) | 0.50× | ≤ 2× | yes"),
        "{r}"
    );
    let r = row(&format!(
        "| 16 disks {one}: worst disk's p99 in one daemon vs one disk alone"
    ));
    assert!(
        r.contains("250.0 vs 100.0 µs (host steal 0.5 % / 0.0 %) | 2.50× | ≤ 2× | **no**"),
        "{r}"
    );
    let r = row("| QoS: configured vs measured, 2 limits");
    assert!(
        r.contains("worst error 2.50 %") && r.ends_with("| **no** |"),
        "{r}"
    );
}

/// A comparison of four variants over three rounds, whose figures the render tests set.
fn four_variants_three_rounds() -> Value {
    bench_json(&[
        "--rw=randread",
        "--bs=4k",
        "--iodepth=8",
        "--size=8m",
        "--runtime=200ms",
        "--time_based",
        "--disk",
        "null:1G",
        "--compare",
        "path=bio,batch,request,passthru",
        "--repeat",
        "3",
    ])
}

/// `run` with its variants renamed to `names` (as `bench/devices.sh` labels sockets) and,
/// per variant, each round's IOPS and (if given) p99 in µs set (NaN: the round has none).
fn with_rounds(run: &Value, names: &[&str], iops: &[[f64; 3]], p99_us: &[[f64; 3]]) -> Value {
    let mut t = run.clone();
    let variants = t[0]["variants"].as_array_mut().unwrap();
    assert_eq!(variants.len(), names.len());
    for (i, v) in variants.iter_mut().enumerate() {
        v["variant"] = Value::from(format!("socket=/r/{}.sock@{}", names[i], 100 + i));
        let runs = v["runs"].as_array_mut().unwrap();
        assert_eq!(runs.len(), 3, "--repeat 3 keeps every run");
        for (k, r) in runs.iter_mut().enumerate() {
            r["vblk"]["iops"] = Value::from(iops[i][k]);
            if let Some(p) = p99_us.get(i) {
                let pct = &mut r["vblk"]["aggregate"]["read"]["clat_ns"]["percentile"];
                if p[k].is_nan() {
                    pct.as_object_mut().unwrap().remove("99.000000");
                } else {
                    pct["99.000000"] = Value::from(p[k] * 1000.0);
                }
            }
        }
        v["iops_mean"] = Value::from(iops[i].iter().sum::<f64>() / 3.0);
    }
    t
}

/// A results directory's `manifest.tsv` (one line per table) and `machine.txt`.
fn write_manifest(dir: &Path, ids: &[&str]) {
    let manifest: String = ids
        .iter()
        .map(|id| format!("{id}\ttitle of {id}\t0.10 0.20 0.30\tvblk bench {id} args\n"))
        .collect();
    std::fs::write(dir.join("manifest.tsv"), manifest).unwrap();
    std::fs::write(
        dir.join("machine.txt"),
        "mode: quick (test)\ncommand: bash bench/all.sh quick\ncommit: abc1234\n",
    )
    .unwrap();
}

/// The headline judges a row that compares vblk with a peer on paired per-round ratios:
/// against the peer with the most IOPS on average, the geometric mean of the rounds'
/// ratios and its 95 % interval (Student's t, 2 degrees of freedom for 3 rounds). A goal
/// is met when the interval lies at or above it, missed when it lies below, "within
/// noise" when it straddles it; a qcow2 row also needs vblk on the raw file within 0.9.
/// The rounds' IOPS are set here so that each verdict comes out, and each peer is the
/// faster once; the figures are recomputed from them.
#[test]
fn headline_rows_against_a_peer_are_judged_on_paired_ratios() {
    let dir = temp_dir("render-paired");
    let run = four_variants_three_rounds();
    // The JSON's own paired ratios: none for the first variant (the reference, as "-" in
    // the text table), and for the others a figure inside its interval, over 3 rounds.
    for (i, v) in run[0]["variants"].as_array().unwrap().iter().enumerate() {
        let p = &v["paired_ratio"];
        if i == 0 {
            assert!(p.is_null(), "the reference has no paired ratio: {p}");
            continue;
        }
        let (g, lo, hi) = (p["ratio"].as_f64(), p["low"].as_f64(), p["high"].as_f64());
        let (g, lo, hi) = (g.unwrap(), lo.unwrap(), hi.unwrap());
        assert!(lo <= g && g <= hi && g > 0.0, "variant {i}: {p}");
        assert_eq!(p["rounds"], 3);
    }
    let names = ["vblk-qcow2", "vblk-raw", "qsd-qcow2", "qsd-qcow2-iothread"];
    // Per table: each variant's IOPS in rounds 1-3, in the order of `names`.
    let cases: [(&str, [[f64; 3]; 4]); 4] = [
        // 1.10x in every round: met.
        (
            "qcow2-qd1",
            [
                [110.0, 99.0, 121.0],
                [110.0, 99.0, 121.0],
                [100.0, 90.0, 110.0],
                [99.0, 89.0, 109.0],
            ],
        ),
        // About 0.97x in every round: below 1.0 beyond the rounds' spread.
        (
            "qcow2-qd32",
            [
                [100.0, 90.0, 110.0],
                [100.0, 90.0, 110.0],
                [104.0, 93.0, 113.0],
                [103.0, 92.0, 112.0],
            ],
        ),
        // 0.96x, 1.03x, 0.99x: the rounds cannot tell.
        (
            "qcow2-write-qd32",
            [
                [100.0, 80.0, 120.0],
                [100.0, 80.0, 120.0],
                [104.0, 78.0, 121.0],
                [103.0, 77.0, 120.0],
            ],
        ),
        // About 1.09x the IOThread (the faster peer here), but 0.8x vblk on the raw file.
        (
            "qcow2-write-qd1",
            [
                [110.0, 99.0, 121.0],
                [137.5, 123.75, 151.25],
                [100.0, 90.0, 110.0],
                [101.0, 91.0, 111.0],
            ],
        ),
    ];
    for (id, iops) in &cases {
        let t = with_rounds(&run, &names, iops, &[]);
        std::fs::write(dir.path().join(format!("{id}.json")), t.to_string()).unwrap();
    }
    write_manifest(dir.path(), &cases.map(|c| c.0));
    let md = render_benchmarks_md(dir.path());
    for ((id, iops), verdict) in cases
        .iter()
        .zip(["yes", "**no**", "within noise", "**no**"])
    {
        // The peer: the one with the most IOPS on average.
        let mean = |k: usize| iops[k].iter().sum::<f64>();
        let peer = if mean(2) >= mean(3) { 2 } else { 3 };
        let logs: Vec<f64> = (0..3).map(|r| (iops[0][r] / iops[peer][r]).ln()).collect();
        let m = logs.iter().sum::<f64>() / 3.0;
        let sd = (logs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / 2.0).sqrt();
        let half = 4.303 * sd / 3f64.sqrt();
        let raw = (0..3)
            .map(|r| iops[0][r] / iops[1][r])
            .product::<f64>()
            .cbrt();
        let expected = format!(
            "{:.2}× (95 %: {:.2}-{:.2}, 3 rounds) vs {}; raw {raw:.2}",
            m.exp(),
            (m - half).exp(),
            (m + half).exp(),
            names[peer]
        );
        let qd = id.rsplit('-').next().unwrap().to_uppercase();
        let what = if id.contains("write") {
            "writes"
        } else {
            "reads"
        };
        let start = format!("| qcow2 (issue 22), fully allocated, O_DIRECT, {qd} {what}:");
        let row = md
            .lines()
            .find(|l| l.starts_with(&start))
            .unwrap_or_else(|| panic!("no row {start:?} in {md}"));
        assert!(row.contains(&expected), "{id}: {expected:?} not in {row}");
        assert!(row.ends_with(&format!("| {verdict} |")), "{id}: {row}");
    }
}

/// The O_DIRECT QD32 row's tail goal (vblk's p99 at most qsd's) is judged as its IOPS are:
/// on the rounds' paired p99 ratios, so a p99 whose mean is a little above qsd's but whose
/// rounds go both ways is "within noise", not a miss; one above in every round is a miss.
#[test]
fn file_qd32_row_judges_its_tail_on_paired_p99s() {
    let run = four_variants_three_rounds();
    let names = ["vblk", "vblk-poll0", "qsd-native", "qsd-io_uring"];
    // Per case: vblk's and the faster peer's (qsd-native) IOPS and p99 in µs over 3
    // rounds, and the verdict. The other peer is slower; vblk-poll0 plays no part.
    type Case = ([f64; 3], [f64; 3], [f64; 3], [f64; 3], &'static str);
    let cases: [Case; 6] = [
        // 1.10x the IOPS every round, a p99 at 0.9x every round: met.
        (
            [110.0, 99.0, 121.0],
            [100.0, 90.0, 110.0],
            [900.0, 810.0, 990.0],
            [1000.0, 900.0, 1100.0],
            "yes",
        ),
        // The same IOPS; the p99's mean is above qsd's (1150 vs 1000), its rounds go both
        // ways (1.5x, 0.8x, 1.15x): within noise (a miss when the means decided).
        (
            [110.0, 99.0, 121.0],
            [100.0, 90.0, 110.0],
            [1500.0, 800.0, 1150.0],
            [1000.0, 1000.0, 1000.0],
            "within noise",
        ),
        // The same IOPS, a p99 about 1.2x in every round: missed.
        (
            [110.0, 99.0, 121.0],
            [100.0, 90.0, 110.0],
            [1200.0, 1190.0, 1210.0],
            [1000.0, 1000.0, 1000.0],
            "**no**",
        ),
        // IOPS within noise (1.1x, 0.9x, 1.0x) and the same tail miss: missed.
        (
            [110.0, 81.0, 110.0],
            [100.0, 90.0, 110.0],
            [1200.0, 1190.0, 1210.0],
            [1000.0, 1000.0, 1000.0],
            "**no**",
        ),
        // qsd has no p99 in its second round: the rounds cannot be paired, the means of
        // the rounds that have one are compared (1200 vs 1000), and the tail misses.
        (
            [110.0, 99.0, 121.0],
            [100.0, 90.0, 110.0],
            [1200.0, 1200.0, 1200.0],
            [1000.0, f64::NAN, 1000.0],
            "**no**",
        ),
        // qsd's p99 is zero in every round (an empty histogram): nothing to compare the
        // tail with, so the goal is not met (a ratio of 0 must not read as a low tail).
        (
            [110.0, 99.0, 121.0],
            [100.0, 90.0, 110.0],
            [1200.0, 1200.0, 1200.0],
            [0.0, 0.0, 0.0],
            "**no**",
        ),
    ];
    for (k, (v_iops, q_iops, v_p99, q_p99, verdict)) in cases.iter().enumerate() {
        let dir = temp_dir("render-tail");
        let slow = [50.0; 3];
        let iops = [*v_iops, slow, *q_iops, slow];
        let p99 = [*v_p99, [5000.0; 3], *q_p99, [5000.0; 3]];
        let t = with_rounds(&run, &names, &iops, &p99);
        std::fs::write(dir.path().join("file-qd32.json"), t.to_string()).unwrap();
        write_manifest(dir.path(), &["file-qd32"]);
        let md = render_benchmarks_md(dir.path());
        let row = md
            .lines()
            .find(|l| l.starts_with("| O_DIRECT file QD32, `vblk serve` vs qsd's fastest mode"))
            .unwrap_or_else(|| panic!("no file-qd32 row in {md}"));
        // The paired p99 ratio, recomputed: geometric mean and Student-t interval (2 df);
        // with a round missing, the ratio of the means of the rounds that have one.
        let expected = if q_p99.iter().all(|&l| l == 0.0) {
            " µs (no tail to compare)".to_string()
        } else if q_p99.iter().any(|l| l.is_nan()) {
            let mean = |x: &[f64; 3]| {
                let have: Vec<f64> = x.iter().copied().filter(|l| !l.is_nan()).collect();
                have.iter().sum::<f64>() / have.len() as f64
            };
            format!(
                "paired {:.2}× (ratio of the means)",
                mean(v_p99) / mean(q_p99)
            )
        } else {
            let logs: Vec<f64> = (0..3).map(|r| (v_p99[r] / q_p99[r]).ln()).collect();
            let m = logs.iter().sum::<f64>() / 3.0;
            let sd = (logs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / 2.0).sqrt();
            let half = 4.303 * sd / 3f64.sqrt();
            format!(
                "paired {:.2}× (95 %: {:.2}-{:.2}, 3 rounds)",
                m.exp(),
                (m - half).exp(),
                (m + half).exp()
            )
        };
        assert!(row.contains("(qsd-native)"), "case {k}: {row}");
        assert!(
            row.contains(&expected),
            "case {k}: {expected:?} not in {row}"
        );
        assert!(row.ends_with(&format!("| {verdict} |")), "case {k}: {row}");
    }
}

/// docs/experiments.md is written by bench/experiments/render.py from a run's JSON and the
/// fixed text of bench/experiments/page.md: every marker filled, the comparisons computed
/// from the JSON (here S1's bio/request and S3's passthru/bio), a table the run did not
/// have said so.
#[test]
fn experiments_md_is_rendered_from_the_runs_json() {
    let dir = temp_dir("render-experiments");
    let json = |args: &[&str]| {
        let mut all = vec!["--bs=4k", "--size=8m", "--runtime=300ms", "--time_based"];
        all.extend_from_slice(args);
        bench_json(&all)
    };
    let tables = [
        (
            "s1-read",
            "S1 read 4 KiB QD32",
            json(&[
                "--name",
                "read",
                "--rw=read",
                "--iodepth=32",
                "--repeat",
                "2",
                "--compare",
                "path=request,elevator=deadline;path=bio;path=batch;path=auto",
            ]),
        ),
        (
            "s3-qd1",
            "S3 QD1",
            json(&[
                "--name",
                "qd1",
                "--rw=randread",
                "--iodepth=1",
                "--compare",
                "path=bio;path=passthru;path=auto",
            ]),
        ),
    ];
    let mut manifest = String::new();
    for (id, title, v) in &tables {
        std::fs::write(dir.path().join(format!("{id}.json")), v.to_string()).unwrap();
        manifest += &format!("{id}\t{title}\t0.10 0.20 0.30\tvblk bench {id} args\n");
    }
    std::fs::write(dir.path().join("manifest.tsv"), manifest).unwrap();
    std::fs::write(
        dir.path().join("machine.txt"),
        "mode: quick (test)\ncommand: bash bench/experiments/all.sh quick\ncommit: abc1234\n",
    )
    .unwrap();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../bench/experiments/render.py"
    );
    let out = Command::new("python3")
        .arg(script)
        .arg(dir.path())
        .output()
        .expect("python3 is needed to render docs/experiments.md");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let md = String::from_utf8(out.stdout).unwrap();
    assert!(!md.contains("{{"), "a marker left unfilled:\n{md}");
    assert!(md.contains("vblk bench s1-read args"), "{md}");
    assert!(md.contains("at abc1234"), "{md}");
    let iops = |doc: &Value, variant: &str| {
        doc[0]["variants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["variant"] == variant)
            .unwrap_or_else(|| panic!("no {variant}"))["iops_mean"]
            .as_f64()
            .unwrap()
    };
    let s1 = &tables[0].2;
    let bio_request = iops(s1, "path=bio") / iops(s1, "path=request,elevator=deadline");
    let row = md
        .lines()
        .find(|l| l.starts_with("| read | 1.28 |"))
        .expect(&md);
    assert!(
        row.contains(&format!("| {bio_request:.2} |")),
        "{row} vs {bio_request}"
    );
    let s3 = &tables[1].2;
    let passthru_bio = iops(s3, "path=passthru") / iops(s3, "path=bio");
    let head = md
        .lines()
        .find(|l| l.starts_with("| S3 qd1, passthru/bio | 1.12 |"))
        .expect(&md);
    assert!(
        head.ends_with(&format!("| {passthru_bio:.2} |")),
        "{head} vs {passthru_bio}"
    );
    assert!(
        md.contains("_Not in this run._"),
        "S2 and S5 were not run: {md}"
    );
}

/// The `auto` on `hdd:1G:norot` row pairs auto with the best other variant (the most IOPS
/// on average) round by round: a sequential table's variants move by up to a third from
/// run to run together with the threads' timing, and one run's ratio of two such figures
/// says little. Auto a steady 0.99x of the best in every round is met; a steady 0.90x in
/// one table fails the row; rounds that go both ways around 0.95 leave it within noise.
#[test]
fn norot_auto_row_is_judged_on_paired_ratios_to_the_best_variant() {
    let run = four_variants_three_rounds();
    let names = [
        "path=request",
        "path=request,queue_depth=2",
        "path=bio",
        "path=auto",
    ];
    // Per case: the IOPS of (request, request at depth 2, bio, auto) in rounds 1-3 of the
    // read table and of the write table, and the row's verdict.
    type Rounds = [[f64; 3]; 4];
    let steady: Rounds = [
        [3.1, 3.0, 3.2],
        [20.0, 14.0, 17.0],
        [3.1, 3.1, 3.0],
        [19.8, 13.86, 16.83],
    ];
    let low: Rounds = [
        [3.1, 3.0, 3.2],
        [20.0, 14.0, 17.0],
        [3.1, 3.1, 3.0],
        [18.0, 12.6, 15.3],
    ];
    let both_ways: Rounds = [
        [3.1, 3.0, 3.2],
        [20.0, 14.0, 17.0],
        [3.1, 3.1, 3.0],
        [21.0, 12.6, 16.0],
    ];
    let cases: [(&str, Rounds, Rounds, &str); 3] = [
        ("met", steady, steady, "| 0.99 | ≥ 0.95 | yes |"),
        ("one table low", steady, low, "| 0.90 | ≥ 0.95 | **no** |"),
        ("noise", steady, both_ways, "| ≥ 0.95 | within noise |"),
    ];
    for (case, read, write, verdict) in cases {
        let dir = temp_dir("render-norot");
        for (id, iops) in [("norot-read", read), ("norot-write", write)] {
            let mut t = with_rounds(&run, &names, &iops, &[]);
            for (v, name) in t[0]["variants"]
                .as_array_mut()
                .unwrap()
                .iter_mut()
                .zip(names)
            {
                v["variant"] = Value::from(name);
            }
            std::fs::write(dir.path().join(format!("{id}.json")), t.to_string()).unwrap();
        }
        write_manifest(dir.path(), &["norot-read", "norot-write"]);
        let md = render_benchmarks_md(dir.path());
        let row = md
            .lines()
            .find(|l| l.starts_with("| `auto` on `hdd:1G:norot`"))
            .unwrap_or_else(|| panic!("{case}: no auto row in {md}"));
        assert!(row.contains("paired by round"), "{case}: {row}");
        assert!(row.contains("read 0.99× (95 %: "), "{case}: {row}");
        assert!(
            row.ends_with(verdict),
            "{case}: {verdict:?} not at the end of {row}"
        );
    }
}
