use std::time::Duration;

use super::*;

const IOMETER: &str = "\
[global]
description=Emulation of Intel IOmeter File Server Access Pattern
numjobs=2
timeout=60
[/dev/xvda]
bs=64K
rw=randrw
rwmixread=80
direct=1
size=4g
ioengine=libaio
iodepth=256
";

fn err(text: &str) -> String {
    parse_job_file(text).unwrap_err().to_string()
}

#[test]
fn iometer_file_parses_unchanged() {
    let jobs = parse_job_file(IOMETER).unwrap();
    assert_eq!(jobs.len(), 1);
    let j = &jobs[0];
    assert_eq!(j.name, "/dev/xvda");
    assert_eq!(
        j.description.as_deref(),
        Some("Emulation of Intel IOmeter File Server Access Pattern")
    );
    assert_eq!(j.numjobs, 2);
    assert_eq!(j.runtime, Some(Duration::from_secs(60)));
    assert_eq!(j.bs, 64 * 1024);
    assert!(j.bssplit.is_empty());
    assert_eq!(j.rw, RwMode::RandRw);
    assert_eq!(j.rwmixread, 80);
    assert_eq!(j.size, Some(Size::Bytes(4 << 30)));
    assert_eq!(j.iodepth, 256);
    assert_eq!(j.ignored, ["ioengine"]);
    assert_eq!(j.direct, Some(true));
    // Everything else is fio's default.
    let defaults = JobSpec::default();
    assert_eq!(j.offset, defaults.offset);
    assert!(!j.time_based && !j.norandommap);
    assert_eq!(j.iodepth_batch_submit, 1);
    assert_eq!(j.iodepth_batch_complete, 1);
    assert_eq!(j.verify, None);
    assert_eq!(j.path, None);
}

#[test]
fn defaults_match_fio() {
    let d = JobSpec::default();
    assert_eq!(d.name, "job");
    assert_eq!(d.rw, RwMode::Read);
    assert_eq!(d.bs, 4096);
    assert_eq!((d.iodepth, d.numjobs, d.rwmixread), (1, 1, 50));
    assert_eq!(d.size, None);
    assert_eq!(d.runtime, None);
    assert_eq!(d.ramp_time, Duration::ZERO);
}

#[test]
fn global_applies_to_later_sections_only() {
    let text = "\
[global]
bs=8k
[a]
rw=write
[global]
iodepth=4
bs=16k
[b]
[c]
bs=32k
";
    let jobs = parse_job_file(text).unwrap();
    let summary: Vec<_> = jobs
        .iter()
        .map(|j| (j.name.as_str(), j.bs, j.iodepth, j.rw))
        .collect();
    assert_eq!(
        summary,
        [
            ("a", 8192, 1, RwMode::Write),
            ("b", 16384, 4, RwMode::Read),
            ("c", 32768, 4, RwMode::Read),
        ]
    );
}

#[test]
fn comments_blank_lines_bare_keys_and_aliases() {
    let text = "\
; a comment
# another

[j]   ; trailing comment
readwrite=readwrite
blocksize = 1m
time_based
norandommap=1
rwmixwrite=30
runtime=2m
ramp_time=500ms
offset=1g
size=50%
iodepth=32
iodepth_batch=8
iodepth_batch_complete_min=4
verify=crc32c-intel
path=batch
name=renamed
group_reporting
group_reporting
";
    let j = &parse_job_file(text).unwrap()[0];
    assert_eq!(j.name, "renamed");
    assert_eq!(j.rw, RwMode::ReadWrite);
    assert_eq!(j.bs, 1 << 20);
    assert!(j.time_based);
    assert!(j.norandommap);
    assert_eq!(j.rwmixread, 70);
    assert_eq!(j.runtime, Some(Duration::from_secs(120)));
    assert_eq!(j.ramp_time, Duration::from_millis(500));
    assert_eq!(j.offset, 1 << 30);
    assert_eq!(j.size, Some(Size::Percent(50)));
    assert_eq!(
        (j.iodepth, j.iodepth_batch_submit, j.iodepth_batch_complete),
        (32, 8, 4)
    );
    assert_eq!(j.verify, Some(Verify::Crc32c));
    assert_eq!(j.path.as_deref(), Some("batch"));
    assert_eq!(j.ignored, ["group_reporting"]);
}

#[test]
fn finish_applies_fio_batch_fixups() {
    let text = "[a]\niodepth=8\niodepth_batch_submit=0\n[b]\niodepth=4\niodepth_batch=16\niodepth_batch_complete=9\n";
    let jobs = parse_job_file(text).unwrap();
    assert_eq!(jobs[0].iodepth_batch_submit, 8);
    assert_eq!(
        (jobs[1].iodepth_batch_submit, jobs[1].iodepth_batch_complete),
        (4, 4)
    );
}

#[test]
fn bad_files_name_the_line() {
    let cases = [
        (
            "bs=4k\n[j]\n",
            "line 1: 'bs=4k' is outside any section (start with [global] or [jobname])",
        ),
        (
            "[j]\n[unclosed\n",
            "line 2: malformed section header '[unclosed' (expected [name])",
        ),
        (
            "[j]\nbs=4k\n= 4k\n",
            "line 3: malformed line '= 4k' (expected key=value, a bare key or [section])",
        ),
        (
            "[global]\n\n[j]\nrw=randomread\n",
            "line 4: rw=randomread: unknown rw mode 'randomread' (expected read, write, \
             randread, randwrite, rw, readwrite or randrw)",
        ),
        (
            "[j]\nrw=trim\n",
            "line 2: rw=trim: rw mode 'trim' is not supported (vblk bench does not trim)",
        ),
        (
            "[j]\n; comment\nbs=12x\n",
            "line 3: bs=12x: bad size '12x': unknown unit 'x' (expected k, m, g, t or p, \
             optionally followed by b or ib)",
        ),
        (
            "[j]\nsize=\n",
            "line 2: size=: bad size '': expected a number",
        ),
        (
            "[j]\nbs=4k\nrate_min=10m\n",
            "line 3: rate_min=10m: option 'rate_min' is not supported (it would change the workload)",
        ),
        (
            "[j]\nloops=3\n",
            "line 2: loops=3: option 'loops' is not supported (it would change the workload)",
        ),
        (
            "[j]\nfrobnicate=1\n",
            "line 2: frobnicate=1: unknown option 'frobnicate'",
        ),
        (
            "[j]\nsize=${SIZE}\n",
            "line 2: size=${SIZE}: environment variables (${VAR}) are not supported",
        ),
        (
            "[j]\nverify=md5\n",
            "line 2: verify=md5: verify 'md5' is not supported (expected crc32c, \
             crc32c-intel, none or 0)",
        ),
        ("[j]\nbs\n", "line 2: bs: option 'bs' needs a value"),
        (
            "[j]\nbssplit=4k/60:8k/50\n",
            "line 2: bssplit=4k/60:8k/50: bssplit percentages add up to 110, more than 100",
        ),
        (
            "[j]\nrwmixread=101\n",
            "line 2: rwmixread=101: '101' is not a percentage 0..=100",
        ),
        (
            "[j]\niodepth=0\n",
            "line 2: iodepth=0: 0 is below the minimum 1",
        ),
        (
            "[j]\nbs=4k,8k\n",
            "line 2: bs=4k,8k: different read and write block sizes (4096 and 8192) are not \
             supported",
        ),
        (
            "[global]\nbs=4k\n",
            "line 2: no job sections (expected at least one [jobname])",
        ),
    ];
    for (text, want) in cases {
        assert_eq!(err(text), want, "for {text:?}");
    }
}

#[test]
fn error_carries_line_number() {
    let e = parse_job_file("[j]\n\n\n\nbs=1q\n").unwrap_err();
    assert_eq!(e.line, 5);
}

#[test]
fn rw_modes() {
    for (s, m, random, reads, writes) in [
        ("read", RwMode::Read, false, true, false),
        ("write", RwMode::Write, false, false, true),
        ("randread", RwMode::RandRead, true, true, false),
        ("randwrite", RwMode::RandWrite, true, false, true),
        ("rw", RwMode::ReadWrite, false, true, true),
        ("readwrite", RwMode::ReadWrite, false, true, true),
        ("randrw", RwMode::RandRw, true, true, true),
    ] {
        let got: RwMode = s.parse().unwrap();
        assert_eq!(got, m);
        assert_eq!(
            (got.is_random(), got.reads(), got.writes()),
            (random, reads, writes)
        );
        assert_eq!(got.fio_name().parse::<RwMode>().unwrap(), m);
    }
    for trim in ["trim", "randtrim", "trimwrite", "randtrimwrite"] {
        assert!(trim
            .parse::<RwMode>()
            .unwrap_err()
            .contains("not supported"));
    }
    let mut spec = JobSpec::default();
    assert_eq!(
        apply_option(&mut spec, "rw", Some("randread:8")).unwrap_err(),
        "rw modifier ':8' is not supported"
    );
}

#[test]
fn sizes() {
    for (s, want) in [
        ("0", 0),
        ("512", 512),
        ("4k", 4096),
        ("4K", 4096),
        ("4kb", 4096),
        ("4KiB", 4096),
        ("64K", 65536),
        ("1m", 1 << 20),
        ("4g", 4 << 30),
        ("2t", 2 << 40),
        ("1p", 1 << 50),
        ("0x1000", 4096),
        ("0x10k", 16 << 10),
        (" 8k ", 8192),
        ("100b", 100),
    ] {
        assert_eq!(parse_size(s), Ok(want), "{s}");
    }
    assert_eq!(
        parse_size("16384p").unwrap_err(),
        "bad size '16384p': does not fit in 64 bits"
    );
    assert!(parse_size("k").unwrap_err().contains("expected a number"));
    assert!(parse_size("-4k").is_err());
    assert!(parse_size("1.5g").is_err());
    assert!(parse_size("4kk").unwrap_err().contains("unknown unit 'kk'"));
}

#[test]
fn times() {
    for (s, want) in [
        ("60", Duration::from_secs(60)),
        ("60s", Duration::from_secs(60)),
        ("1500ms", Duration::from_millis(1500)),
        ("20us", Duration::from_micros(20)),
        ("2m", Duration::from_secs(120)),
        ("1h", Duration::from_secs(3600)),
        ("1d", Duration::from_secs(86400)),
    ] {
        assert_eq!(parse_time(s), Ok(want), "{s}");
    }
    assert!(parse_time("5y").unwrap_err().contains("unknown unit 'y'"));
    let mut spec = JobSpec::default();
    apply_option(&mut spec, "runtime", Some("0")).unwrap();
    assert_eq!(spec.runtime, None);
}

#[test]
fn bssplit_parsing_and_normalisation() {
    // fio's documentation example.
    assert_eq!(
        parse_bssplit("4k/10:64k/50:32k/40"),
        Ok(vec![(4096, 10), (32768, 40), (65536, 50)])
    );
    // Entries without a percent share what is left equally.
    assert_eq!(
        parse_bssplit("4k/50:8k/:16k"),
        Ok(vec![(4096, 50), (8192, 25), (16384, 25)])
    );
    // Rounding remainder of the equal share goes to the largest size.
    assert_eq!(
        parse_bssplit("4k:8k:16k"),
        Ok(vec![(4096, 33), (8192, 33), (16384, 34)])
    );
    // A single entry without a percent is 100%.
    assert_eq!(parse_bssplit("1m"), Ok(vec![(1 << 20, 100)]));
    // Explicit percents under 100: the rest goes to the largest size, like fio's selection.
    assert_eq!(
        parse_bssplit("4k/10:8k/20"),
        Ok(vec![(4096, 10), (8192, 90)])
    );
    // Duplicates merge, 0% entries drop.
    assert_eq!(
        parse_bssplit("8k/30:4k/0:8k/20:16k/50"),
        Ok(vec![(8192, 50), (16384, 50)])
    );
    // Explicit percents fill 100%: entries without one get 0 and drop.
    assert_eq!(parse_bssplit("4k/100:8k"), Ok(vec![(4096, 100)]));
    // Identical read and write lists are accepted, different ones are not.
    assert_eq!(
        parse_bssplit("4k/50:8k/50,8k/50:4k/50"),
        Ok(vec![(4096, 50), (8192, 50)])
    );
    assert!(parse_bssplit("4k/50:8k/50,4k").is_err());
    assert!(parse_bssplit("4k/150").is_err());
    assert!(parse_bssplit("4k/1.5")
        .unwrap_err()
        .contains("not an integer"));
    assert!(parse_bssplit("/50").is_err());
    assert!(parse_bssplit("0/50").is_err());
    assert!(parse_bssplit("").is_err());
}

#[test]
fn bs_read_write_parts() {
    let mut spec = JobSpec::default();
    apply_option(&mut spec, "bs", Some("8k,8k,4k")).unwrap();
    assert_eq!(spec.bs, 8192);
    // "bs=,4k": reads keep fio's default 4k, writes 4k: the same.
    apply_option(&mut spec, "bs", Some(",4k")).unwrap();
    assert_eq!(spec.bs, 4096);
    // "bs=8k,": writes keep the default, reads do not.
    assert!(apply_option(&mut spec, "bs", Some("8k,")).is_err());
}

#[test]
fn harmless_at_default_value_only() {
    let mut spec = JobSpec::default();
    for (k, v) in [
        ("loops", "1"),
        ("fsync", "0"),
        ("random_distribution", "random"),
        ("kb_base", "1024"),
    ] {
        apply_option(&mut spec, k, Some(v)).unwrap();
    }
    assert_eq!(
        spec.ignored,
        ["loops", "fsync", "random_distribution", "kb_base"]
    );
    for (k, v) in [
        ("fsync", Some("32")),
        ("random_distribution", Some("zipf:1.2")),
        ("kb_base", Some("1000")),
        ("zonemode", Some("zbd")),
        ("thinktime", Some("10")),
        ("io_size", Some("1g")),
    ] {
        let e = apply_option(&mut spec, k, v).unwrap_err();
        assert!(e.contains("not supported"), "{k}: {e}");
    }
}

#[test]
fn flags_take_integers() {
    let mut spec = JobSpec::default();
    apply_option(&mut spec, "time_based", Some("1")).unwrap();
    assert!(spec.time_based);
    apply_option(&mut spec, "time_based", Some("0")).unwrap();
    assert!(!spec.time_based);
    assert!(apply_option(&mut spec, "norandommap", Some("yes")).is_err());
}

#[test]
fn sizes_and_percentages() {
    let mut spec = JobSpec::default();
    apply_option(&mut spec, "size", Some("100%")).unwrap();
    assert_eq!(spec.size, Some(Size::Percent(100)));
    assert!(apply_option(&mut spec, "size", Some("0%")).is_err());
    assert!(apply_option(&mut spec, "size", Some("101%")).is_err());
    assert!(apply_option(&mut spec, "size", Some("0")).is_err());
    assert!(apply_option(&mut spec, "offset", Some("10%")).is_err());
    apply_option(&mut spec, "verify", Some("none")).unwrap();
    assert_eq!(spec.verify, None);
}

#[test]
fn block_sizes_lists_bssplit_or_bs() {
    let mut spec = JobSpec::default();
    assert_eq!(spec.block_sizes().collect::<Vec<_>>(), [4096]);
    apply_option(&mut spec, "bssplit", Some("4k/50:64k/50")).unwrap();
    assert_eq!(spec.block_sizes().collect::<Vec<_>>(), [4096, 65536]);
}
