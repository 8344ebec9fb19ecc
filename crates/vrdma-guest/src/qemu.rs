//! The QEMU arguments that attach a VM to the daemon (the VM contract,
//! issue 18): the VM's shared region as an `ivshmem-plain` device, and
//! one virtio-serial port per concurrent guest context, each a chardev
//! connected to the daemon's per-VM Unix socket.

use std::ffi::OsString;
use std::os::fd::RawFd;
use std::path::Path;

use crate::{Error, Result};

/// The most ports one `virtio-serial-pci` device has by default.
pub const MAX_PORTS: u32 = 31;

/// The contract's arguments for a region inherited by QEMU as descriptor
/// `region_fd` (without `FD_CLOEXEC`), `region_len` bytes long, and
/// `ports` ports connecting to `port_socket`.
///
/// `region_len` must be a power of two: QEMU aborts on an ivshmem BAR of
/// any other size (`pci_register_bar: Assertion is_power_of_2(size)`,
/// QEMU 7.2), so this refuses it first.
pub fn vm_args(region_fd: RawFd, region_len: u64, port_socket: &Path, ports: u32) -> Result<Vec<OsString>> {
    if region_fd < 0 {
        return Err(Error::Invalid(format!("region descriptor {region_fd}")));
    }
    if !region_len.is_power_of_two() || region_len < 4096 {
        return Err(Error::Invalid(format!(
            "a VM's region must be a power of two of at least 4 KiB for QEMU's ivshmem, not {region_len} bytes"
        )));
    }
    if !(1..=MAX_PORTS).contains(&ports) {
        return Err(Error::Invalid(format!("{ports} ports; a VM has 1 to {MAX_PORTS}")));
    }
    let sock = port_socket
        .to_str()
        .ok_or_else(|| Error::Invalid(format!("{} is not UTF-8", port_socket.display())))?;
    // QEMU's option syntax separates with commas and reads ",," as one.
    let sock = sock.replace(',', ",,");
    let mut a: Vec<String> = vec![
        "-object".into(),
        format!(
            "memory-backend-file,id=vrdma-mem,share=on,mem-path=/proc/self/fd/{region_fd},size={region_len}"
        ),
        "-device".into(),
        // `master=on`: QEMU migrates the region with the VM (with the
        // default, off, it refuses to migrate a VM with the device at
        // all); docs/migration.md says why the region moves this way.
        "ivshmem-plain,memdev=vrdma-mem,master=on".into(),
        "-device".into(),
        "virtio-serial-pci,id=vrdma-serial".into(),
    ];
    for k in 0..ports {
        a.push("-chardev".into());
        a.push(format!("socket,id=vrdma-p{k},path={sock}"));
        a.push("-device".into());
        a.push(format!("virtserialport,bus=vrdma-serial.0,chardev=vrdma-p{k},name=org.vrdma.{k}"));
    }
    Ok(a.into_iter().map(OsString::from).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_contracts_arguments() {
        let a = vm_args(7, 64 << 20, Path::new("/run/vrdma/vm-a.sock"), 2).unwrap();
        let a: Vec<&str> = a.iter().map(|s| s.to_str().unwrap()).collect();
        assert_eq!(
            a,
            [
                "-object",
                "memory-backend-file,id=vrdma-mem,share=on,mem-path=/proc/self/fd/7,size=67108864",
                "-device",
                "ivshmem-plain,memdev=vrdma-mem,master=on",
                "-device",
                "virtio-serial-pci,id=vrdma-serial",
                "-chardev",
                "socket,id=vrdma-p0,path=/run/vrdma/vm-a.sock",
                "-device",
                "virtserialport,bus=vrdma-serial.0,chardev=vrdma-p0,name=org.vrdma.0",
                "-chardev",
                "socket,id=vrdma-p1,path=/run/vrdma/vm-a.sock",
                "-device",
                "virtserialport,bus=vrdma-serial.0,chardev=vrdma-p1,name=org.vrdma.1",
            ]
        );
    }

    #[test]
    fn sizes_qemu_rejects_and_commas_in_paths() {
        let p = Path::new("/s");
        assert!(vm_args(3, 100 << 20, p, 1).is_err(), "not a power of two");
        assert!(vm_args(3, 2048, p, 1).is_err());
        assert!(vm_args(3, 1 << 20, p, 0).is_err());
        assert!(vm_args(3, 1 << 20, p, 32).is_err());
        assert!(vm_args(-1, 1 << 20, p, 1).is_err());
        let a = vm_args(3, 1 << 20, Path::new("/a,b.sock"), 1).unwrap();
        assert!(a.iter().any(|s| s == "socket,id=vrdma-p0,path=/a,,b.sock"));
    }
}
