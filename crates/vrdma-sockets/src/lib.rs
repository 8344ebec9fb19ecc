//! `libvrdma_sockets.so`: unmodified TCP applications on vRDMA
//! (`docs/sockets.md`, issue 20).
//!
//! Preloaded into a dynamically linked program (`vrdma run --sockets --
//! APP`, or `LD_PRELOAD` by hand), it carries the program's IPv4 and IPv6
//! TCP connections (a dual-stack listener on `::` owns IPv4 and IPv6
//! clients, a v6only one IPv6 clients only, v4-mapped connections are
//! IPv4 ones: `addr.rs`) over an RC QP pair when the other end is also this
//! library, of the same tenant, on this host or (IPv4 only) another whose
//! daemon this host's daemon asks, and leaves them plain TCP otherwise. The application's descriptor is always the kernel's TCP
//! socket; whether a connection is carried is decided through the daemon
//! (listeners register, clients announce, servers claim), never by bytes
//! in a stranger's stream.
//!
//! # What this slice handles
//!
//! - **Negotiated**: `listen` (registers the address), `connect` (announces
//!   the 4-tuple when a listener of the tenant, on this host or the
//!   destination's, owns the destination; blocking or non-blocking), `accept`/`accept4` (claims;
//!   a listening socket inherited through exec is registered at its
//!   first `accept`).
//! - **Carried** once both ends agreed: `read`, `write`, `recv`, `send`,
//!   `recvfrom`, `sendto`, `readv`, `writev`, `recvmsg`, `sendmsg` (no
//!   ancillary data), the `_FORTIFY_SOURCE` forms `__read_chk`,
//!   `__recv_chk`, `__recvfrom_chk`, with `MSG_PEEK`, `MSG_DONTWAIT`, `MSG_WAITALL`,
//!   `MSG_NOSIGNAL` and `O_NONBLOCK` (`EAGAIN`); `sendfile`/`sendfile64` (read at the
//!   offset or the file's position, then written through the ring; the
//!   offset or the position moves by what was written); `shutdown` (half-close: the peer reads
//!   EOF after the last byte); `close` (FIN after the last descriptor);
//!   `dup`, `dup2`, `dup3`, `fcntl`/`fcntl64` (`F_DUPFD*`) share the
//!   connection; `ioctl(FIONREAD)` (`SIOCINQ`) counts the bytes waiting
//!   in the ring (other requests are the kernel's); `sendmmsg` and
//!   `recvmmsg` take their messages one by one through the ring.
//!   `splice` to or from a carried connection fails with `EINVAL` (it
//!   would move the raw socket's bytes past the ring; programs that
//!   splice fall back to reading and writing).
//! - **Passed through** (the kernel's, which are right for the descriptor
//!   as it is a real TCP socket): `socket`, `bind`, `getsockname`,
//!   `getpeername`, `setsockopt`/`getsockopt` (but `TCP_NODELAY` and
//!   `TCP_CORK` on a carried connection: the kernel's kept on and off for
//!   its wake bytes, the program's own values to the program: [`kept`]),
//!   `fcntl`'s other commands,
//!   every call on a descriptor that is not carried (UDP, Unix sockets,
//!   files, connections to hosts without a linked daemon or to plain TCP
//!   peers).
//! - **Readiness** (`poll`, `ppoll`, `select`, `pselect`, `epoll`) is
//!   the kernel's view of the socket: the library keeps a wake byte in the
//!   socket exactly while bytes wait in the ring (`docs/sockets.md`), so
//!   `POLLIN` is right, level- and edge-triggered. `poll`, `ppoll`,
//!   `select`, `pselect`, `epoll_wait`, `epoll_pwait` and `epoll_pwait2`
//!   are interposed to land this process's writes in flight before they
//!   wait (a write returns once posted; [`progress`]), and take back the
//!   readability of a carried socket whose ring is empty and whose socket
//!   holds only stale wake bytes (one that came late, across hosts:
//!   [`readiness`]); a connection they report before its first call
//!   (the peer's hello is no data) is decided first, and answered for as
//!   it then is ([`readiness`]). Writability is the ring's: `epoll_ctl` is interposed
//!   and the registrations of carried connections kept, so that a ring
//!   found full takes `EPOLLOUT` out of the kernel's registration and
//!   credits coming back give it back, which the kernel reports, also
//!   edge-triggered ([`epoll`]); `poll` and `ppoll` report `POLLOUT` only
//!   with room, and so do `select` and `pselect`, which take `ppoll`'s
//!   path when a carried socket is in their sets ([`readiness`]). A call
//!   of theirs that does not wait (a zero timeout) and finds nothing
//!   ready, less than 20 µs after the thread's previous one found
//!   nothing, yields the CPU once and looks again: a program spinning on
//!   them (rstream's asynchronous mode) lets its peer, perhaps on the
//!   same CPU, fill or drain the ring.
//!   Credits coming back are heard at once: a writer about to wait on a
//!   full ring asks its reader, which answers its next credit with a
//!   send that wakes the progress thread through the process's
//!   completion channel; it gives `EPOLLOUT` back and wakes blocked
//!   writes ([`credit`]).
//! - **Exec**: before `execve` and its family (`execv`, `execvp`,
//!   `execvpe`, `fexecve`, `execveat`, and on x86-64 the variadic
//!   `execl`, `execle`, `execlp`), `posix_spawn`/`posix_spawnp`,
//!   `system` and `popen`, every connection the new program inherits
//!   that is not negotiated yet (an inetd-style server's, accepted and
//!   handed on before any call) is settled as plain TCP for both ends:
//!   declined through the daemon, or the client's hello answered with a
//!   decline ([`exec`]); a descriptor that a spawn's file action
//!   `dup2`s is settled when the action is added.
//! - **End of stream**: a close tells the peer through its ring before the
//!   QP goes (the `CLOSED` word), so the peer's read ends at once, after
//!   every byte ([`link`]).
//! - **Not handled yet** on a carried descriptor: `io_uring` would read
//!   the raw socket; after `fork` a connection
//!   is driven by the process that calls on it first, through its own
//!   device ([`owner`]: a forking server's child serves what its parent
//!   accepted; a client's child makes the first call on what its parent
//!   connected, adopting the announcement at the daemon where it is
//!   this host's), and a data call in the other fails with `EIO`; one
//!   carried before the fork that the other process calls on falls back
//!   to plain TCP mid-stream for both ends ([`forkshare`]: the other
//!   process must not share the driver's rings or daemon connection; the
//!   connections it accepts, also on an inherited listener, or makes
//!   itself are carried through a device of its own), and an exec'd
//!   program does not get a
//!   carried descriptor (it is made close-on-exec once carried, and kept
//!   so through `F_SETFD` and `dup`s: the program would read the raw
//!   socket past the rings; its peer reads the end); `SO_RCVBUF`/`SO_SNDBUF` do not size the ring;
//!   `SHUT_RD` is the kernel's only. A client's first call on a connection blocks (even
//!   non-blocking) until the server accepted and made its first call, and
//!   a server's first call until the client made its first. Connections
//!   to another host's link-local addresses (`fe80::/10`: scope ids are
//!   per host; on one host the registry keys the scope) stay TCP.
//!
//! Environment: `VRDMA_SOCKET` names the daemon, `VRDMA_SOCKETS=0` turns
//! the library off, `VRDMA_SOCKETS_DEBUG=1` prints each decision,
//! `VRDMA_SOCKETS_WAIT_MS` bounds a client's wait for the server's claim,
//! `VRDMA_SOCKETS_PROGRESS_US` sets how often the progress thread looks at
//! writes left in flight and write-blocked connections (500 µs by
//! default; credit answers wake it sooner).
//!
//! The drop-in `librdmacm.so.1` also loads this library (`dlopen`,
//! `RTLD_LOCAL | RTLD_DEEPBIND`) and calls its exports by name for its
//! rsocket API (`rread` is this `read`, ...: `docs/sockets.md`,
//! "rsocket"), so the exports' names and C prototypes are an interface;
//! rsocket's direct placement (`riomap`, `riounmap`, `riowrite`) has
//! exports of its own, `vrdma_sockets_riomap` and the like ([`rio`]).

mod addr;
mod blocking;
mod cloexec;
mod connlock;
mod credit;
mod dev;
mod epoll;
mod exec;
mod forkshare;
mod interpose;
mod kept;
mod link;
mod listener;
mod owner;
mod pause;
mod pid;
mod progress;
mod readiness;
mod real;
mod rio;
mod stream;
mod table;
