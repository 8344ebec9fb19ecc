//! Subcommands that are not benchmarks.

pub mod daemon;
pub mod devinfo;
pub mod hostbench;
pub mod migrate;
pub mod run;
pub mod stat;
pub mod vm;
pub mod vm_migrate;
pub mod vm_qemu;
pub mod vm_snapshot;
