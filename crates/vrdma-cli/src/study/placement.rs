//! The host placements made real (the VMs' is `super::vm`): daemons, namespaces, and for every
//! tenant the place its sender and its receiver run in.
//!
//! - process: one daemon; both sides in this namespace, on 127.0.0.1.
//! - container: one daemon (its control socket is a file, reachable from
//!   every namespace); tenant i's sender and receiver each in a network
//!   namespace of their own, the two joined by a veth pair.
//! - hosts: two namespaces joined by veth, a daemon in each with the TCP
//!   transport on its veth address (peered with the other); every
//!   tenant's sender on host A, its receiver on host B.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

use super::netns::Namespaces;
use super::plan::{Placement, TENANTS};
use super::proc::{self, Proc, Where};

/// Where one side of a tenant's transfer runs.
#[derive(Debug, Clone)]
pub struct Place {
    pub netns: Option<PathBuf>,
    /// The control socket of the daemon it uses.
    pub socket: PathBuf,
    /// Its address (receivers listen on it, senders connect to it).
    pub addr: IpAddr,
}

impl Place {
    pub fn at(&self, uid: Option<u32>) -> Where {
        Where { netns: self.netns.clone(), uid }
    }
}

/// A placement set up; torn down on drop (processes first, then the
/// namespaces: fields drop in order).
pub struct Site {
    pub placement: Placement,
    /// Tenant i's sender and receiver (i < TENANTS).
    pub senders: Vec<Place>,
    pub receivers: Vec<Place>,
    pub description: String,
    daemons: Vec<Proc>,
    _ns: Namespaces,
}

/// What every placement needs from the run.
pub struct Env<'a> {
    pub exe: &'a Path,
    /// A directory every tenant uid can reach (sockets, configs).
    pub dir: &'a Path,
    pub logs: &'a Path,
    pub run_id: &'a str,
}

impl Site {
    pub fn setup(p: Placement, env: &Env) -> Result<Site> {
        let mut ns = Namespaces::default();
        let mut daemons = Vec::new();
        let (senders, receivers, description) = match p {
            Placement::Process => {
                let sock = env.dir.join("process.sock");
                daemons.push(daemon(env, "process", &sock, None, "")?);
                let place = Place { netns: None, socket: sock, addr: IpAddr::V4(Ipv4Addr::LOCALHOST) };
                let v = vec![place; TENANTS as usize];
                (v.clone(), v, "one daemon; both sides in the host's namespace on 127.0.0.1".to_string())
            }
            Placement::Container => {
                let sock = env.dir.join("container.sock");
                daemons.push(daemon(env, "container", &sock, None, "")?);
                let (mut s, mut r) = (Vec::new(), Vec::new());
                for i in 0..TENANTS {
                    let pair = ns.pair(&format!("c{i}"), 10 + i as u8)?;
                    let [pa, pb] = pair.path.clone();
                    s.push(Place { netns: Some(pa), socket: sock.clone(), addr: IpAddr::V4(pair.addr[0]) });
                    r.push(Place { netns: Some(pb), socket: sock.clone(), addr: IpAddr::V4(pair.addr[1]) });
                }
                let d = "one daemon in the host's namespace; each tenant's sender and receiver in a network \
                         namespace of its own, joined by a veth pair (10.78.1x.0/24)";
                (s, r, d.to_string())
            }
            Placement::Vm => bail!("the vm placement's VMs are set up by study::vm"),
            Placement::Hosts => {
                let (ds, places, pair) = host_pair(env, &mut ns, "h", 20, "host", "")?;
                daemons.extend(ds);
                let d = format!(
                    "two namespaces joined by veth ({} and {}), a daemon in each linked by the TCP transport; \
                     senders on host A, receivers on host B",
                    pair.addr[0], pair.addr[1]
                );
                (vec![places[0].clone(); TENANTS as usize], vec![places[1].clone(); TENANTS as usize], d)
            }
        };
        Ok(Site { placement: p, senders, receivers, description, daemons, _ns: ns })
    }

    /// Whether the daemons still run.
    pub fn alive(&mut self) -> bool {
        self.daemons.iter_mut().all(|d| d.running())
    }
}

/// Two hosts: namespaces `TAG-a` and `TAG-b` joined by veth (10.78.SUBNET.0/24),
/// a daemon named `NAME`A and `NAME`B in each, linked by the TCP transport,
/// with `extra` TOML (tables) added to each one's configuration. Returns the
/// daemons (to drop before `ns`), the places and the pair.
pub(super) fn host_pair(
    env: &Env,
    ns: &mut Namespaces,
    tag: &str,
    subnet: u8,
    name: &str,
    extra: &str,
) -> Result<(Vec<Proc>, [Place; 2], super::netns::Pair)> {
    let pair = ns.pair(tag, subnet)?;
    let psk = psk();
    let port = vrdmad::config::DEFAULT_WIRE_PORT;
    let mut daemons = Vec::new();
    let mut places = Vec::new();
    for i in 0..2 {
        let sock = env.dir.join(format!("{name}{i}.sock"));
        let (me, peer) = (pair.addr[i], pair.addr[1 - i]);
        let toml = format!(
            "address = \"{me}\"\n[net]\nlisten = \"{me}:{port}\"\nport = {port}\npsk = \"{psk}\"\n\
             peers = [\"{peer}:{port}\"]\n{extra}"
        );
        let dname = format!("{name}{}", ["A", "B"][i]);
        daemons.push(daemon(env, &dname, &sock, Some(&pair.path[i]), &toml)?);
        places.push(Place { netns: Some(pair.path[i].clone()), socket: sock, addr: IpAddr::V4(me) });
    }
    wait_linked(&places[0].socket, Duration::from_secs(15))?;
    wait_linked(&places[1].socket, Duration::from_secs(15))?;
    let [a, b]: [Place; 2] = places.try_into().map_err(|_| anyhow::anyhow!("two places"))?;
    Ok((daemons, [a, b], pair))
}

/// A daemon process (`vrdma daemon`) on `sock`, in `netns`, with `toml`.
pub(crate) fn daemon(env: &Env, name: &str, sock: &Path, netns: Option<&Path>, toml: &str) -> Result<Proc> {
    let config = env.dir.join(format!("{name}.toml"));
    std::fs::write(&config, toml)?;
    let mut cmd = std::process::Command::new(env.exe);
    cmd.arg("daemon").arg("--socket").arg(sock).arg("--config").arg(&config).env("VRDMA_LOG", "warn");
    let at = Where { netns: netns.map(Path::to_owned), uid: None };
    let mut p = proc::spawn(
        &format!("daemon {name}"),
        cmd,
        &at,
        env.run_id,
        &env.logs.join(format!("daemon-{name}.log")),
    )?;
    let end = Instant::now() + Duration::from_secs(20);
    while vrdma::Context::open_at(sock).is_err() {
        if !p.running() {
            bail!("the daemon {name} exited; {}", p.log_tail());
        }
        if Instant::now() > end {
            bail!("the daemon {name} did not answer on {} within 20 s", sock.display());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(p)
}

/// Waits until the daemon at `sock` has a link up.
fn wait_linked(sock: &Path, limit: Duration) -> Result<()> {
    let ctx = vrdma::Context::open_at(sock).context("opening the device")?;
    let end = Instant::now() + limit;
    loop {
        if ctx.stat()?.links.iter().any(|l| l.up) {
            return Ok(());
        }
        if Instant::now() > end {
            bail!("the daemons did not link within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A fresh pre-shared key for the two hosts' daemons.
pub(crate) fn psk() -> String {
    let mut b = [0u8; 16];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .is_err()
    {
        let t =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        b = (t ^ u128::from(std::process::id())).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}
