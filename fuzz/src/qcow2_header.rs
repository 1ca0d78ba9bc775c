//! The qcow2 header parser (`storage::qcow2::Header::parse`) over bytes the fuzzer
//! chooses: the first 8 bytes are the file's size, the rest its first bytes. The parser
//! must return an error or a header whose every table lies inside the file and whose
//! sizes are the ones QEMU allows, never panic (a panic is what libFuzzer reports).

use storage::qcow2::header::{self, Header};

pub fn run(data: &[u8]) {
    let (size, head) = match data.split_first_chunk::<8>() {
        Some((s, rest)) => (u64::from_le_bytes(*s), rest),
        None => return,
    };
    let Ok(h) = Header::parse(head, size) else {
        return;
    };
    let cluster = h.cluster_size();
    assert!((512..=2 << 20).contains(&cluster));
    let reftable_end = h.reftable_offset + u64::from(h.reftable_clusters) * cluster;
    assert!(h.reftable_clusters > 0 && reftable_end <= size);
    assert!(u64::from(h.reftable_clusters) * cluster <= header::MAX_REFTABLE_BYTES);
    assert!(h.l1_offset + u64::from(h.l1_entries) * 8 <= size);
    assert!(u64::from(h.l1_entries) * 8 <= header::MAX_L1_BYTES);
    assert!(h.size.div_ceil(h.l2_entries() * cluster) <= u64::from(h.l1_entries));
    assert!(h.refcount_order <= 6);
    if let Some(name) = &h.backing_name {
        assert!(name.len() <= header::MAX_BACKING_NAME as usize);
    }
    for &(_, at, len) in &h.other_extensions {
        assert!(at + u64::from(len) <= cluster);
    }
    let _ = h.check_writable();
}
