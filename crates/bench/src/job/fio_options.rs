//! fio options that `vblk bench` does not implement: which are harmless (ignored) and which
//! would change the workload (an error).

/// What `apply_option` does with an option it does not implement.
pub(super) enum Other {
    /// Accepted and recorded in `ignored`.
    Ignore,
    /// Rejected: it would change the workload.
    Unsupported,
}

/// Options that `vblk bench` accepts and ignores whatever their value: engine, file, reporting,
/// scheduling and buffer-content choices that do not change which I/Os a job issues.
pub(super) fn harmless(key: &str) -> bool {
    matches!(
        key,
        "ioengine"
            | "filename"
            | "filename_format"
            | "directory"
            | "group_reporting"
            | "new_group"
            | "stonewall"
            | "wait_for_previous"
            | "thread"
            | "invalidate"
            | "randrepeat"
            | "randseed"
            | "random_generator"
            | "allrandrepeat"
            | "gtod_reduce"
            | "clocksource"
            | "disable_lat"
            | "disable_clat"
            | "disable_slat"
            | "disable_bw_measurement"
            | "lat_percentiles"
            | "clat_percentiles"
            | "slat_percentiles"
            | "percentile_list"
            | "significant_figures"
            | "unified_rw_reporting"
            | "write_bw_log"
            | "write_lat_log"
            | "write_iops_log"
            | "write_hist_log"
            | "log_avg_msec"
            | "log_hist_msec"
            | "per_job_logs"
            | "cpus_allowed"
            | "cpus_allowed_policy"
            | "cpumask"
            | "numa_cpu_nodes"
            | "numa_mem_policy"
            | "nice"
            | "prio"
            | "prioclass"
            | "ioscheduler"
            | "fadvise_hint"
            | "iomem"
            | "mem"
            | "iomem_align"
            | "mem_align"
            | "hugepage-size"
            | "zero_buffers"
            | "refill_buffers"
            | "scramble_buffers"
            | "buffer_pattern"
            | "buffer_compress_percentage"
            | "buffer_compress_chunk"
            | "dedupe_percentage"
            | "allow_file_create"
            | "allow_mounted_write"
            | "unlink"
            | "create_on_open"
            | "exitall"
            | "exitall_on_error"
            | "continue_on_error"
            | "unit_base"
            | "end_fsync"
            | "fsync_on_close"
            | "overwrite"
            | "userspace_reap"
            | "hipri"
            | "fixedbufs"
            | "registerfiles"
            | "sqthread_poll"
            | "sqthread_poll_cpu"
            | "iodepth_low"
            | "iodepth_batch_complete_max"
            | "verify_fatal"
            | "verify_dump"
            | "verify_async"
            | "serialize_overlap"
            | "lockfile"
            | "stats"
    )
}

/// Options fio has that would change the I/O a job issues, or when it issues it.
pub(super) fn changes_workload(key: &str) -> bool {
    matches!(
        key,
        "rate_min"
            | "rate_iops_min"
            | "rate_process"
            | "rate_cycle"
            | "rate_ignore_thinktime"
            | "thinktime"
            | "thinktime_spin"
            | "thinktime_blocks"
            | "zonemode"
            | "zonesize"
            | "zonerange"
            | "zoneskip"
            | "trim_percentage"
            | "trim_verify_zero"
            | "trim_backlog"
            | "offset_increment"
            | "offset_align"
            | "number_ios"
            | "io_size"
            | "io_limit"
            | "filesize"
            | "file_append"
            | "fill_device"
            | "fill_fs"
            | "write_barrier"
            | "bs_unaligned"
            | "bsrange"
            | "blocksize_range"
            | "bs_is_seq_rand"
            | "blockalign"
            | "ba"
            | "rw_sequencer"
            | "rwmixcycle"
            | "openfiles"
            | "file_service_type"
            | "startdelay"
            | "verify_interval"
            | "verify_offset"
            | "verify_pattern"
            | "verify_only"
            | "verify_backlog"
            | "verify_backlog_batch"
            | "verifysort"
            | "experimental_verify"
            | "exec_prerun"
            | "exec_postrun"
            | "flow"
            | "flow_id"
            | "flow_watermark"
            | "flow_sleep"
            | "steadystate"
            | "ss"
            | "steadystate_duration"
            | "ss_dur"
            | "steadystate_ramp_time"
            | "ss_ramp"
            | "pre_read"
            | "atomic"
            | "include"
    )
}

/// Options that are harmless at one value (their default) and change the workload at any other.
pub(super) fn harmless_at(key: &str, value: Option<&str>) -> Option<Other> {
    let harmless_values: &[&str] = match key {
        "loops" | "nrfiles" | "do_verify" => &["1"],
        "fsync" | "fdatasync" | "sync" => &["0", "none"],
        "random_distribution" => &["random"],
        "percentage_random" => &["100", "100,100"],
        "kb_base" => &["1024"],
        _ => return None,
    };
    Some(match value {
        Some(v) if harmless_values.contains(&v) => Other::Ignore,
        _ => Other::Unsupported,
    })
}
