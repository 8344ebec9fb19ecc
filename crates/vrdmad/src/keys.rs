//! Memory keys and rdma_cm PSNs from the kernel's CSPRNG, so that a
//! tenant cannot guess another's rkey or a connection's PSN.
//!
//! The bytes are drawn a block at a time: one `getrandom` call per key
//! was a system call on every MR and rdma_cm id made (two on each
//! rdma_cm connection's path, the spare id's and the request's), and the
//! bytes of one larger call are as unguessable as those of many small
//! ones. What the block holds is only as readable as the rest of the
//! daemon's memory, which holds the keys themselves.

use vrdma_core::hca::KeySource;

/// Bytes drawn per `getrandom` call: 64 keys.
const BLOCK: usize = 256;

pub(crate) struct RandomKeys {
    block: [u8; BLOCK],
    /// Bytes of `block` handed out (`BLOCK`: none left).
    used: usize,
    /// `getrandom` calls made (what the tests count).
    draws: u64,
}

impl RandomKeys {
    pub(crate) fn new() -> RandomKeys {
        RandomKeys { block: [0; BLOCK], used: BLOCK, draws: 0 }
    }
}

impl KeySource for RandomKeys {
    fn next_key(&mut self) -> u32 {
        if self.used + 4 > BLOCK {
            getrandom::fill(&mut self.block).expect("the kernel's random source is available");
            self.used = 0;
            self.draws += 1;
        }
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.block[self.used..self.used + 4]);
        // A key handed out is not left behind in the block.
        self.block[self.used..self.used + 4].fill(0);
        self.used += 4;
        u32::from_ne_bytes(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection's keys cost no system call of their own: 1000 keys
    /// are 16 draws of the kernel's source, where each was one.
    #[test]
    fn keys_are_drawn_a_block_at_a_time() {
        let mut keys = RandomKeys::new();
        let drawn: Vec<u32> = (0..1000).map(|_| keys.next_key()).collect();
        // (One draw per key, as before, would be 1000.)
        assert_eq!(keys.draws, 16);
        // Still random: 1000 draws of 32 bits almost never repeat (about
        // one chance in 8600 of a single repeat).
        let mut distinct = drawn.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() >= 998, "{} distinct of 1000", distinct.len());
        assert!(keys.block[..keys.used].iter().all(|&b| b == 0), "handed-out bytes are wiped");
    }
}
