//! Reading decisions out of the fuzzer's bytes.
//!
//! Every decision reads the next byte(s); past the end of the input every read is zero.
//! The builders map zero to the ordinary, valid choice, so a short input is a valid
//! request or session, and breakage needs a byte the fuzzer chose on purpose ([`rare`]).
//!
//! [`rare`]: Input::rare

/// A cursor over the fuzzer's bytes.
#[derive(Debug)]
pub struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    /// A cursor at the start of `data`.
    pub fn new(data: &'a [u8]) -> Input<'a> {
        Input { data, pos: 0 }
    }

    /// Whether every byte has been read.
    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    /// The next byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos = self.pos.saturating_add(1);
        b
    }

    /// The next two bytes, little endian.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    /// The next four bytes, little endian.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// The next eight bytes, little endian.
    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// A number below `n` (0 when `n` is 0), from one byte when `n` fits in one.
    pub fn below(&mut self, n: u64) -> u64 {
        match n {
            0 => 0,
            1..=256 => u64::from(self.u8()) % n,
            257..=65536 => u64::from(self.u16()) % n,
            _ => self.u64() % n,
        }
    }

    /// One of `choices`, the first when the input is exhausted.
    pub fn pick<T: Copy>(&mut self, choices: &[T]) -> T {
        choices[self.below(choices.len() as u64) as usize]
    }

    /// A flag that is set by one byte value in 16 (never past the end of the input).
    pub fn rare(&mut self) -> bool {
        self.u8() >= 0xf0
    }

    /// `len` bytes (zeroes past the end).
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.u8()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_past_the_end_are_zero() {
        let mut i = Input::new(&[0xff, 1]);
        assert!(i.rare());
        assert_eq!(i.u16(), 1);
        assert!(i.is_empty());
        assert_eq!(i.u64(), 0);
        assert!(!i.rare());
        assert_eq!(i.pick(&[7, 8]), 7);
    }
}
