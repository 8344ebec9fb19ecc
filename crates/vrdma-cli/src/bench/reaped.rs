//! A child process of a measurement that must not outlive it: whatever
//! ends the measurement (its result, an error, a panic) ends the child.

use std::process::Child;

/// Kills and reaps a child on drop (its pid is its own).
pub struct Reaped(pub Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}
