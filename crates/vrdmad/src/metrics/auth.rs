//! A bearer token for the metrics endpoint (`metrics_token_file`).
//!
//! The endpoint shows every tenant's figures, and TCP tells the daemon
//! nothing about who connects: on loopback that is every local user (and
//! every user-mode QEMU guest, whose network is the host's loopback).
//! Prometheus sends a token from a file (`authorization: {
//! credentials_file: ... }`), `curl` one with `-H`, `vrdma stat
//! --metrics` one from `--metrics-token-file`: with the option set, a
//! scrape without the token is answered 401 and sees nothing.
//!
//! The token is read once, when the daemon starts; it is the file's
//! content without surrounding whitespace, the characters of RFC 6750's
//! `b64token` only, at most [`MAX_TOKEN`] bytes. It is compared in time
//! that does not depend on where it differs.

use std::path::Path;

/// Longest token taken.
pub const MAX_TOKEN: usize = 1024;

/// Why a token file was not taken.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read the metrics token file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the metrics token file {path} {why}")]
    Invalid { path: String, why: String },
}

/// The token in the file at `path`.
pub fn load_token(path: &Path) -> Result<String, TokenError> {
    let shown = path.display().to_string();
    let invalid = |why: String| TokenError::Invalid { path: shown.clone(), why };
    let meta = std::fs::metadata(path).map_err(|source| TokenError::Read { path: shown.clone(), source })?;
    if !meta.is_file() {
        return Err(invalid("is not a regular file".into()));
    }
    if meta.len() > 4 * MAX_TOKEN as u64 {
        return Err(invalid(format!("holds {} bytes (a token is at most {MAX_TOKEN})", meta.len())));
    }
    let bytes = std::fs::read(path).map_err(|source| TokenError::Read { path: shown.clone(), source })?;
    let text = std::str::from_utf8(&bytes).map_err(|_| invalid("is not text".into()))?;
    let token = text.trim();
    check_token(token).map_err(invalid)?;
    if std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o077 != 0 {
        tracing::warn!(path = %shown, "the metrics token file is open to others than its owner (mode 0600 keeps it theirs)");
    }
    Ok(token.to_string())
}

/// Whether `t` is a token we take (`b64token`: letters, digits,
/// `-._~+/`, then any `=`), else why not.
fn check_token(t: &str) -> Result<(), String> {
    if t.is_empty() {
        return Err("is empty".into());
    }
    if t.len() > MAX_TOKEN {
        return Err(format!("holds a token of {} bytes (at most {MAX_TOKEN})", t.len()));
    }
    let body = t.trim_end_matches('=');
    if body.is_empty() || !body.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b)) {
        return Err(
            "holds characters a bearer token cannot have (letters, digits, -._~+/ and a trailing =)".into()
        );
    }
    Ok(())
}

/// Whether the request head `head` carries `Authorization: Bearer
/// <token>` (the header's name and the scheme in any case).
pub fn authorized(head: &[u8], token: &str) -> bool {
    let Ok(text) = std::str::from_utf8(head) else { return false };
    let mut found = false;
    for line in text.split('\n').skip(1) {
        let line = line.trim_end_matches('\r');
        let Some((name, value)) = line.split_once(':') else { continue };
        if !name.eq_ignore_ascii_case("authorization") {
            continue;
        }
        // Every Authorization header must be the token's: one that is
        // not (or does not parse) is not made good by another.
        let Some((scheme, given)) = value.trim().split_once(' ') else { return false };
        if !scheme.eq_ignore_ascii_case("bearer") || !same(given.trim().as_bytes(), token.as_bytes()) {
            return false;
        }
        found = true;
    }
    found
}

/// `a == b`, in time that depends on their lengths only.
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: &str = "s3cr3t-T0ken_~+/=";

    fn head(auth: &str) -> Vec<u8> {
        format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}\r\n\r\n").into_bytes()
    }

    #[test]
    fn only_the_token_with_the_bearer_scheme_is_authorized() {
        assert!(authorized(&head(&format!("Authorization: Bearer {T}")), T));
        assert!(authorized(&head(&format!("authorization:bearer  {T} ")), T));
        assert!(authorized(&format!("GET /metrics HTTP/1.1\nAUTHORIZATION: BEARER {T}\n\n").into_bytes(), T));
        for bad in [
            String::new(),
            format!("Authorization: Basic {T}"),
            format!("Authorization: Bearer {T}x"),
            format!("Authorization: Bearer {}", &T[..T.len() - 1]),
            "Authorization: Bearer".into(),
            format!("Authorization {T}"),
            format!("X-Authorization: Bearer {T}"),
            // A wrong one beside the right one.
            format!("Authorization: Bearer nope\r\nAuthorization: Bearer {T}"),
            format!("Authorization: Bearer {T}\r\nAuthorization: Bearer nope"),
            format!("Authorization: junk\r\nAuthorization: Bearer {T}"),
            format!("Authorization: Bearer\t{T}"),
        ] {
            assert!(!authorized(&head(&bad), T), "{bad:?}");
        }
        // The token on the request line is not a header.
        assert!(!authorized(format!("GET /metrics?Authorization:Bearer {T} HTTP/1.1\r\n\r\n").as_bytes(), T));
        assert!(!authorized(b"\xff\xfe\r\nAuthorization: Bearer x\r\n\r\n", "x"));
    }

    #[test]
    fn token_files_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, body: &[u8]| {
            let p = dir.path().join(name);
            std::fs::write(&p, body).unwrap();
            p
        };
        assert_eq!(load_token(&write("ok", format!("  {T}\n").as_bytes())).unwrap(), T);
        for (name, body, says) in [
            ("empty", &b"\n \n"[..], "is empty"),
            ("space", b"two words", "characters"),
            ("colon", b"a:b", "characters"),
            ("eq", b"==", "characters"),
            ("bin", b"\xff\xfe", "is not text"),
        ] {
            let e = load_token(&write(name, body)).unwrap_err().to_string();
            assert!(e.contains(says), "{name}: {e}");
        }
        let long = "a".repeat(MAX_TOKEN + 1);
        assert!(load_token(&write("long", long.as_bytes())).unwrap_err().to_string().contains("at most"));
        let huge = vec![b'a'; 64 * MAX_TOKEN];
        assert!(load_token(&write("huge", &huge)).unwrap_err().to_string().contains("bytes"));
        let e = load_token(&dir.path().join("absent")).unwrap_err().to_string();
        assert!(e.contains("cannot read"), "{e}");
        assert!(load_token(dir.path()).unwrap_err().to_string().contains("not a regular file"));
    }
}
