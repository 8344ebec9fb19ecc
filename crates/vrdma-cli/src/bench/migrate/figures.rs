//! The rows of `vrdma bench --migrate` from the hops' measurements: what
//! each hop measured, B's throughput dip around it, and the figures with
//! their anchors. No I/O: the hops' times in, the rows out.
//!
//! The anchor of QEMU's own figures is the same VM's migration with no
//! vRDMA context open in it (no daemon step), in the same run. The pause
//! B sees and the stream's lost time have no such twin (without traffic
//! there is nothing to pause), so they are read against the VM's stop
//! without vRDMA: QEMU's downtime plus its completion to `cont`, the
//! anchor hops' medians; B's steady rate is read against the stream's pace.

use std::time::{Duration, Instant};

use crate::bench::anchors::Stat;
use crate::bench::Figure;

/// One hop's times.
#[derive(Debug, Clone, Copy)]
pub struct Hop {
    /// QEMU's `downtime` (ms, `query-migrate`): the source stopped to the
    /// migration's end.
    pub qemu_ms: f64,
    /// When QEMU's `migrate` was sent (the destination already waiting).
    pub start: Instant,
    /// When QEMU's completion was seen (polling `query-migrate`).
    pub completed: Instant,
    /// When the destination's `cont` was answered.
    pub resumed: Instant,
}

impl Hop {
    /// QEMU's completion to the destination's `cont` (ms): what the
    /// operator's step adds to the VM's stop.
    pub fn to_cont_ms(self) -> f64 {
        ms(self.resumed.saturating_duration_since(self.completed))
    }
}

/// A hop with traffic: its times and where B's steady window before it began.
#[derive(Debug, Clone, Copy)]
pub struct BusyHop {
    pub hop: Hop,
    pub steady_from: Instant,
}

/// B's throughput around one hop, against its steady rate before.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dip {
    /// Messages per second in the steady window.
    pub rate: f64,
    /// Messages missing in the window around the hop at that rate.
    pub missing: f64,
    /// The longest gap between two messages around the hop (ms), from the
    /// last message before the window to the first after it.
    pub gap_ms: f64,
}

impl Dip {
    /// The missing messages as the stream's time at the steady rate (ms).
    pub fn lost_ms(&self) -> f64 {
        self.missing / self.rate * 1e3
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// B's dip: `arrived` (sorted) counted in `[steady_from, start)` and in
/// `[start, end)`; `None` where a window is empty or reversed.
pub fn dip(arrived: &[Instant], steady_from: Instant, start: Instant, end: Instant) -> Option<Dip> {
    let at = |t: Instant| arrived.partition_point(|&a| a < t);
    let (s0, s1, e) = (at(steady_from), at(start), at(end));
    let steady = start.checked_duration_since(steady_from)?.as_secs_f64();
    let around = end.checked_duration_since(start)?.as_secs_f64();
    if s1 <= s0 || steady <= 0.0 || around <= 0.0 {
        return None;
    }
    let rate = (s1 - s0) as f64 / steady;
    let missing = rate * around - (e - s1) as f64;
    let lo = s1.checked_sub(1)?;
    let hi = e.min(arrived.len().checked_sub(1)?);
    let gap = arrived.get(lo..=hi)?.windows(2).map(|p| p[1] - p[0]).max()?;
    Some(Dip { rate, missing, gap_ms: ms(gap) })
}

/// The pause B saw around `at`: from its last message before to its
/// first after.
pub fn pause_around(arrived: &[Instant], at: Instant) -> Option<Duration> {
    let k = arrived.partition_point(|&t| t < at);
    Some(*arrived.get(k)? - arrived[k.checked_sub(1)?])
}

/// What the rows are read against, and where.
pub struct Context<'a> {
    /// The accelerator's name (`kvm`, `tcg`).
    pub accel: &'a str,
    pub cores: usize,
    /// The stream's pace (µs between posts).
    pub pace_us: u32,
    /// How long after the destination's `cont` the window around a hop ends.
    pub around_after: Duration,
}

/// The rows: QEMU's downtime and its completion to `cont` with traffic
/// and the daemon step beside the anchor hops; the pause B saw, the
/// stream's lost time and the longest gap beside the VM's stop without
/// vRDMA; B's steady rate beside the stream's pace. A row whose hops
/// measured nothing is left out (the caller says why).
pub fn rows(idle: &[Hop], busy: &[BusyHop], arrived: &[Instant], cx: &Context) -> Vec<Figure> {
    let kvm = cx.accel == "kvm";
    let target = |goal: &str| {
        if kvm {
            goal.to_string()
        } else {
            format!("{goal} under KVM; {}: functional, not comparable", cx.accel)
        }
    };
    let idle_qemu = Stat::from_samples(&idle.iter().map(|h| h.qemu_ms).collect::<Vec<_>>());
    let idle_cont = Stat::from_samples(&idle.iter().copied().map(Hop::to_cont_ms).collect::<Vec<_>>());
    let idle_stop = Stat::from_samples(&idle.iter().map(|h| h.qemu_ms + h.to_cont_ms()).collect::<Vec<_>>());
    let busy_qemu = Stat::from_samples(&busy.iter().map(|b| b.hop.qemu_ms).collect::<Vec<_>>());
    let busy_cont = Stat::from_samples(&busy.iter().map(|b| b.hop.to_cont_ms()).collect::<Vec<_>>());
    let pauses: Vec<f64> =
        busy.iter().filter_map(|b| pause_around(arrived, b.hop.completed)).map(ms).collect();
    let dips: Vec<Dip> = busy
        .iter()
        .filter_map(|b| dip(arrived, b.steady_from, b.hop.start, b.hop.resumed + cx.around_after))
        .collect();
    let name = |what: &str| format!("VM migration ({}): {what}", cx.accel);
    let no_vrdma = "the same VM without vRDMA traffic, same run";
    let stop = "the VM's stop without vRDMA (QEMU's downtime + completion to cont), same run";
    let mut out = Vec::new();
    let mut push = |what: &str, value: Stat, anchor_name: &str, anchor: Stat, goal: String| {
        if value.runs > 0 && anchor.runs > 0 {
            out.push(Figure::beside(name(what), "ms", value, anchor_name, anchor, goal, cx.cores));
        }
    };
    push("QEMU's own downtime (query-migrate)", busy_qemu, no_vrdma, idle_qemu, "about 1x".into());
    push(
        "QEMU's completion to the destination's cont (the daemon step)",
        busy_cont,
        no_vrdma,
        idle_cont,
        target("at most +50 ms"),
    );
    // The added time itself, beside the anchor's whole stop.
    let added: Vec<f64> = busy.iter().map(|b| b.hop.to_cont_ms() - idle_cont.median).collect();
    push(
        "time the daemon step adds before cont",
        Stat::from_samples(&added),
        stop,
        idle_stop,
        target("<= 50 ms"),
    );
    push(
        "the pause B saw (last message before to first after)",
        Stat::from_samples(&pauses),
        stop,
        idle_stop,
        target("about 1x"),
    );
    push(
        "B's throughput dip: the stream's time missing around a hop",
        Stat::from_samples(&dips.iter().map(Dip::lost_ms).collect::<Vec<_>>()),
        stop,
        idle_stop,
        target("about 1x"),
    );
    push(
        "B's longest gap between two messages around a hop",
        Stat::from_samples(&dips.iter().map(|d| d.gap_ms).collect::<Vec<_>>()),
        stop,
        idle_stop,
        target("about 1x"),
    );
    let rate = Stat::from_samples(&dips.iter().map(|d| d.rate).collect::<Vec<_>>());
    if rate.runs > 0 {
        let pace = 1e6 / f64::from(cx.pace_us.max(1));
        let pace = Stat { median: pace, min: pace, max: pace, runs: 1 };
        let anchor = format!("the stream's pace (one message every {} us)", cx.pace_us);
        out.push(Figure::beside(
            name("B's steady message rate before a hop"),
            "msg/s",
            rate,
            anchor,
            pace,
            target("about 1x"),
            cx.cores,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    #[test]
    fn a_dip_counts_the_messages_missing_around_a_hop_at_the_steady_rate() {
        let t = Instant::now();
        // 100/s for a second, a 300 ms gap, then 100/s again.
        let mut arrived: Vec<Instant> = (0..100).map(|k| at(t, k * 10)).collect();
        arrived.extend((0..70).map(|k| at(t, 1300 + k * 10)));
        let d = dip(&arrived, t, at(t, 1000), at(t, 2000)).unwrap();
        assert!((d.rate - 100.0).abs() < 1e-9, "{d:?}");
        assert!((d.missing - 30.0).abs() < 1e-9, "{d:?}");
        assert!((d.lost_ms() - 300.0).abs() < 1e-6, "{d:?}");
        assert!((d.gap_ms - 310.0).abs() < 1e-6, "{d:?}");
        assert_eq!(pause_around(&arrived, at(t, 1100)), Some(Duration::from_millis(310)));
        // Empty or reversed windows measure nothing.
        assert_eq!(dip(&arrived, at(t, 1000), at(t, 1000), at(t, 2000)), None);
        assert_eq!(dip(&[], t, at(t, 1000), at(t, 2000)), None);
        assert_eq!(pause_around(&arrived, t), None);
    }

    #[test]
    fn the_rows_read_the_busy_hops_against_the_anchor_hops_of_the_same_run() {
        let t = Instant::now();
        let hop = |start: u64, qemu_ms: f64, cont: u64| Hop {
            qemu_ms,
            start: at(t, start),
            completed: at(t, start + 100),
            resumed: at(t, start + 100 + cont),
        };
        let idle = [hop(0, 80.0, 4), hop(0, 90.0, 6), hop(0, 100.0, 5)];
        let arrived: Vec<Instant> =
            (0..400).map(|k| at(t, k * 10)).filter(|&a| a < at(t, 2100) || a >= at(t, 2400)).collect();
        let busy = [BusyHop { hop: hop(2000, 60.0, 35), steady_from: at(t, 0) }];
        let cx =
            Context { accel: "tcg", cores: 2, pace_us: 10_000, around_after: Duration::from_millis(500) };
        let rows = rows(&idle, &busy, &arrived, &cx);
        let row =
            |what: &str| rows.iter().find(|f| f.name.contains(what)).unwrap_or_else(|| panic!("{what}"));
        let q = row("QEMU's own downtime");
        assert_eq!((q.value.median, q.anchor.unwrap().median), (60.0, 90.0));
        assert!((q.ratio.unwrap() - 60.0 / 90.0).abs() < 1e-9);
        let c = row("completion to the destination's cont");
        assert!((c.value.median - 35.0).abs() < 1e-6 && (c.anchor.unwrap().median - 5.0).abs() < 1e-6);
        assert!((row("adds before cont").value.median - 30.0).abs() < 1e-6);
        assert!((row("the pause B saw").value.median - 310.0).abs() < 1e-6);
        assert!(row("the pause B saw").target.contains("tcg: functional, not comparable"));
        assert!((row("steady message rate").value.median - 100.0).abs() < 1e-6);
        // No busy hop: only what the anchor alone cannot make is left out.
        assert!(super::rows(&idle, &[], &arrived, &cx).is_empty());
    }
}
