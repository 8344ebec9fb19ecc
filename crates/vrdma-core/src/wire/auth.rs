//! Mutual authentication of two daemons with a pre-shared key.
//!
//! Each side's Hello carries a fresh 32-byte random nonce. Each side then
//! sends an Auth frame whose tag is
//!
//! ```text
//! HMAC-SHA256(psk, LABEL || prover_role || initiator_hello || acceptor_hello)
//! ```
//!
//! where the Hellos are their exact 80-byte encodings (so the tag covers
//! both nonces, both daemon ids, the versions and chunk sizes offered) and
//! `prover_role` is the role of the daemon that computes the tag. Because
//! the role is in the MAC, a tag reflected back at its sender does not
//! verify; because the peer's fresh nonce is in it, a recorded tag does not
//! verify on a later connection. A receiver compares tags in constant time.
//!
//! These are pure functions: the caller draws the nonces (from the OS's
//! random source) and passes them in through the Hellos.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::control::{HELLO_LEN, TAG_LEN};
use super::{FrameRepr, HelloRepr, Role, WireError};

/// Domain-separation label at the start of every MAC input.
pub const LABEL: &[u8] = b"vrdma wire v1 auth";
/// Shortest pre-shared key accepted, in bytes.
pub const MIN_KEY_LEN: usize = 16;

type HmacSha256 = Hmac<Sha256>;

/// Why authentication failed. Every one of these ends the connection with
/// `CloseReason::AuthFailed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("pre-shared key of {0} bytes is shorter than {MIN_KEY_LEN}")]
    KeyTooShort(usize),
    #[error("both Hellos claim the same role")]
    RoleMismatch,
    #[error("the peer's nonce equals ours (a reflected Hello)")]
    NonceReuse,
    #[error("authentication tag does not verify")]
    BadTag,
    #[error("Hello does not encode: {0}")]
    Wire(WireError),
}

fn transcript(
    psk: &[u8],
    prover: Role,
    initiator: &HelloRepr,
    acceptor: &HelloRepr,
) -> Result<HmacSha256, AuthError> {
    if psk.len() < MIN_KEY_LEN {
        return Err(AuthError::KeyTooShort(psk.len()));
    }
    if initiator.role != Role::Initiator || acceptor.role != Role::Acceptor {
        return Err(AuthError::RoleMismatch);
    }
    if initiator.nonce == acceptor.nonce {
        return Err(AuthError::NonceReuse);
    }
    let mut mac = HmacSha256::new_from_slice(psk).expect("HMAC takes keys of any length");
    mac.update(LABEL);
    mac.update(&[prover as u8]);
    for h in [initiator, acceptor] {
        let mut b = [0u8; HELLO_LEN];
        FrameRepr::Hello(*h).emit(&mut b).map_err(AuthError::Wire)?;
        mac.update(&b);
    }
    Ok(mac)
}

/// The tag the daemon in role `prover` sends, over the two Hellos of the
/// connection.
pub fn auth_tag(
    psk: &[u8],
    prover: Role,
    initiator: &HelloRepr,
    acceptor: &HelloRepr,
) -> Result<[u8; TAG_LEN], AuthError> {
    let mac = transcript(psk, prover, initiator, acceptor)?;
    Ok(mac.finalize().into_bytes().into())
}

/// Checks, in constant time, a tag that claims to come from `prover`.
pub fn verify_tag(
    psk: &[u8],
    prover: Role,
    initiator: &HelloRepr,
    acceptor: &HelloRepr,
    tag: &[u8],
) -> Result<(), AuthError> {
    let mac = transcript(psk, prover, initiator, acceptor)?;
    mac.verify_slice(tag).map_err(|_| AuthError::BadTag)
}

fn order<'h>(a: &'h HelloRepr, b: &'h HelloRepr) -> (&'h HelloRepr, &'h HelloRepr) {
    if a.role == Role::Initiator {
        (a, b)
    } else {
        (b, a)
    }
}

/// The tag this daemon sends: `local` is the Hello it sent, `peer` the one
/// it received.
pub fn local_tag(psk: &[u8], local: &HelloRepr, peer: &HelloRepr) -> Result<[u8; TAG_LEN], AuthError> {
    let (i, a) = order(local, peer);
    auth_tag(psk, local.role, i, a)
}

/// Checks the tag the peer sent.
pub fn verify_peer(psk: &[u8], local: &HelloRepr, peer: &HelloRepr, tag: &[u8]) -> Result<(), AuthError> {
    let (i, a) = order(local, peer);
    verify_tag(psk, peer.role, i, a, tag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_sha256_known_answer_rfc4231_case_2() {
        let mut mac = HmacSha256::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        let out: [u8; 32] = mac.finalize().into_bytes().into();
        let hex: String = out.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }
}
