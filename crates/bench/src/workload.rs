//! What each I/O of a job is: direction, offset and length, drawn deterministically from a seed.
//!
//! * Sequential modes walk the region from its start and wrap when the next unit would cross its
//!   end; in `rw` (mixed sequential) reads and writes each have their own position, as fio keeps
//!   one per direction.
//! * Random modes without `norandommap` draw from a full-period permutation of the
//!   region's blocks, so a pass visits every block exactly once with no per-block memory; with
//!   `norandommap` every offset is drawn uniformly and independently.
//! * Block sizes are `bs`, or drawn from `bssplit` by weight; mixed modes read with probability
//!   `rwmixread`%.
//!
//! [`Generator::next`] does no heap allocation.

use crate::job::{JobSpec, RwMode};

/// The direction of one I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoDir {
    /// Read from the device.
    Read,
    /// Write to the device.
    Write,
}

/// One I/O of a job: absolute byte offset on the device and length in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoUnit {
    /// Read or write.
    pub dir: IoDir,
    /// Absolute byte offset on the device.
    pub offset: u64,
    /// Length in bytes, one of the job's block sizes.
    pub len: u64,
}

/// SplitMix64: small, fast, and good enough to drive a benchmark's choices.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`), without modulo bias (Lemire's multiply-and-reject).
    fn below(&mut self, n: u64) -> u64 {
        let mut m = u128::from(self.next_u64()) * u128::from(n);
        if (m as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(n);
            }
        }
        (m >> 64) as u64
    }
}

/// A full-period permutation of `0..n`, re-keyed every pass.
///
/// A counter walks `0..2^bits` (the smallest power of two `>= n`) through a keyed bijection on
/// `bits`-bit integers (xor, odd multiplications, additions and xor-shifts, each invertible
/// modulo `2^bits`); outputs `>= n` are skipped (cycle walking, fewer than one skip per output
/// on average). Every pass therefore yields each of `0..n` exactly once, in an order that
/// changes from pass to pass, from a few words of state.
#[derive(Clone, Debug)]
struct RandomMap {
    n: u64,
    mask: u64,
    shift: u32,
    keys: [u64; 4],
    counter: u64,
}

impl RandomMap {
    fn new(n: u64, rng: &mut Rng) -> RandomMap {
        let bits = match n {
            0 | 1 => 0,
            n => 64 - (n - 1).leading_zeros(),
        };
        let mask = if bits == 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        let mut map = RandomMap {
            n,
            mask,
            shift: bits.div_ceil(2).max(1),
            keys: [0; 4],
            counter: 0,
        };
        map.rekey(rng);
        map
    }

    fn rekey(&mut self, rng: &mut Rng) {
        for k in &mut self.keys {
            *k = rng.next_u64();
        }
        // The multipliers must be odd to be invertible modulo 2^bits.
        self.keys[1] |= 1;
        self.keys[3] |= 1;
        self.counter = 0;
    }

    fn permute(&self, x: u64) -> u64 {
        let (m, s, k) = (self.mask, self.shift, &self.keys);
        let mut x = (x ^ k[0]) & m;
        x = x.wrapping_mul(k[1]) & m;
        x ^= x >> s;
        x = x.wrapping_add(k[2]) & m;
        x = x.wrapping_mul(k[3]) & m;
        x ^= x >> s;
        x = x.wrapping_mul(0xD6E8_FEB8_6659_FD93) & m;
        x ^= x >> s;
        x
    }

    fn next(&mut self, rng: &mut Rng) -> u64 {
        loop {
            let x = self.permute(self.counter);
            if self.counter == self.mask {
                self.rekey(rng);
            } else {
                self.counter += 1;
            }
            if x < self.n {
                return x;
            }
        }
    }
}

/// Deterministic (seeded) generator of a job's I/O units over `[start, start + len)`.
///
/// Every offset is a multiple of `align`; random offsets are also a multiple of the unit's
/// block size counted from `start` (fio aligns random I/O to the block size; with `bssplit` fio
/// uses the smallest size, vblk the chosen one). No unit crosses `start + len`.
///
/// Without `norandommap` a pass is `len / min_block` units: each `min_block`-sized block of the
/// region is the target of exactly one unit per pass. With a single block size the units of a
/// pass are exactly those blocks; with `bssplit` a unit of size `b` is the `b`-aligned slot that
/// holds its target block (the last slot that fits, for a target in a tail no `b`-aligned slot
/// covers).
#[derive(Clone, Debug)]
pub struct Generator {
    rw: RwMode,
    start: u64,
    len: u64,
    rwmixread: u64,
    /// Block sizes, ascending, each with the cumulative weight up to and including it.
    sizes: Vec<(u64, u64)>,
    total_weight: u64,
    min_block: u64,
    max_block: u64,
    norandommap: bool,
    map: RandomMap,
    /// Next relative offset of sequential reads and writes.
    cursor: [u64; 2],
    rng: Rng,
}

impl Generator {
    /// A generator for `spec`'s pattern over `[start, start + len)`, every offset a multiple of
    /// `align` (the device's logical block size), seeded by `seed`.
    ///
    /// Errors: `align` 0, `start` or a block size not a multiple of `align`, `bssplit` weights
    /// summing to 0, `rwmixread` above 100, a region past 2^64, or `len` below the largest block
    /// size.
    pub fn new(
        spec: &JobSpec,
        start: u64,
        len: u64,
        align: u64,
        seed: u64,
    ) -> Result<Generator, String> {
        if align == 0 {
            return Err("alignment 0".to_string());
        }
        if !start.is_multiple_of(align) {
            return Err(format!(
                "region start {start} is not a multiple of the alignment {align}"
            ));
        }
        if start.checked_add(len).is_none() {
            return Err(format!("region {start} + {len} does not fit in 64 bits"));
        }
        if spec.rwmixread > 100 {
            return Err(format!("rwmixread {} is above 100", spec.rwmixread));
        }
        let mut weighted: Vec<(u64, u64)> = if spec.bssplit.is_empty() {
            vec![(spec.bs, 1)]
        } else {
            spec.bssplit
                .iter()
                .filter(|e| e.1 > 0)
                .map(|&(bs, perc)| (bs, u64::from(perc)))
                .collect()
        };
        if weighted.is_empty() {
            return Err("bssplit percentages sum to 0".to_string());
        }
        weighted.sort_by_key(|e| e.0);
        let mut sizes = Vec::with_capacity(weighted.len());
        let mut total_weight = 0;
        for (bs, weight) in weighted {
            if bs == 0 || !bs.is_multiple_of(align) {
                return Err(format!(
                    "block size {bs} is not a positive multiple of the alignment {align}"
                ));
            }
            total_weight += weight;
            sizes.push((bs, total_weight));
        }
        let min_block = sizes[0].0;
        let max_block = sizes[sizes.len() - 1].0;
        if len < max_block {
            return Err(format!(
                "region of {len} bytes is smaller than the largest block size {max_block}"
            ));
        }
        let mut rng = Rng(seed);
        let map = RandomMap::new(len / min_block, &mut rng);
        Ok(Generator {
            rw: spec.rw,
            start,
            len,
            rwmixread: u64::from(spec.rwmixread),
            sizes,
            total_weight,
            min_block,
            max_block,
            norandommap: spec.norandommap,
            map,
            cursor: [0; 2],
            rng,
        })
    }

    /// The next I/O unit.
    #[allow(clippy::should_implement_trait)] // infinite; an Iterator would always say Some
    pub fn next(&mut self) -> IoUnit {
        let dir = match self.rw {
            RwMode::Read | RwMode::RandRead => IoDir::Read,
            RwMode::Write | RwMode::RandWrite => IoDir::Write,
            RwMode::ReadWrite | RwMode::RandRw => {
                if self.rng.below(100) < self.rwmixread {
                    IoDir::Read
                } else {
                    IoDir::Write
                }
            }
        };
        let b = self.pick_block();
        let rel = if !self.rw.is_random() {
            let cursor = &mut self.cursor[dir as usize];
            if b > self.len - *cursor {
                *cursor = 0;
            }
            let off = *cursor;
            *cursor += b;
            off
        } else if self.norandommap {
            self.rng.below(self.len / b) * b
        } else {
            let target = self.map.next(&mut self.rng) * self.min_block;
            // One block size: the target is the unit (no division per I/O).
            let off = if b == self.min_block {
                target
            } else {
                target / b * b
            };
            if b > self.len - off {
                (self.len - b) / b * b
            } else {
                off
            }
        };
        IoUnit {
            dir,
            offset: self.start + rel,
            len: b,
        }
    }

    /// The largest block size this generator produces (for buffer sizing).
    pub fn max_block(&self) -> u64 {
        self.max_block
    }

    /// The smallest block size this generator produces.
    pub fn min_block(&self) -> u64 {
        self.min_block
    }

    /// Units in one pass of the random map (`len / min_block`): after this many units of a
    /// random job without `norandommap`, every block has been targeted once.
    pub fn blocks_per_pass(&self) -> u64 {
        self.map.n
    }

    fn pick_block(&mut self) -> u64 {
        if let [(bs, _)] = self.sizes[..] {
            return bs;
        }
        let r = self.rng.below(self.total_weight);
        for &(bs, cumulative) in &self.sizes {
            if r < cumulative {
                return bs;
            }
        }
        self.max_block
    }
}

#[cfg(test)]
mod tests;
