//! A minimal HTTP/1.x server for `GET /metrics`, on one thread, one
//! connection at a time.
//!
//! Whoever can reach the port is untrusted: a request head is read up to
//! [`MAX_REQUEST`] bytes (past it: 431) within [`REQUEST_DEADLINE`] in all
//! (a client that trickles bytes is cut off then, so one slow client
//! holds the endpoint for that long at most), parsed without panicking,
//! and answered once; then the connection is closed. Only `GET` (and
//! `HEAD`) of `/metrics` is served; other paths are 404, other methods
//! 405, anything unparsable 400; with a token configured, a scrape
//! without it 401 ([`super::auth`]). A request body is never read.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Longest request head read.
pub const MAX_REQUEST: usize = 8192;
/// How long a client has to send its request head.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
/// How long writing the answer may take.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a request head asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// `GET /metrics` (`head`: `HEAD /metrics`, answered without a body).
    Metrics {
        head: bool,
    },
    NotFound,
    MethodNotAllowed,
    Bad,
}

/// Where a complete request head ends in `buf`, if it does.
pub fn head_end(buf: &[u8]) -> Option<usize> {
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Parses a request head (its request line decides).
pub fn parse(head: &[u8]) -> Parsed {
    let Ok(text) = std::str::from_utf8(head) else { return Parsed::Bad };
    let line = text.split('\n').next().unwrap_or("").trim_end_matches('\r');
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Parsed::Bad;
    };
    if !version.starts_with("HTTP/1.") || method.is_empty() || !target.starts_with('/') {
        return Parsed::Bad;
    }
    let head = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Parsed::MethodNotAllowed,
    };
    let path = target.split('?').next().unwrap_or(target);
    if path == "/metrics" {
        Parsed::Metrics { head }
    } else {
        Parsed::NotFound
    }
}

/// Reads a request head from `conn` within the limits: `Err(status)` when
/// it is too large or does not come in time.
fn read_head(conn: &mut TcpStream, deadline: Duration) -> Result<Vec<u8>, u16> {
    let start = Instant::now();
    let mut buf = vec![0u8; MAX_REQUEST];
    let mut len = 0;
    loop {
        if let Some(end) = head_end(&buf[..len]) {
            buf.truncate(end);
            return Ok(buf);
        }
        if len == buf.len() {
            return Err(431);
        }
        let left = deadline.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(408);
        }
        let _ = conn.set_read_timeout(Some(left));
        match conn.read(&mut buf[len..]) {
            Ok(0) => return Err(400),
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return Err(408),
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        _ => "Error",
    }
}

fn respond(conn: &mut TcpStream, status: u16, content_type: &str, body: &str, with_body: bool) {
    let mut out = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n",
        reason(status),
        body.len()
    );
    if status == 405 {
        out.push_str("Allow: GET, HEAD\r\n");
    }
    if status == 401 {
        out.push_str("WWW-Authenticate: Bearer realm=\"vrdma metrics\"\r\n");
    }
    out.push_str("\r\n");
    if with_body {
        out.push_str(body);
    }
    let _ = conn.set_write_timeout(Some(WRITE_TIMEOUT));
    let _ = conn.write_all(out.as_bytes());
    let _ = conn.flush();
}

/// The content type of the Prometheus text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Serves one connection: reads its request, answers it (a scrape only
/// with `token`, if one is set).
pub fn handle(mut conn: TcpStream, deadline: Duration, token: Option<&str>, render: &dyn Fn() -> String) {
    let text = "text/plain; charset=utf-8";
    match read_head(&mut conn, deadline) {
        Err(status) => {
            respond(&mut conn, status, text, &format!("{}\n", reason(status)), true);
            // Closing with unread bytes would reset the connection, and
            // the client could lose the answer: read a bounded amount
            // more, briefly, first.
            let _ = conn.shutdown(std::net::Shutdown::Write);
            let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
            let mut sink = [0u8; 4096];
            for _ in 0..16 {
                if !matches!(conn.read(&mut sink), Ok(n) if n > 0) {
                    break;
                }
            }
        }
        Ok(req) => match parse(&req) {
            Parsed::Metrics { head } if token.is_some_and(|t| !super::auth::authorized(&req, t)) => {
                tracing::debug!("metrics endpoint: a scrape without the token; 401");
                let body = "a bearer token is needed (the daemon's metrics_token_file)\n";
                respond(&mut conn, 401, text, body, !head)
            }
            Parsed::Metrics { head } => respond(&mut conn, 200, CONTENT_TYPE, &render(), !head),
            Parsed::NotFound => respond(&mut conn, 404, text, "only /metrics is served here\n", true),
            Parsed::MethodNotAllowed => respond(&mut conn, 405, text, "only GET and HEAD\n", true),
            Parsed::Bad => respond(&mut conn, 400, text, "Bad Request\n", true),
        },
    }
    let _ = conn.shutdown(std::net::Shutdown::Both);
}

/// Accepts and serves connections one at a time until `stop` is set
/// (looked at every 200 ms).
pub fn serve(listener: TcpListener, stop: &AtomicBool, token: Option<&str>, render: &dyn Fn() -> String) {
    while !stop.load(Ordering::Relaxed) {
        let mut fds = [rustix::event::PollFd::new(&listener, rustix::event::PollFlags::IN)];
        let ts = rustix::time::Timespec { tv_sec: 0, tv_nsec: 200_000_000 };
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "metrics endpoint: poll failed; stopping it");
                return;
            }
        }
        match listener.accept() {
            Ok((conn, _)) => {
                // The listener is non-blocking; the connection must not be.
                let _ = conn.set_nonblocking(false);
                handle(conn, REQUEST_DEADLINE, token, render);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => {
                tracing::debug!(error = %e, "metrics endpoint: accept failed");
                // Out of descriptors, say: not a busy loop.
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_are_parsed_strictly_and_never_panic() {
        assert_eq!(parse(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), Parsed::Metrics { head: false });
        assert_eq!(parse(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"), Parsed::Metrics { head: false });
        assert_eq!(parse(b"HEAD /metrics HTTP/1.1\n\n"), Parsed::Metrics { head: true });
        assert_eq!(parse(b"GET / HTTP/1.1\r\n\r\n"), Parsed::NotFound);
        assert_eq!(parse(b"GET /metricsx HTTP/1.1\r\n\r\n"), Parsed::NotFound);
        assert_eq!(parse(b"POST /metrics HTTP/1.1\r\n\r\n"), Parsed::MethodNotAllowed);
        for bad in [
            &b""[..],
            b"\r\n\r\n",
            b"GET\r\n\r\n",
            b"GET /metrics\r\n\r\n",
            b"GET /metrics HTTP/2\r\n\r\n",
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"GET  /metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/1.1 x\r\n\r\n",
            b"\xff\xfe /metrics HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(parse(bad), Parsed::Bad, "{:?}", String::from_utf8_lossy(bad));
        }
        // Whatever the bytes, an answer and no panic.
        let mut x = 0x9e37_79b9u32;
        for len in 0..2000 {
            let junk: Vec<u8> = (0..len % 97)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    (x % 256) as u8
                })
                .collect();
            let _ = parse(&junk);
            let _ = head_end(&junk);
        }
    }

    /// Sends `req` to a server thread serving one connection with
    /// `deadline`, returns the answer.
    fn exchange(req: &[u8], deadline: Duration, then_wait: bool) -> String {
        exchange_with(req, deadline, then_wait, None)
    }

    fn exchange_with(req: &[u8], deadline: Duration, then_wait: bool, token: Option<&'static str>) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (c, _) = l.accept().unwrap();
            handle(c, deadline, token, &|| "vrdma_up 1\n".to_string());
        });
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        // The server may close before it read all of an oversized request.
        let _ = c.write_all(req);
        if !then_wait {
            let _ = c.shutdown(std::net::Shutdown::Write);
        }
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        server.join().unwrap();
        out
    }

    #[test]
    fn answers_metrics_and_refuses_everything_else_with_a_status() {
        let ok = exchange(b"GET /metrics HTTP/1.1\r\n\r\n", REQUEST_DEADLINE, true);
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("Content-Type: text/plain; version=0.0.4"), "{ok}");
        assert!(ok.ends_with("\r\n\r\nvrdma_up 1\n"), "{ok}");
        let head = exchange(b"HEAD /metrics HTTP/1.1\r\n\r\n", REQUEST_DEADLINE, true);
        assert!(head.starts_with("HTTP/1.1 200") && head.ends_with("\r\n\r\n"), "{head}");
        assert!(exchange(b"GET /x HTTP/1.1\r\n\r\n", REQUEST_DEADLINE, true).starts_with("HTTP/1.1 404"));
        assert!(
            exchange(b"PUT /metrics HTTP/1.1\r\n\r\n", REQUEST_DEADLINE, true).starts_with("HTTP/1.1 405")
        );
        assert!(exchange(b"garbage\r\n\r\n", REQUEST_DEADLINE, true).starts_with("HTTP/1.1 400"));
        // Ended before the head did.
        assert!(exchange(b"GET /metrics HTTP/1.1\r\n", REQUEST_DEADLINE, false).starts_with("HTTP/1.1 400"));
    }

    /// With a token set, a scrape needs it; the other answers are as
    /// without one.
    #[test]
    fn with_a_token_only_a_scrape_that_carries_it_gets_the_metrics() {
        let token = Some("tok3n");
        let ask = |req: &[u8]| exchange_with(req, REQUEST_DEADLINE, true, token);
        let ok = ask(b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer tok3n\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with("vrdma_up 1\n"), "{ok}");
        for req in [
            &b"GET /metrics HTTP/1.1\r\n\r\n"[..],
            b"HEAD /metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer tok3m\r\n\r\n",
        ] {
            let out = ask(req);
            assert!(out.starts_with("HTTP/1.1 401 Unauthorized\r\n"), "{out}");
            assert!(out.contains("WWW-Authenticate: Bearer"), "{out}");
            assert!(!out.contains("vrdma_up"), "{out}");
            // A HEAD's answer has no body, a 401 as a 200.
            assert_eq!(req.starts_with(b"HEAD"), out.ends_with("\r\n\r\n"), "{out}");
        }
        assert!(ask(b"GET /x HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
    }

    #[test]
    fn an_oversized_request_is_refused_without_reading_it_all() {
        let mut req = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        req.resize(MAX_REQUEST * 4, b'a');
        let out = exchange(&req, REQUEST_DEADLINE, false);
        assert!(out.starts_with("HTTP/1.1 431"), "{out}");
    }

    #[test]
    fn a_client_that_never_finishes_its_request_is_cut_off_at_the_deadline() {
        // Sends part of a head and waits: the server gives up by itself.
        let out = exchange(b"GET /metrics HTTP/1.1\r\nHost", Duration::from_millis(300), true);
        assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    }
}
