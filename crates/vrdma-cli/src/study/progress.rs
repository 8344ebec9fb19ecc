//! Progress while the study runs: a bar over the estimated work (each
//! step weighs what it is expected to take, so the time left is
//! meaningful across steps of very different lengths), with indicatif's
//! estimate of the time left; without a terminal, one line per step.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

pub struct Progress {
    bar: Option<ProgressBar>,
    /// Estimated milliseconds of all steps, and of those done.
    total_ms: u64,
    done_ms: u64,
    started: Instant,
    steps: usize,
    step: usize,
}

impl Progress {
    /// `total` is the sum of the steps' estimates; `steps` their number.
    pub fn new(total: Duration, steps: usize) -> Progress {
        let total_ms = total.as_millis().max(1) as u64;
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::new(total_ms);
            let style = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] [{bar:30.cyan/blue}] {percent:>3}% (about {eta} left) {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            b.set_style(style);
            b.enable_steady_tick(Duration::from_millis(200));
            b
        });
        Progress { bar, total_ms, done_ms: 0, started: Instant::now(), steps, step: 0 }
    }

    /// A step starts.
    pub fn start(&mut self, what: &str) {
        self.step += 1;
        let msg = format!("[{}/{}] {what}", self.step, self.steps);
        match &self.bar {
            Some(b) => b.set_message(msg),
            None => eprintln!("vrdma study: {msg} (about {} left)", fmt_duration(self.left())),
        }
    }

    /// The step estimated at `estimate` is done.
    pub fn done(&mut self, estimate: Duration) {
        self.done_ms = (self.done_ms + estimate.as_millis() as u64).min(self.total_ms);
        if let Some(b) = &self.bar {
            b.set_position(self.done_ms);
        }
    }

    /// A line above the bar.
    pub fn note(&self, line: &str) {
        match &self.bar {
            Some(b) => b.println(line),
            None => eprintln!("vrdma study: {line}"),
        }
    }

    /// The time left: the estimate of the remaining steps, scaled by how
    /// fast the work went so far, trusted in proportion to the share done.
    fn left(&self) -> Duration {
        let remaining = (self.total_ms - self.done_ms) as f64 / 1e3;
        if self.done_ms == 0 {
            return Duration::from_secs_f64(remaining);
        }
        let speed = self.started.elapsed().as_secs_f64() / (self.done_ms as f64 / 1e3);
        let w = self.done_ms as f64 / self.total_ms as f64;
        Duration::from_secs_f64(remaining * (w * speed + (1.0 - w)))
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

pub fn fmt_duration(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}
