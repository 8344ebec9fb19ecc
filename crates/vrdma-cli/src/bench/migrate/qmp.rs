//! A QMP client for the bench's QEMUs (`-qmp unix:PATH,server=on,wait=off`):
//! a command, its answer (events skipped), every read bounded.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};

pub struct Qmp {
    w: UnixStream,
    r: BufReader<UnixStream>,
}

impl Qmp {
    /// Connects (retrying for up to 30 s while QEMU starts), reads the
    /// greeting, and enters command mode.
    pub fn connect(path: &Path) -> Result<Qmp> {
        let end = Instant::now() + Duration::from_secs(30);
        let s = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() > end => {
                    return Err(e).context(format!("QMP at {}", path.display()))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut q = Qmp { w: s.try_clone()?, r: BufReader::new(s) };
        let mut greeting = String::new();
        q.r.read_line(&mut greeting).context("QMP's greeting")?;
        if !greeting.contains("QMP") {
            bail!("QMP said {greeting:?}");
        }
        q.exec(r#"{"execute":"qmp_capabilities"}"#)?;
        Ok(q)
    }

    /// Sends `cmd`, returns its answer's `return`; an `error` is an error.
    pub fn exec(&mut self, cmd: &str) -> Result<serde_json::Value> {
        writeln!(self.w, "{cmd}").with_context(|| format!("QMP {cmd}"))?;
        for _ in 0..1000 {
            let mut l = String::new();
            if self.r.read_line(&mut l).with_context(|| format!("QMP, after {cmd}"))? == 0 {
                bail!("QMP closed after {cmd}");
            }
            let v: serde_json::Value = serde_json::from_str(&l).with_context(|| format!("QMP said {l}"))?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if v.get("error").is_some() {
                bail!("QMP {cmd}: {}", l.trim());
            }
        }
        Err(anyhow!("no answer to QMP {cmd}"))
    }

    pub fn status(&mut self) -> Result<String> {
        Ok(self.exec(r#"{"execute":"query-status"}"#)?["status"].as_str().unwrap_or("?").to_string())
    }

    /// Starts QEMU's migration to `uri`.
    pub fn migrate(&mut self, uri: &str) -> Result<()> {
        self.exec(&serde_json::json!({"execute": "migrate", "arguments": {"uri": uri}}).to_string())?;
        Ok(())
    }

    /// Polls `query-migrate` (every 10 ms, at most 240 s) until it neither
    /// sets up nor runs; its last answer, an error unless it completed.
    pub fn wait_completed(&mut self) -> Result<serde_json::Value> {
        let end = Instant::now() + Duration::from_secs(240);
        loop {
            let m = self.exec(r#"{"execute":"query-migrate"}"#)?;
            match m["status"].as_str() {
                Some("completed") => return Ok(m),
                Some("active" | "setup" | "device" | "pre-switchover") | None => {}
                Some(_) => bail!("QEMU's migration: {m}"),
            }
            if Instant::now() > end {
                bail!("QEMU's migration did not complete within 240 s: {m}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits (at most 60 s) until a QEMU started with `-incoming` loaded the VM.
    pub fn wait_loaded(&mut self) -> Result<()> {
        let end = Instant::now() + Duration::from_secs(60);
        while self.status()? == "inmigrate" {
            if Instant::now() > end {
                bail!("the destination QEMU did not finish loading the VM within 60 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }
}
