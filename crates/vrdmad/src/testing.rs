//! What the daemon's unit tests share.

use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use vrdma_core::hca::KeySource;
use vrdma_core::verbs::Gid;

use crate::net::{identity, NetSetup};

/// Memory keys from a counter.
pub(crate) struct Keys(pub u32);

impl KeySource for Keys {
    fn next_key(&mut self) -> u32 {
        self.0 += 1;
        self.0
    }
}

/// The transport setup of a daemon at `ip` (listening nowhere real).
pub(crate) fn setup(ip: [u8; 4], max_chunk: u32) -> NetSetup {
    NetSetup {
        identity: identity(1, Gid::from_ipv4(ip), 1, max_chunk, vec![7; 16]),
        listen: "127.0.0.1:0".parse().unwrap(),
        port: 4791,
        peers: Vec::new(),
        allow: Vec::new(),
        keepalive: Duration::from_secs(1),
        dead: Duration::from_secs(3),
        max_queued: crate::net::DEFAULT_MAX_QUEUED_KIB as usize * 1024,
        latency_first: true,
    }
}

/// Both ends of a loopback TCP connection: ours, then the peer's.
pub(crate) fn loopback() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let theirs = l.accept().unwrap().0;
    (ours, theirs)
}

/// The log lines of `f`, at info level and above.
pub(crate) fn traced(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Lines {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let lines = Lines::default();
    let out = lines.clone();
    let sub = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || out.clone())
        .finish();
    tracing::subscriber::with_default(sub, || {
        // Other tests' threads may have met the callsites first, while
        // no subscriber wanted them, and cached that: ask again.
        tracing::callsite::rebuild_interest_cache();
        f()
    });
    let b = lines.0.lock().unwrap().clone();
    String::from_utf8(b).unwrap()
}
