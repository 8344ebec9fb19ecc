//! The vRDMA device's drivers: the operating-system pieces that connect
//! the daemon and its tenants.
//!
//! `vrdma-core` decides what the device does; this crate provides the
//! channels it does it through, all of them plain Linux primitives:
//!
//! - [`segment`]: memory both sides map, as sealed `memfd`s. A file
//!   descriptor can be passed over a socket and mapped by the receiver, and
//!   seals let the receiver be sure the sender cannot pull pages out from
//!   under it (which would `SIGBUS` the daemon).
//! - [`ring`]: single-producer, single-consumer queues of fixed-size slots
//!   inside a segment. Work and completion queues are rings, so posting and
//!   polling need no system call. Each side treats the other's index as
//!   hostile input.
//! - [`doorbell`]: `eventfd` wake-ups, so that an idle side can sleep in
//!   `poll`/`epoll` instead of spinning on a ring.
//! - [`fdpass`]: the control socket, `SOCK_SEQPACKET` with `SCM_RIGHTS`,
//!   which carries requests together with the descriptors of segments and
//!   doorbells, and `SO_PEERCRED` to know which process is asking.
//! - [`spin`]: a short look at a descriptor before blocking on it, where
//!   cores are spare enough that a wake-up costs more than the look.
//!
//! Everything here is written for a peer that may be malicious: sizes and
//! seals are checked before mapping, shared bytes are only moved with raw
//! copies and atomics, and bad shared state is an error, never a panic or
//! an access outside a mapping.

pub mod doorbell;
pub mod fdpass;
pub mod ring;
pub mod segment;
pub mod spin;
pub mod window;

pub use doorbell::Doorbell;
pub use fdpass::{peer_credentials, recv_msg, send_msg, seqpacket_pair, PeerCred, Received, MAX_FDS_PER_MSG};
pub use ring::{ring_bytes, Claim, RingError, RingView, RING_ALIGN, RING_AUX_WORDS, RING_HEADER};
pub use segment::{
    live_mappings, page_size, set_mapping_limit, Mapping, MappingBudget, Piece, PiecedMapping, Segment,
    SegmentError,
};
pub use window::WordPage;
