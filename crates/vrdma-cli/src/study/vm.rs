//! The vm placement: VM to VM on one host, through the host's daemon.
//!
//! One daemon whose config has two VMs per tenant (`[vms.sI]`, the
//! sender, and `[vms.rI]`, the receiver, both `tenant =` tenant I's uid,
//! so that the pair's QPs may connect); every VM is booted once per study
//! with `vrdma vm run` (the image of `vrdma vm image`, QEMU's accelerator
//! chosen as the guest tests choose it) and serves every cell and run.
//! The two VMs of a pair are joined by a virtual link of QEMU's own, a
//! `-netdev stream` over a Unix socket in the study's work directory (no
//! host interface, bridge or tap), with static addresses 10.79.I.1 and
//! 10.79.I.2 set over the boot harness's port; the tools exchange their
//! QP numbers and the TCP figures travel over it, the verbs traffic goes
//! through the VMs' regions and the daemon.
//!
//! Every program in a guest runs under the guest's `timeout` and the
//! harness's deadline; the guests' QEMUs are killed by pid when the site
//! drops (before its daemon).

use std::ffi::OsString;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use vrdma_guest::{Accel, Guest, GuestSpec};

use super::anchors;
use super::data::{Record, Section};
use super::placement::{daemon, Env};
use super::plan::{Placement, Plan, Protocol, FIRST_UID};
use super::proc::Proc;
use super::run::{self, State};

/// The port of every receiver's `vrdma bench --server`.
const BENCH_PORT: u16 = 19765;
/// The anchors' ports in the receivers.
const QPERF_PORT: u16 = 19766;
const PERFTEST_PORT: u16 = 19767;
const IPERF3_PORT: u16 = 19768;
/// A guest's memory (MiB): the kernel, the initramfs (tens of MiB) and
/// the tools; small, as many guests run at once.
const GUEST_MIB: u32 = 320;
/// Each VM's shared region (MiB): the rings and the registered buffers
/// of a `vrdma bench` or perftest (64 KiB messages, a few dozen in flight).
const REGION_MIB: u32 = 64;
/// The limit of a short guest command (setting an address, a check).
const SHORT: Duration = Duration::from_secs(60);
/// Anchors in the image when the host has them.
const ANCHOR_TOOLS: [&str; 4] = ["qperf", "ib_write_bw", "ib_write_lat", "iperf3"];

/// A VM pair: tenant I's sender and receiver.
struct Pair {
    send: Guest,
    recv: Guest,
    /// The sender's and the receiver's addresses on their link.
    addr: [Ipv4Addr; 2],
}

/// The placement set up: guests (dropped, so killed, first), then the daemon.
pub struct VmSite {
    pairs: Vec<Pair>,
    pub accel: Accel,
    pub description: String,
    /// Tools the image holds for the anchors.
    tools: Vec<&'static str>,
    daemon: Proc,
    /// The daemon's control socket.
    socket: PathBuf,
}

impl VmSite {
    /// Builds the image (with the anchors' tools if `anchors`), starts
    /// the daemon and boots a VM pair per tenant uid of `uids`.
    pub fn setup(env: &Env, uids: &[u32], anchors: bool, notes: &mut Vec<String>) -> Result<VmSite> {
        let started = Instant::now();
        let pairs = uids.len() as u32;
        if pairs == 0 {
            bail!("no VM pair to boot");
        }
        let (image, tools) = image(anchors, notes)?;
        let sock = env.dir.join("vm.sock");
        let mut toml = String::new();
        for (i, uid) in uids.iter().enumerate() {
            for side in ["s", "r"] {
                toml += &format!("[vms.{side}{i}]\ntenant = {uid}\nmemory_mib = {REGION_MIB}\nports = 4\n");
            }
        }
        let mut daemon = daemon(env, "vm", &sock, None, &toml)?;
        let mut booted: Vec<Result<Pair>> = Vec::new();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..pairs)
                .map(|i| {
                    let (image, sock) = (&image, &sock);
                    s.spawn(move || boot_pair(env, image, sock, i))
                })
                .collect();
            for h in handles {
                booted.push(h.join().unwrap_or_else(|_| Err(anyhow!("a boot thread panicked"))));
            }
        });
        let pairs: Vec<Pair> = booted.into_iter().collect::<Result<_>>()?;
        if !daemon.running() {
            bail!("the daemon exited while the VMs booted; {}", daemon.log_tail());
        }
        let accel = pairs[0].send.accel();
        let boot = pairs
            .iter()
            .flat_map(|p| [p.send.boot_time(), p.recv.boot_time()])
            .max()
            .unwrap_or_default()
            .as_secs_f64();
        let mut description = format!(
            "one daemon; {} VM pairs (QEMU, accelerator {}, kernel {}, {GUEST_MIB} MiB and a {REGION_MIB} MiB \
             region each); pair I (from 0) is tenant I+1's sender VM sI and receiver VM rI, joined by a QEMU \
             -netdev stream link of their own (10.79.I.1 and 10.79.I.2); booted once, the slowest in {boot:.1} \
             s, set up in {:.1} s",
            pairs.len(),
            accel.name(),
            pairs[0].send.release(),
            started.elapsed().as_secs_f64()
        );
        if accel == Accel::Tcg {
            description += ". TCG (QEMU's emulator, where KVM does not work): every guest instruction is \
                            emulated, so these figures are functional, not comparable with the host's (and a four-tenant \
                            cell, spanning the first start to the last end, reads far below the sum of its tenants' \
                            rates: a client's start in an emulated guest takes seconds, and the tenants' starts drift \
                            apart)";
        }
        let mut site = VmSite { pairs, accel, description, tools, daemon, socket: sock };
        site.start()?;
        Ok(site)
    }

    /// Links the pairs, checks their data path, and starts the bench servers.
    fn start(&mut self) -> Result<()> {
        let has_pingpong = self.tools.contains(&"ibv_rc_pingpong");
        let checked: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> =
                self.pairs.iter_mut().map(|p| s.spawn(move || p.start(has_pingpong))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a pair's thread panicked"))))
                .collect()
        });
        for (i, r) in checked.into_iter().enumerate() {
            r.with_context(|| format!("VM pair {}", i + 1))?;
        }
        if has_pingpong {
            self.description +=
                "; before the cells, `ibv_rc_pingpong -c` (data validated) passed between every pair";
        }
        Ok(())
    }

    /// The daemon's control socket (host processes beside the VMs use it).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `vrdma bench` in pair `pair`'s sender against its receiver's
    /// server with `args` (tests and options): its `--json` output.
    pub fn bench(&mut self, pair: usize, args: &str, limit: Duration) -> Result<String> {
        let p = self.pairs.get_mut(pair).ok_or_else(|| anyhow!("no VM pair {pair}"))?;
        let cmd = format!("vrdma bench {}:{BENCH_PORT} {args} --json", p.addr[1]);
        guest_tool(&mut p.send, "bench", &cmd, limit)
    }

    /// Whether the daemon still runs.
    pub fn alive(&mut self) -> bool {
        self.daemon.running()
    }

    /// One run of a transfer cell: tenants `0..n` at once, each from its
    /// sender VM to its receiver VM.
    pub fn transfer(&mut self, plan: &Plan, proto: Protocol, n: u32, run: u32) -> Result<Vec<Record>> {
        let args = run::transfer_args(plan, proto, n).join(" ");
        // At 2 MB/s (far below what even TCG moves) plus the starts.
        let limit = Duration::from_secs(90 + plan.bytes / 2_000_000);
        let have = self.pairs.len();
        let pairs = self
            .pairs
            .get_mut(..n as usize)
            .ok_or_else(|| anyhow!("{n} tenants, but only {have} VM pairs"))?;
        let outs: Vec<Result<run::TenantResult>> = std::thread::scope(|s| {
            let handles: Vec<_> = pairs
                .iter_mut()
                .map(|p| {
                    let cmd = format!("vrdma bench {}:{BENCH_PORT} {args} --json", p.addr[1]);
                    s.spawn(move || {
                        let out = guest_tool(&mut p.send, "bench", &cmd, limit)?;
                        run::transfer_result(&out, Instant::now())
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a thread panicked"))))
                .collect()
        });
        let per = outs.into_iter().collect::<Result<Vec<_>>>()?;
        Ok(run::transfer_records(Placement::Vm, proto, n, plan.message_size, run, &per))
    }

    /// One run of the latency and bandwidth set, in pair 1.
    pub fn set(&mut self, plan: &Plan, run: u32) -> Result<Vec<Record>> {
        let (lat, bw) = run::set_args(plan);
        let limit = Duration::from_secs_f64(120.0 + 6.0 * plan.set_seconds);
        let p = &mut self.pairs[0];
        let server = format!("{}:{BENCH_PORT}", p.addr[1]);
        let lat_out = guest_tool(
            &mut p.send,
            "set-lat",
            &format!("vrdma bench {server} {} --json", lat.join(" ")),
            limit,
        )?;
        let bw_out = guest_tool(
            &mut p.send,
            "set-bw",
            &format!("vrdma bench {server} {} --json", bw.join(" ")),
            limit,
        )?;
        run::set_records(Placement::Vm, run, &lat_out, &bw_out)
    }

    /// The anchors of one run between pair 1's VMs, as the other
    /// placements run them: each a (what, its records) for the report.
    pub fn anchors(&mut self, plan: &Plan, run: u32) -> Vec<(String, Result<Vec<Record>>)> {
        let size = plan.message_size;
        let secs = format!("{:.0}", plan.set_seconds.ceil().max(1.0));
        let rec = |section, proto, tenants, tool, test: &str, size, value, unit| {
            run::anchor_record(Placement::Vm, run, section, proto, tenants, tool, test, size, value, unit)
        };
        let has = |t: &str| self.tools.contains(&t);
        let (qperf, iperf3, perftest) =
            (has("qperf"), has("iperf3"), has("ib_write_bw") && has("ib_write_lat"));
        let mut out = Vec::new();
        let p = &mut self.pairs[0];
        let peer = p.addr[1];
        if qperf {
            for (test, section, sz, unit) in
                [("tcp_lat", Section::Latency, 8, "us"), ("tcp_bw", Section::Bandwidth, size, "GB/s")]
            {
                let client = format!("qperf {peer} -lp {QPERF_PORT} -t {secs} -m {sz} {test}");
                let r = p
                    .pair_tool("qperf", &format!("qperf -lp {QPERF_PORT}"), QPERF_PORT, &client, false)
                    .and_then(|o| anchors::qperf_value(&o))
                    .map(|v| vec![rec(section, Protocol::Tcp, 1, "qperf", test, sz, v, unit)]);
                out.push((format!("vm qperf {test} run {run}"), r));
            }
        }
        if iperf3 {
            for n in plan.concurrency() {
                let server = format!("iperf3 -s -1 -B {peer} -p {IPERF3_PORT}");
                let client = format!("iperf3 -c {peer} -p {IPERF3_PORT} -J -n {} -P {n}", plan.bytes);
                let test = format!("iperf3 -P {n}");
                let r = p
                    .pair_tool("iperf3", &server, IPERF3_PORT, &client, true)
                    .and_then(|o| anchors::iperf3_value(&o))
                    .map(|v| vec![rec(Section::Transfer, Protocol::Tcp, n, "iperf3", &test, 0, v, "GB/s")]);
                out.push((format!("vm {test} run {run}"), r));
            }
        }
        if perftest {
            let lat_iters = if plan.quick { 1000 } else { 10_000 };
            for (tool, section, sz, iters, unit) in [
                ("ib_write_bw", Section::Transfer, size, (plan.bytes / size).max(1), "GB/s"),
                ("ib_write_lat", Section::Latency, 8, lat_iters, "us"),
            ] {
                let common = format!("-d vrdma0 -p {PERFTEST_PORT} -s {sz} -n {iters}");
                let r = p
                    .pair_tool(
                        tool,
                        &format!("{tool} {common}"),
                        PERFTEST_PORT,
                        &format!("{tool} {common} {peer}"),
                        true,
                    )
                    .and_then(|o| anchors::perftest_value(tool, &o))
                    .map(|v| vec![rec(section, Protocol::Vrdma, 1, "perftest", tool, sz, v, unit)]);
                out.push((format!("vm {tool} run {run}"), r));
            }
        }
        out
    }
}

impl Pair {
    /// Gives both VMs their link addresses, checks the link, validates
    /// data with `ibv_rc_pingpong -c` (where the image has it), and
    /// starts the receiver's `vrdma bench --server`.
    fn start(&mut self, pingpong: bool) -> Result<()> {
        for (g, a) in [(&mut self.send, self.addr[0]), (&mut self.recv, self.addr[1])] {
            let script = format!(
                "n=; for d in /sys/class/net/*; do [ \"${{d##*/}}\" = lo ] || {{ n=${{d##*/}}; break; }}; done; \
                 [ -n \"$n\" ] || {{ echo 'no NIC'; exit 1; }}; ip addr flush dev $n && ip addr add {a}/24 dev $n \
                 && ip link set $n up"
            );
            g.check(&script, SHORT).with_context(|| format!("setting {a} in the guest"))?;
        }
        let peer = self.addr[1];
        let ping = format!(
            "i=0; while [ $i -lt 30 ]; do ping -c 1 -W 1 {peer} >/dev/null 2>&1 && exit 0; i=$((i+1)); done; \
             echo 'no answer from {peer} over the VM link'; exit 1"
        );
        self.send.check(&ping, Duration::from_secs(90))?;
        if pingpong {
            let port = PERFTEST_PORT;
            let common = format!("ibv_rc_pingpong -c -n 20 -p {port}");
            let out = self.pair_tool("pingpong", &common, port, &format!("{common} {peer}"), true)?;
            if !out.contains(" iters in ") {
                bail!("ibv_rc_pingpong -c between the pair's VMs printed no figures:\n{out}");
            }
        }
        let server = format!("vrdma bench --server --listen {peer}:{BENCH_PORT}");
        background(&mut self.recv, "bench-server", 24 * 3600, &server)?;
        listening(&mut self.recv, "bench-server", BENCH_PORT)?;
        Ok(())
    }

    /// A server in the receiver (in the background, waited for to listen
    /// on `port`), then a client in the sender: the client's output. A
    /// `once` server ends by itself and must exit 0; another is killed.
    fn pair_tool(&mut self, tag: &str, server: &str, port: u16, client: &str, once: bool) -> Result<String> {
        let limit = Duration::from_secs(300);
        background(&mut self.recv, tag, 280, server)?;
        listening(&mut self.recv, tag, port)?;
        let out = guest_tool(&mut self.send, tag, client, limit);
        let (st, server_out) = if once && out.is_ok() {
            wait(&mut self.recv, tag)?
        } else {
            // Killed by its pid (a server whose client failed too), and
            // gone (its port free) before the next.
            let kill = format!(
                "p=$(cat /tmp/{tag}.pid); kill $p 2>/dev/null; i=0; \
                 while kill -0 $p 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; \
                 cat /tmp/{tag}.out"
            );
            (0, self.recv.run(&kill, SHORT)?.1)
        };
        let out = out.with_context(|| format!("the server in the receiver said:\n{}", tail(&server_out)))?;
        if st != 0 {
            bail!("{server} in the receiver VM exited with {st}:\n{server_out}");
        }
        Ok(out)
    }
}

/// The guest image for the study: this build's vrdma and drop-in
/// libraries, `ibv_rc_pingpong` for the data check and the anchors'
/// tools the host has (noted when it lacks one).
fn image(anchors: bool, notes: &mut Vec<String>) -> Result<(vrdma_guest::Image, Vec<&'static str>)> {
    let drop_in = vrdma_guest::DropIn {
        vrdma: std::env::current_exe().context("finding this executable")?,
        verbs: crate::cmd::run::find_library()?,
        rdmacm: crate::cmd::run::find_rdmacm()?,
        companions: crate::cmd::run::find_companions()?,
    };
    let mut spec = vrdma_guest::ImageSpec::default().with_drop_in(drop_in);
    let mut tools = Vec::new();
    let wanted: Vec<&'static str> =
        std::iter::once("ibv_rc_pingpong").chain(ANCHOR_TOOLS.iter().copied().filter(|_| anchors)).collect();
    for t in wanted {
        if vrdma_guest::libs::which(t).is_some() {
            spec = spec.program(t)?;
            tools.push(t);
        } else {
            notes.push(format!("{t} is not installed on the host, so not in the VMs' image: the vm placement runs without it"));
        }
    }
    let img = vrdma_guest::image::build(&spec).context("building the guest image (vrdma vm image)")?;
    Ok((img, tools))
}

/// Boots pair `i`: the receiver's QEMU listens on the link's socket, the
/// sender's connects to it once it is there.
fn boot_pair(env: &Env, image: &vrdma_guest::Image, sock: &Path, i: u32) -> Result<Pair> {
    let link = env.dir.join(format!("vm-link-{i}.sock"));
    let _ = std::fs::remove_file(&link);
    std::thread::scope(|s| {
        let recv = s.spawn(|| boot(env, image, sock, &format!("r{i}"), &link, true, i));
        let send = s.spawn(|| {
            let end = Instant::now() + Duration::from_secs(60);
            while !link.exists() {
                if Instant::now() > end {
                    bail!("the receiver's QEMU made no link socket {} within 60 s", link.display());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            boot(env, image, sock, &format!("s{i}"), &link, false, i)
        });
        let recv = recv.join().unwrap_or_else(|_| Err(anyhow!("a boot thread panicked")));
        let send = send.join().unwrap_or_else(|_| Err(anyhow!("a boot thread panicked")));
        let addr = [Ipv4Addr::new(10, 79, i as u8, 1), Ipv4Addr::new(10, 79, i as u8, 2)];
        Ok(Pair { send: send?, recv: recv?, addr })
    })
}

/// Boots VM `name` of the daemon at `sock` with `vrdma vm run`, its NIC
/// on the link socket `link` (listening or connecting).
fn boot(
    env: &Env,
    image: &vrdma_guest::Image,
    sock: &Path,
    name: &str,
    link: &Path,
    listen: bool,
    i: u32,
) -> Result<Guest> {
    let mut spec = GuestSpec::new(image.clone());
    spec.memory_mib = GUEST_MIB;
    spec.boot_timeout = Duration::from_secs(300);
    // Eight TCG guests booting at once on a loaded host miss the
    // kernel's early check of the timer interrupt ("IO-APIC + timer
    // doesn't work!", a panic); the timer works, the check is skipped.
    spec.append = "no_timer_check".into();
    // `env` and `vrdma vm run` exec: the pid is QEMU's. The run's
    // variable marks it as the study's, as every child of the study.
    let mut l: Vec<OsString> = vec!["env".into(), format!("{}={}", super::proc::RUN_ENV, env.run_id).into()];
    l.push(env.exe.into());
    l.extend(["--socket".into(), sock.into()]);
    l.extend(["vm", "run", name, "--"].map(OsString::from));
    spec.launcher = l;
    let path = link.to_str().ok_or_else(|| anyhow!("{} is not UTF-8", link.display()))?.replace(',', ",,");
    let server = if listen { "on" } else { "off" };
    spec.extra_args = [
        "-netdev".to_string(),
        format!("stream,id=vrdma-link,server={server},addr.type=unix,addr.path={path}"),
        "-device".into(),
        format!("virtio-net-pci,netdev=vrdma-link,mac=52:54:00:79:{i:02x}:{:02x}", u8::from(listen) + 1),
    ]
    .into_iter()
    .map(OsString::from)
    .collect();
    Guest::boot(spec).map_err(|e| anyhow!("booting VM {name}: {e}"))
}

/// Runs `cmd` in `g` under the guest's `timeout`, its stderr kept apart:
/// its stdout if it exited 0.
fn guest_tool(g: &mut Guest, tag: &str, cmd: &str, limit: Duration) -> Result<String> {
    let secs = limit.as_secs().saturating_sub(10).max(10);
    let script =
        format!("timeout {secs} {cmd} 2>/tmp/{tag}.err; st=$?; [ $st = 0 ] || cat /tmp/{tag}.err; exit $st");
    let (st, out) = g.run(&script, limit).map_err(|e| anyhow!("`{cmd}` in the guest: {e}"))?;
    if st != 0 {
        bail!("`{cmd}` exited with {st} in the guest:\n{}", tail(&out));
    }
    Ok(out)
}

/// Starts `cmd` in the background in `g` under `timeout secs`, its
/// output, pid and exit status under `/tmp/<tag>.*`.
fn background(g: &mut Guest, tag: &str, secs: u32, cmd: &str) -> Result<()> {
    let script = format!(
        "rm -f /tmp/{tag}.*; ( timeout {secs} {cmd} >/tmp/{tag}.out 2>&1 </dev/null & echo $! >/tmp/{tag}.pid; \
         wait $!; echo $? >/tmp/{tag}.st ) </dev/null >/dev/null 2>&1 &"
    );
    g.check(&script, SHORT).map(|_| ()).map_err(|e| anyhow!("starting `{cmd}` in the guest: {e}"))
}

/// Waits for `tag`'s background program in `g` to listen on TCP `port`.
fn listening(g: &mut Guest, tag: &str, port: u16) -> Result<()> {
    let script = format!(
        "i=0; while [ $i -lt 600 ]; do netstat -ltn | grep -q ':{port} ' && exit 0; \
         [ -e /tmp/{tag}.st ] && {{ echo ended; cat /tmp/{tag}.out; exit 1; }}; sleep 0.1; i=$((i+1)); done; \
         echo 'never listened'; cat /tmp/{tag}.out; exit 1"
    );
    g.check(&script, Duration::from_secs(120)).map(|_| ()).map_err(|e| anyhow!("{tag} in the guest: {e}"))
}

/// Waits for `tag`'s background program in `g` to end: its status and output.
fn wait(g: &mut Guest, tag: &str) -> Result<(i32, String)> {
    let script = format!(
        "i=0; while [ ! -e /tmp/{tag}.st ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; \
         cat /tmp/{tag}.out; [ -e /tmp/{tag}.st ] || {{ echo '(still running)'; exit 124; }}; exit $(cat /tmp/{tag}.st)"
    );
    g.run(&script, Duration::from_secs(120)).map_err(|e| anyhow!("{tag} in the guest: {e}"))
}

/// The end of a long output, for an error.
fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Runs the vm placement: its site, then per run its cells, set and
/// anchors, as `run::execute` runs the others'.
pub(super) fn placement(
    env: &Env,
    plan: &Plan,
    st: &mut State,
    progress: &mut super::progress::Progress,
    notes: &mut Vec<String>,
    sites: &mut Vec<(Placement, String)>,
) -> Option<Accel> {
    let est = Estimate::new(plan);
    progress.start("vm: building the image, booting the VMs");
    let uids: Vec<u32> = (0..plan.vm_pairs).map(|i| plan.uid(i).unwrap_or(FIRST_UID + i)).collect();
    let mut site = match VmSite::setup(env, &uids, plan.anchors, notes) {
        Ok(s) => s,
        Err(e) => {
            progress.note(&format!("placement vm could not be set up: {e:#}"));
            st.failures.push(super::data::Failure { what: "placement vm".into(), error: format!("{e:#}") });
            progress.done(est.total(plan));
            return None;
        }
    };
    sites.push((Placement::Vm, site.description.clone()));
    progress.done(est.setup);
    let anchor_runs = if plan.quick { 1 } else { plan.runs };
    for r in 1..=plan.runs {
        for &proto in &Protocol::ALL {
            for n in plan.vm_concurrency() {
                if run::interrupted() {
                    break;
                }
                progress.start(&format!("vm: {} x{n} run {r}/{}", proto.name(), plan.runs));
                let out = site.transfer(plan, proto, n, r);
                st.take(out, format!("vm {} x{n} run {r}", proto.name()), progress);
                progress.done(est.transfer);
            }
        }
        if run::interrupted() {
            break;
        }
        progress.start(&format!("vm: latency/bandwidth set run {r}/{}", plan.runs));
        let out = site.set(plan, r);
        st.take(out, format!("vm latency/bandwidth set run {r}"), progress);
        progress.done(est.set);
        if r <= anchor_runs && !run::interrupted() {
            progress.start(&format!("vm: anchors run {r}/{anchor_runs}"));
            for (what, out) in site.anchors(plan, r) {
                st.take(out, what, progress);
            }
            progress.done(est.anchors);
        }
    }
    if !site.alive() {
        st.failures.push(super::data::Failure {
            what: "placement vm".into(),
            error: "the daemon exited during the placement (see logs/)".into(),
        });
    }
    Some(site.accel)
}

/// What the vm placement's steps are expected to take (TCG).
pub(super) struct Estimate {
    pub setup: Duration,
    pub transfer: Duration,
    pub set: Duration,
    pub anchors: Duration,
}

impl Estimate {
    pub fn new(plan: &Plan) -> Estimate {
        let mb = plan.bytes as f64 / 1e6;
        Estimate {
            setup: Duration::from_secs_f64(20.0 + 8.0 * f64::from(plan.vm_pairs)),
            transfer: Duration::from_secs_f64(3.0 + mb / 100.0),
            set: Duration::from_secs_f64(6.0 + 6.0 * plan.set_seconds),
            anchors: Duration::from_secs_f64(15.0 + 3.0 * mb / 100.0),
        }
    }

    pub fn total(&self, plan: &Plan) -> Duration {
        let cells = (Protocol::ALL.len() * plan.vm_concurrency().len()) as u32;
        let anchor_runs = if plan.quick { 1 } else { plan.runs };
        self.setup + (self.transfer * cells + self.set) * plan.runs + self.anchors * anchor_runs
    }
}
