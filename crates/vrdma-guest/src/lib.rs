//! Real QEMU guests for vRDMA (issue 18): what tests and `vrdma vm` need
//! to run a stock Debian kernel in QEMU beside the daemon.
//!
//! A guest reaches the daemon through two QEMU devices and no guest
//! kernel module of ours: an `ivshmem-plain` device whose BAR is the VM's
//! shared region (the daemon's memfd), and `virtio-serial` ports whose
//! host ends are the daemon's Unix socket ([`vm_args`] builds exactly the
//! arguments of the contract). This crate builds the rest:
//!
//! - [`image`]: a kernel from Debian's `linux-image-*-cloud-amd64`
//!   package (fetched with `apt-get download`, extracted, never installed)
//!   and an initramfs with busybox, the virtio modules, an `/init` that
//!   gives a harness a shell on the serial console, and caller-chosen host
//!   programs with the shared libraries they load (the project's `vrdma`
//!   and drop-in libraries, Debian's verbs tools), cached under
//!   `target/guest/` by their inputs;
//! - [`guest`]: [`Guest::boot`] runs QEMU on such an image,
//!   [`Guest::run`] runs shell commands in it, and dropping it kills QEMU;
//! - [`qmp`] and [`migration`]: the QMP client and the QEMUs of a VM that
//!   migrates (`vrdma vm run` on a daemon, its QMP socket, the stopped
//!   destination), which `vrdma bench --migrate` and the real-guest
//!   migration tests share.
//!
//! Everything here runs on the host and trusts the host; what comes back
//! from the guest (console output) is only parsed for markers, bounded
//! in size and time.

pub mod accel;
pub mod cache;
pub mod cpio;
mod error;
pub mod guest;
pub mod image;
pub mod kernel;
pub mod libs;
pub mod migration;
pub mod modules;
pub mod qemu;
pub mod qmp;

pub use accel::Accel;
pub use error::{Error, Result};
pub use guest::{Guest, GuestSpec};
pub use image::{DropIn, GuestFile, Image, ImageSpec};
pub use migration::MigrationVm;
pub use qemu::vm_args;
pub use qmp::Qmp;
