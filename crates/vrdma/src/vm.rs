//! The host side of a VM: attaching to the region and ports the daemon
//! keeps for a configured guest (`[vms.NAME]`, see `docs/vms.md`).
//!
//! QEMU is started with the region memfd as an ivshmem `memory-backend-file`
//! and one virtio-serial chardev per port connected to `port_socket`. The
//! daemon hands them to root and to the VM's tenant uid only.

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use vrdma_core::proto::{Reply, Request};

use crate::control::{unexpected, Control};
use crate::error::{Error, Result};

/// What [`attach`] hands over.
#[derive(Debug)]
pub struct VmAttachment {
    /// The VM's shared region (a sealed memfd of `region_len` bytes).
    pub region: OwnedFd,
    pub region_len: u64,
    /// The Unix stream socket QEMU connects each port's chardev to.
    pub port_socket: PathBuf,
    /// How many virtio-serial ports the VM has.
    pub ports: u32,
}

/// Attaches VM `name` through the daemon at the default socket
/// ([`default_socket_path`](crate::default_socket_path)).
pub fn attach(name: &str) -> Result<VmAttachment> {
    attach_at(crate::default_socket_path(), name)
}

/// [`attach`] through the daemon at `socket`.
pub fn attach_at(socket: impl AsRef<std::path::Path>, name: &str) -> Result<VmAttachment> {
    let control = Control::connect(socket.as_ref())?;
    let req = Request::VmAttach { name: name.to_string() };
    let answer = control.call(&req, &[])?;
    match answer.reply {
        Reply::VmAttached { region_len, ref port_socket, ports } => {
            let port_socket = PathBuf::from(port_socket);
            let mut fds = answer.take_fds(1, "VmAttached")?;
            let region = fds.pop().ok_or_else(|| Error::protocol("VmAttached without its region"))?;
            Ok(VmAttachment { region, region_len, port_socket, ports })
        }
        ref other => Err(unexpected(&req, other)),
    }
}
