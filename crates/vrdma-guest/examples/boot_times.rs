//! Boot times of test guests: `cargo run -p vrdma-guest --example
//! boot_times [N]` boots a bare image (busybox and the modules only, the
//! anchor) and the full one the plumbing tests use (plus the project's
//! binary and drop-in libraries and Debian's verbs tools) N times each
//! (default 3), alternating, and prints the medians from starting QEMU
//! to the guest's shell, and their ratio.

use std::time::Duration;

use vrdma_guest::{cache, image, DropIn, Guest, GuestSpec, ImageSpec};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::args().nth(1).map(|a| a.parse()).transpose()?.unwrap_or(3).clamp(1, 20);
    let bare = image::build(&ImageSpec::default())?;
    let profile = cache::profile_dir().ok_or("no cargo profile directory")?;
    let full = image::build(
        &ImageSpec::default().with_drop_in(DropIn::from_profile_dir(&profile)?).debian_tools()?,
    )?;
    let size = |i: &vrdma_guest::Image| std::fs::metadata(&i.initramfs).map(|m| m.len() >> 20).unwrap_or(0);
    let (mut tb, mut tf) = (Vec::new(), Vec::new());
    let mut accel = None;
    for _ in 0..n {
        for (img, times) in [(&bare, &mut tb), (&full, &mut tf)] {
            let g = Guest::boot(GuestSpec::new(img.clone()))?;
            accel = Some(g.accel());
            times.push(g.boot_time());
        }
    }
    let (mb, mf) = (median(tb.clone()), median(tf.clone()));
    println!("accelerator: {}", accel.map(|a| a.name()).unwrap_or("?"));
    println!(
        "bare image ({} MiB initramfs), anchor: median {:.2} s of {tb:.2?}",
        size(&bare),
        mb.as_secs_f64()
    );
    println!("full image ({} MiB initramfs): median {:.2} s of {tf:.2?}", size(&full), mf.as_secs_f64());
    println!("ratio full/bare: {:.2}", mf.as_secs_f64() / mb.as_secs_f64());
    Ok(())
}
