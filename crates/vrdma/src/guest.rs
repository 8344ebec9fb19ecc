//! Guest mode: the library inside a QEMU guest, with no kernel module.
//!
//! Inside a VM the daemon is reached through a virtio-serial port (a byte
//! stream: no descriptors can pass) and the memory it shares is the VM's
//! ivshmem BAR, which the library maps from user space (`docs/vms.md`).
//! This module is the guest's end of that transport:
//!
//! - which port and BAR to use ([`GuestConfig`]): `VRDMA_GUEST_PORT` and
//!   `VRDMA_GUEST_BAR` when set (a host test emulates a guest with the
//!   VM's port socket and its region memfd as `/proc/self/fd/N`), else,
//!   when no host daemon's socket is there, the ports named `org.vrdma.K`
//!   in `/sys/class/virtio-ports` and `resource2` of the ivshmem PCI
//!   device (`1af4:1110`);
//! - a [`GuestLink`] per context: one port, one session. Requests go out
//!   as frames ([`vrdma_core::proto::guest`]); a thread reads the port,
//!   hands replies to the caller, answers the daemon's pings, and proxies
//!   doorbells: for each descriptor the daemon would have passed, it makes
//!   a local socket pair, gives one end to the rest of the library (which
//!   polls it as it would the daemon's) and forwards wake-ups between the
//!   other end and the port.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};
use vrdma_core::proto::guest::{self, Frame, FrameDecoder, Handle, GUEST_VERSION};
use vrdma_core::proto::{Reply, Request};

use crate::error::{Error, Result};

/// The port to open (a character device or, to emulate a guest on the
/// host, a Unix stream socket).
pub const PORT_ENV: &str = "VRDMA_GUEST_PORT";
/// The BAR to map (sysfs `resource2`, or a region memfd as
/// `/proc/self/fd/N`).
pub const BAR_ENV: &str = "VRDMA_GUEST_BAR";
/// The virtio-serial port names QEMU is given (`org.vrdma.K`).
const PORT_NAME_PREFIX: &str = "org.vrdma.";

/// How long a call waits for its reply: a daemon that answers nothing for
/// this long is treated as gone (host calls have the socket's hang-up).
const REPLY_LIMIT: Duration = Duration::from_secs(60);
/// Most wake-ups one read of a proxy forwards in one frame.
const BELLS_AT_ONCE: u32 = 1024;

/// Where guest mode finds its port(s) and BAR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestConfig {
    /// Tried in order until one opens (a virtio port is exclusive).
    pub ports: Vec<PathBuf>,
    pub bar: PathBuf,
}

impl GuestConfig {
    /// From `VRDMA_GUEST_PORT` and `VRDMA_GUEST_BAR`, when both are set.
    pub fn from_env() -> Option<GuestConfig> {
        let port = std::env::var_os(PORT_ENV)?;
        let bar = std::env::var_os(BAR_ENV)?;
        Some(GuestConfig { ports: vec![port.into()], bar: bar.into() })
    }

    /// The vRDMA ports and ivshmem BAR of this machine, if it is a guest
    /// QEMU gave them to.
    pub fn detect() -> Option<GuestConfig> {
        detect_in(Path::new("/sys"), Path::new("/dev"))
    }
}

/// What a scan of `/sys` found: vRDMA's ports (in order of K) and the
/// ivshmem BAR, each possibly absent.
fn scan_in(sys: &Path, dev: &Path) -> (Vec<PathBuf>, Option<PathBuf>) {
    let mut ports: Vec<(u32, PathBuf)> = std::fs::read_dir(sys.join("class/virtio-ports"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let name = std::fs::read_to_string(e.path().join("name")).ok()?;
                    let k: u32 = name.trim().strip_prefix(PORT_NAME_PREFIX)?.parse().ok()?;
                    Some((k, dev.join(e.file_name())))
                })
                .collect()
        })
        .unwrap_or_default();
    ports.sort();
    let bar = std::fs::read_dir(sys.join("bus/pci/devices")).ok().and_then(|d| {
        d.flatten().find_map(|e| {
            let read = |f: &str| std::fs::read_to_string(e.path().join(f)).map(|s| s.trim().to_string());
            (read("vendor").ok()? == "0x1af4" && read("device").ok()? == "0x1110")
                .then(|| e.path().join("resource2"))
        })
    });
    (ports.into_iter().map(|(_, p)| p).collect(), bar)
}

/// [`GuestConfig::detect`] under other roots (for tests).
fn detect_in(sys: &Path, dev: &Path) -> Option<GuestConfig> {
    match scan_in(sys, dev) {
        (ports, Some(bar)) if !ports.is_empty() => Some(GuestConfig { ports, bar }),
        _ => None,
    }
}

/// [`GuestConfig::missing_part`] under other roots (for tests).
fn missing_part_in(sys: &Path, dev: &Path) -> Option<String> {
    match scan_in(sys, dev) {
        (ports, None) if !ports.is_empty() => Some(format!(
            "this VM has vRDMA's ports ({}) but no ivshmem device (PCI 1af4:1110) whose BAR holds \
             the VM's memory: QEMU needs the -object memory-backend-file and -device ivshmem-plain \
             arguments `vrdma vm args` prints",
            ports.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        )),
        (ports, Some(bar)) if ports.is_empty() => Some(format!(
            "this VM has an ivshmem device ({}) but no virtio-serial port named {PORT_NAME_PREFIX}K \
             in /sys/class/virtio-ports: QEMU needs the virtio-serial arguments `vrdma vm args` \
             prints, and the guest the virtio_console module",
            bar.display()
        )),
        _ => None,
    }
}

impl GuestConfig {
    /// Where this machine has part of a guest's vRDMA device only (its
    /// ports without the ivshmem BAR, or the BAR without ports), what is
    /// missing and how to fix it: [`GuestConfig::detect`] finds nothing
    /// there, and a program that would otherwise start a daemon of its
    /// own (which nothing outside the VM could reach) should say this
    /// instead. `None` where it has all of it or none.
    pub fn missing_part() -> Option<String> {
        missing_part_in(Path::new("/sys"), Path::new("/dev"))
    }

    /// Whether the BAR and at least one port are there (a check before
    /// handing the configuration to a program; opening one would take a
    /// port for a moment): what is missing, else `Ok`.
    pub fn check(&self) -> std::result::Result<(), String> {
        if !self.bar.exists() {
            return Err(format!("the VM's BAR {} is not there", self.bar.display()));
        }
        if !self.ports.iter().any(|p| p.exists()) {
            let names: Vec<String> = self.ports.iter().map(|p| p.display().to_string()).collect();
            return Err(format!("no vRDMA port of the VM is there ({})", names.join(", ")));
        }
        Ok(())
    }
}

/// Opens `path` as a port: connects if it is a Unix socket, else opens
/// the character device read-write.
fn open_port(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::FileTypeExt;
    if std::fs::metadata(path)?.file_type().is_socket() {
        let s = std::os::unix::net::UnixStream::connect(path)?;
        return Ok(File::from(OwnedFd::from(s)));
    }
    std::fs::OpenOptions::new().read(true).write(true).open(path)
}

/// What a call's reply brought: the reply, and per handle a descriptor
/// and the offset to map it at.
pub(crate) type Carried = Vec<(OwnedFd, u64)>;

/// The guest's end of one port.
pub(crate) struct GuestLink {
    writer: Arc<Mutex<File>>,
    bar: OwnedFd,
    replies: Mutex<Receiver<(Reply, Vec<Handle>)>>,
    /// Proxies the reader thread serves: id -> its end.
    proxies: Arc<Mutex<HashMap<u32, OwnedFd>>>,
    /// Written to make the reader thread poll the new proxies too.
    wake: OwnedFd,
    /// The library's end of a pair whose other end the reader thread
    /// drops when the port dies: it hangs up then, as a host control
    /// socket does when the daemon goes.
    gone: OwnedFd,
    /// Set when the link is dropped: the reader thread ends, and with it
    /// the port is closed (so that the next opener may take it).
    quit: Arc<AtomicBool>,
}

impl Drop for GuestLink {
    fn drop(&mut self) {
        self.quit.store(true, Ordering::Release);
        let _ = rustix::io::write(&self.wake, &[1]);
        // A socket (an emulated guest's port) closes for the daemon at
        // once; a character device is closed when the thread ends.
        let w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let _ = rustix::net::shutdown(&*w, rustix::net::Shutdown::Both);
    }
}

impl std::fmt::Debug for GuestLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestLink").finish_non_exhaustive()
    }
}

impl GuestLink {
    /// Opens the first port of `cfg` that opens, maps nothing yet, and
    /// says Hello on it.
    pub fn open(cfg: &GuestConfig) -> Result<GuestLink> {
        let mut last = None;
        let port = cfg.ports.iter().find_map(|p| match open_port(p) {
            Ok(f) => Some(f),
            Err(e) => {
                last = Some((p.clone(), e));
                None
            }
        });
        let port = match (port, last) {
            (Some(p), _) => p,
            (None, Some((path, source))) => return Err(Error::Connect { path, source }),
            (None, None) => return Err(Error::protocol("guest mode without a port")),
        };
        let bar = std::fs::OpenOptions::new().read(true).write(true).open(&cfg.bar).map_err(|e| {
            Error::Io(std::io::Error::new(
                e.kind(),
                format!("cannot open the BAR {}: {e}", cfg.bar.display()),
            ))
        })?;
        // From now on a forked child copies this process's mappings of the
        // BAR (rings, regions) instead of sharing them with it and the
        // daemon (`crate::rebacking`'s fork handler).
        let st = rustix::fs::fstat(&bar)?;
        crate::rebacking::note_guest_bar(st.st_dev, st.st_ino);
        let reader = port.try_clone()?;
        let writer = Arc::new(Mutex::new(port));
        let (wake_tx, wake_rx) =
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK)
                .map(|(r, w)| (w, r))?;
        let (gone, gone_far) =
            rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let proxies: Arc<Mutex<HashMap<u32, OwnedFd>>> = Arc::default();
        let quit = Arc::new(AtomicBool::new(false));
        let thread = Reader {
            quit: quit.clone(),
            port: reader,
            writer: writer.clone(),
            replies: tx,
            proxies: proxies.clone(),
            wake: wake_rx,
            _gone: gone_far,
        };
        std::thread::Builder::new().name("vrdma-guest".into()).spawn(move || thread.run())?;
        let link = GuestLink {
            quit,
            writer,
            bar: OwnedFd::from(bar),
            replies: Mutex::new(rx),
            proxies,
            wake: wake_tx,
            gone,
        };
        link.send(&Frame::Hello { version: GUEST_VERSION })?;
        Ok(link)
    }

    /// The descriptor that hangs up when the port dies.
    pub fn gone_fd(&self) -> &OwnedFd {
        &self.gone
    }

    fn send(&self, f: &Frame) -> Result<()> {
        let bytes = guest::encode(f);
        let mut w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        w.write_all(&bytes)?;
        Ok(())
    }

    /// Sends `req` and waits for its reply; the handles become
    /// descriptors (a BAR descriptor and the extent's offset, or the
    /// library's end of a new proxy and 0).
    pub fn call(&self, req: &Request) -> Result<(Reply, Carried)> {
        // One call at a time on a port: the reply that comes is ours.
        let replies = self.replies.lock().unwrap_or_else(|p| p.into_inner());
        self.send(&Frame::Call(req.clone()))?;
        let (reply, handles) = match replies.recv_timeout(REPLY_LIMIT) {
            Ok(r) => r,
            Err(_) => return Err(crate::control::gone()),
        };
        drop(replies);
        let mut carried = Vec::new();
        for h in handles {
            carried.push(match h {
                Handle::Extent { offset, .. } => (self.bar.try_clone()?, offset),
                Handle::Bell { id, hangup } => (self.proxy(id, hangup)?, 0),
            });
        }
        Ok((reply, carried))
    }

    /// Makes proxy `id`: the reader thread keeps one end, the library
    /// gets the other.
    fn proxy(&self, id: u32, hangup: bool) -> Result<OwnedFd> {
        let ty = if hangup { SocketType::SEQPACKET } else { SocketType::DGRAM };
        let (mine, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            ty,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        self.proxies.lock().unwrap_or_else(|p| p.into_inner()).insert(id, theirs);
        let _ = rustix::io::write(&self.wake, &[1]);
        Ok(mine)
    }

    /// The BAR.
    pub fn bar_fd(&self) -> &OwnedFd {
        &self.bar
    }

    /// A descriptor of the BAR, to map extents of it.
    pub fn bar(&self) -> Result<OwnedFd> {
        Ok(self.bar.try_clone()?)
    }
}

/// The thread that reads the port.
struct Reader {
    port: File,
    writer: Arc<Mutex<File>>,
    replies: Sender<(Reply, Vec<Handle>)>,
    proxies: Arc<Mutex<HashMap<u32, OwnedFd>>>,
    wake: OwnedFd,
    quit: Arc<AtomicBool>,
    /// Dropped with the thread: the library's `gone` end hangs up.
    _gone: OwnedFd,
}

impl Reader {
    fn run(mut self) {
        if let Err(why) = self.serve() {
            tracing::debug!(%why, "vrdma guest port closed");
        }
        // Every proxy end closes: hang-up ends wake their pollers.
        self.proxies.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    fn send(&self, f: &Frame) -> std::result::Result<(), String> {
        let mut w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        w.write_all(&guest::encode(f)).map_err(|e| format!("port write: {e}"))
    }

    fn serve(&mut self) -> std::result::Result<(), String> {
        let mut dec = FrameDecoder::new();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            // Snapshot of the proxies to poll (raw numbers: the map may
            // change meanwhile, a stale number only costs a spurious read).
            let ids: Vec<(u32, i32)> = self
                .proxies
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .map(|(id, fd)| (*id, fd.as_raw_fd()))
                .collect();
            let mut ready = Vec::new();
            let port_ready;
            {
                // SAFETY: each raw fd is owned by `self.proxies`. Entries
                // are removed only by this thread (Close frames and hang-ups,
                // handled after the poll); another thread only inserts, under
                // ids the daemon numbers afresh within a session (never one
                // in the map), so no fd polled here is closed meanwhile.
                let borrowed: Vec<_> =
                    ids.iter().map(|(_, fd)| unsafe { std::os::fd::BorrowedFd::borrow_raw(*fd) }).collect();
                let mut fds =
                    vec![PollFd::new(&self.port, PollFlags::IN), PollFd::new(&self.wake, PollFlags::IN)];
                fds.extend(borrowed.iter().map(|b| PollFd::new(b, PollFlags::IN)));
                match rustix::event::poll(&mut fds, None) {
                    Ok(_) => {}
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => return Err(format!("poll: {e}")),
                }
                let hit = |r: PollFlags| r.intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR);
                port_ready = hit(fds[0].revents());
                if hit(fds[1].revents()) {
                    let _ = rustix::io::read(&self.wake, &mut [0u8; 64]);
                }
                for ((id, _), f) in ids.iter().zip(fds.iter().skip(2)) {
                    if hit(f.revents()) {
                        ready.push(*id);
                    }
                }
            }
            if self.quit.load(Ordering::Acquire) {
                return Err("the context was closed".into());
            }
            for id in ready {
                self.forward(id)?;
            }
            if !port_ready {
                continue;
            }
            let n = match self.port.read(&mut buf) {
                Ok(0) => return Err("the daemon closed the port".into()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(format!("port read: {e}")),
            };
            dec.push(&buf[..n]);
            loop {
                match dec.next_frame() {
                    Ok(Some(f)) => self.on_frame(f)?,
                    Ok(None) => break,
                    Err(e) => return Err(format!("the daemon broke the frame stream: {e}")),
                }
            }
        }
    }

    /// Forwards what the library rang on proxy `id`.
    fn forward(&self, id: u32) -> std::result::Result<(), String> {
        let mut count = 0;
        let mut closed = false;
        {
            let proxies = self.proxies.lock().unwrap_or_else(|p| p.into_inner());
            let Some(fd) = proxies.get(&id) else { return Ok(()) };
            let seqpacket =
                rustix::net::sockopt::socket_type(fd.as_fd()).is_ok_and(|t| t == SocketType::SEQPACKET);
            while count < BELLS_AT_ONCE {
                match rustix::net::recv(fd, &mut [0u8; 8], RecvFlags::DONTWAIT) {
                    Ok((0, _)) if seqpacket => {
                        closed = true;
                        break;
                    }
                    Ok(_) => count += 1,
                    Err(rustix::io::Errno::INTR) => {}
                    Err(_) => break,
                }
            }
            if count == 0 && !closed {
                closed = true;
            }
        }
        if count > 0 {
            self.send(&Frame::Bell { id, count })?;
        }
        if closed {
            self.proxies.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            self.send(&Frame::Close { id })?;
        }
        Ok(())
    }

    fn on_frame(&self, f: Frame) -> std::result::Result<(), String> {
        match f {
            Frame::Reply { reply, handles } => {
                // No caller waiting (it timed out): dropped.
                let _ = self.replies.send((reply, handles));
            }
            Frame::Bell { id, count } => {
                let proxies = self.proxies.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(fd) = proxies.get(&id) {
                    for _ in 0..count.min(BELLS_AT_ONCE) {
                        if rustix::net::send(fd, &[1], SendFlags::DONTWAIT).is_err() {
                            break;
                        }
                    }
                }
            }
            Frame::Close { id } => {
                self.proxies.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            }
            Frame::Ping { nonce } => self.send(&Frame::Pong { nonce })?,
            Frame::Hello { .. } | Frame::Call(_) | Frame::Pong { .. } => {
                return Err("the daemon sent a guest's frame".into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_named_ports_in_order_and_the_ivshmem_bar() {
        let d = tempfile_dir();
        let sys = d.join("sys");
        for (entry, name) in
            [("vport1p3", "org.vrdma.1"), ("vport1p2", "org.vrdma.0"), ("vport1p1", "org.qemu.guest_agent.0")]
        {
            let p = sys.join("class/virtio-ports").join(entry);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("name"), format!("{name}\n")).unwrap();
        }
        for (dev, vendor, device) in
            [("0000:00:03.0", "0x1af4", "0x1003"), ("0000:00:04.0", "0x1af4", "0x1110")]
        {
            let p = sys.join("bus/pci/devices").join(dev);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("vendor"), format!("{vendor}\n")).unwrap();
            std::fs::write(p.join("device"), format!("{device}\n")).unwrap();
        }
        let c = detect_in(&sys, Path::new("/dev")).unwrap();
        assert_eq!(c.ports, vec![PathBuf::from("/dev/vport1p2"), PathBuf::from("/dev/vport1p3")]);
        assert_eq!(c.bar, sys.join("bus/pci/devices/0000:00:04.0/resource2"));
        assert_eq!(detect_in(&d.join("none"), Path::new("/dev")), None);
        assert_eq!(missing_part_in(&sys, Path::new("/dev")), None);
        assert_eq!(missing_part_in(&d.join("none"), Path::new("/dev")), None);
        // The BAR without ports, then ports without the BAR.
        std::fs::remove_dir_all(sys.join("class")).unwrap();
        assert_eq!(detect_in(&sys, Path::new("/dev")), None);
        let why = missing_part_in(&sys, Path::new("/dev")).unwrap();
        assert!(why.contains("no virtio-serial port named org.vrdma.K"), "{why}");
        std::fs::remove_dir_all(sys.join("bus")).unwrap();
        let p = sys.join("class/virtio-ports/vport1p2");
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("name"), "org.vrdma.0\n").unwrap();
        assert_eq!(detect_in(&sys, Path::new("/dev")), None);
        let why = missing_part_in(&sys, Path::new("/dev")).unwrap();
        assert!(why.contains("/dev/vport1p2") && why.contains("no ivshmem device"), "{why}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("vrdma-guest-detect-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
