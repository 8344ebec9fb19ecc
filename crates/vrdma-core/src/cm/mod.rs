//! The connection manager (rdma_cm) without I/O.
//!
//! Most RDMA programs do not trade QP numbers over a socket of their own:
//! they resolve an IP address to a device, connect and accept with
//! private data, and disconnect, through the kernel's rdma_cm, which runs
//! the IB CM's REQ/REP/RTU exchange with the peer's kernel. vRDMA has no
//! kernel part, so its daemon plays that role: each daemon owns the IP
//! addresses of its network namespace (as RoCE binds a device to its
//! network interface) and one [`ConnectionManager`] for them.
//!
//! Like the HCA, it is a state machine with no I/O and no clock. The
//! driver hands it the tenants' calls (`create_id`, `connect`, `accept`,
//! ...), the messages other managers sent ([`handle_message`]), the
//! time ([`handle_timeout`]) and the links to other hosts as they come
//! ([`link_up`]) and go ([`link_down`]); it takes back the events for the
//! tenants ([`poll_event`]) and the messages to send ([`poll_transmit`]),
//! each addressed to a host, this one included: a connection between two
//! processes of one host is the same exchange, looped back.
//!
//! A connection belongs to the link its REQ went or came by (a message
//! for it goes by that link, a new REQ by the host's newest; only what
//! comes by that link speaks for it, and for a REQ the driver still holds
//! for a link, only what comes by a verified one): a daemon of
//! a host that restarted makes a second link to it while the first is
//! not yet found dead, and that first link's end must take only what was
//! made over it, not what the restarted daemon's link carries since.
//!
//! The rules kept from the kernel: the port space belongs to the host
//! ([`ports`]); a listener belongs to its tenant, and a request from
//! another tenant is answered exactly as a port without a listener is
//! (a REJ with reason 8), so nothing leaks; a listener holds at most its
//! backlog of requests not yet accepted or rejected; private data is
//! bounded as rdma_cm over IB bounds it; a REQ unanswered within the
//! connect timeout ends in UNREACHABLE, a REP without RTU in CONNECT_ERROR,
//! a DREQ without DREP in DISCONNECTED all the same; and a lost link ends
//! every connection it carried as the peer's death would.
//!
//! The QPs themselves are the library's to move, as with rdma-core's
//! librdmacm: [`ConnectionManager::init_qp_attr`] gives the attributes for
//! each state (the kernel's `rdma_init_qp_attr`), from both sides'
//! [`ConnInfo`].
//!
//! [`handle_message`]: ConnectionManager::handle_message
//! [`handle_timeout`]: ConnectionManager::handle_timeout
//! [`link_up`]: ConnectionManager::link_up
//! [`link_down`]: ConnectionManager::link_down
//! [`poll_event`]: ConnectionManager::poll_event
//! [`poll_transmit`]: ConnectionManager::poll_transmit

mod linger;
pub mod message;
pub mod migrate;
pub mod ports;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

pub use message::{reject, CmMessage, ConnInfo};
pub use ports::{PortError, PortSpace};

use crate::hca::{lid_of_ipv4, ContextId, KeySource, LinkId, TenantId};
use crate::time::Instant;
use crate::verbs::{AccessFlags, AhAttr, Gid, Mtu, QpAttr, QpAttrMask, QpState};

/// `errno` values the events and errors carry, as the kernel's.
pub mod errno {
    pub const EINVAL: i32 = 22;
    pub const ENOENT: i32 = 2;
    pub const EADDRINUSE: i32 = 98;
    pub const EADDRNOTAVAIL: i32 = 99;
    pub const ETIMEDOUT: i32 = 110;
    pub const ECONNRESET: i32 = 104;
    pub const ENOMEM: i32 = 12;
    pub const ENETUNREACH: i32 = 101;
}

/// The limits and timers of a connection manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmConfig {
    /// How long a REQ waits for a REP or REJ, and a REP for its RTU.
    pub connect_timeout: Duration,
    /// How long a DREQ waits for its DREP.
    pub disconnect_timeout: Duration,
    /// The backlog of a listener that asked for 0 or more than this.
    pub max_backlog: u32,
    /// Ids one tenant may hold, listeners' pending requests included.
    pub max_ids_per_tenant: u32,
    /// How long a port whose listener its tenant destroyed holds that
    /// tenant's requests for a new listener before refusing them (see
    /// `linger`).
    pub listen_linger: Duration,
}

impl Default for CmConfig {
    fn default() -> Self {
        CmConfig {
            // The kernel's CM waits about 4 s per try (4.096 µs × 2^20)
            // and retries; between daemons nothing is lost, so one wait.
            connect_timeout: Duration::from_secs(5),
            disconnect_timeout: Duration::from_secs(1),
            max_backlog: 1024,
            max_ids_per_tenant: 4096,
            // Ten times the longest gap seen between perftest -R's second
            // request and its server's new listen, on 2 loaded CPUs.
            listen_linger: Duration::from_millis(250),
        }
    }
}

/// `enum rdma_cm_event_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum EventKind {
    AddrResolved = 0,
    AddrError = 1,
    RouteResolved = 2,
    RouteError = 3,
    ConnectRequest = 4,
    ConnectResponse = 5,
    ConnectError = 6,
    Unreachable = 7,
    Rejected = 8,
    Established = 9,
    Disconnected = 10,
    DeviceRemoval = 11,
    TimewaitExit = 15,
}

/// An event for the context that owns `id`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CmEvent {
    pub ctx: ContextId,
    pub id: u32,
    pub kind: EventKind,
    /// 0, a negative errno, or (REJECTED) the REJ's reason.
    pub status: i32,
    /// CONNECT_REQUEST: the listener the new `id` came from.
    pub listen_id: Option<u32>,
    /// The peer's side: CONNECT_REQUEST, CONNECT_RESPONSE, ESTABLISHED
    /// (UD: its QP number), REJECTED (its private data only).
    pub peer: Option<ConnInfo>,
    /// UD: the peer QP's Q_Key.
    pub qkey: u32,
    /// The id's local and remote addresses when the event was made (what
    /// `rdma_get_local_addr` and `rdma_get_peer_addr` give: the bind, the
    /// address resolution or the connect request that made the id sets
    /// them, and nothing changes them after), so that a library needs no
    /// call of its own for them after ADDR_RESOLVED or CONNECT_REQUEST.
    pub local: Option<SocketAddrV4>,
    pub remote: Option<SocketAddrV4>,
}

/// Why a call was refused; `errno()` is what the library reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmError {
    #[error("no such rdma_cm id")]
    NoSuchId,
    #[error("the id is in the wrong state for this call")]
    WrongState,
    #[error("{0}")]
    Invalid(&'static str),
    #[error("private data of {got} bytes is over the limit of {max}")]
    PrivateDataTooLong { got: usize, max: usize },
    #[error("address {0} is not an address of this host's vRDMA device")]
    NotLocal(Ipv4Addr),
    #[error("address already in use")]
    AddrInUse,
    #[error("no free port")]
    NoPort,
    #[error("this tenant holds its limit of {0} rdma_cm ids")]
    Quota(u32),
}

impl CmError {
    pub fn errno(&self) -> i32 {
        match self {
            CmError::NoSuchId => errno::ENOENT,
            CmError::WrongState | CmError::Invalid(_) | CmError::PrivateDataTooLong { .. } => errno::EINVAL,
            CmError::NotLocal(_) | CmError::NoPort => errno::EADDRNOTAVAIL,
            CmError::AddrInUse => errno::EADDRINUSE,
            CmError::Quota(_) => errno::ENOMEM,
        }
    }
}

impl From<PortError> for CmError {
    fn from(e: PortError) -> Self {
        match e {
            PortError::InUse => CmError::AddrInUse,
            PortError::Exhausted => CmError::NoPort,
        }
    }
}

/// Where an id is, from the kernel's `enum rdma_cm_state` and the IB CM's
/// states, merged. (Serialized in a migration's snapshot: new states go
/// last.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum State {
    Idle,
    Bound,
    AddrResolved,
    RouteResolved,
    Listening,
    /// Active: REQ sent, waiting for REP or REJ.
    ReqSent,
    /// Active: REP in; the library brings its QP up, then `establish`.
    RepReceived,
    /// Passive: a CONNECT_REQUEST the application has yet to answer.
    ReqReceived,
    /// Passive: REP sent, waiting for RTU.
    RepSent,
    Established,
    /// DREQ sent, waiting for DREP.
    DreqSent,
    /// The connection is over (disconnected, rejected, unreachable); only
    /// destroy is left.
    Closed,
}

#[derive(Debug)]
struct CmId {
    ctx: ContextId,
    tenant: TenantId,
    ps: PortSpace,
    state: State,
    /// The bound address (its port is held in the port space).
    local: Option<SocketAddrV4>,
    remote: Option<SocketAddrV4>,
    reuse: bool,
    /// The peer's host and its number for this connection.
    peer: Option<(Ipv4Addr, u32)>,
    /// The link to the peer's host that this connection's messages go by:
    /// the one its REQ went or came by (`None`: the peer is on this host,
    /// or no link to it was up yet and the driver holds the messages for
    /// its dial, which [`ConnectionManager::link_up`] ends).
    link: Option<LinkId>,
    /// A passive connection's key in `requested` (the host, link and
    /// number its REQ came with), removed by it when the id goes: a
    /// Moved changes the connection's host and link, not its key.
    requested_as: Option<(Ipv4Addr, Option<LinkId>, u32)>,
    /// A listener's backlog and requests not yet answered; a child's
    /// listener while it counts there.
    backlog: u32,
    pending: u32,
    listener: Option<u32>,
    /// Whether this side sent the REQ.
    active: bool,
    /// This side's first PSN, chosen when the id is made (as the kernel's
    /// `seq_num`), so that a passive QP can reach RTS before its REP goes.
    psn: u32,
    /// What this side said (connect or accept) and what the peer said.
    ours: Option<ConnInfo>,
    theirs: Option<ConnInfo>,
    deadline: Option<Instant>,
    /// A DREQ came while this side held the REP unanswered (REP
    /// received). The IB CM drops a DREQ in that state, and takes the
    /// peer's resent one once its RTU is out; DREQs are not resent here,
    /// so it is kept, and taken when the RTU goes.
    dreq_waiting: bool,
}

/// One host's connection manager.
pub struct ConnectionManager {
    config: CmConfig,
    addrs: Vec<Ipv4Addr>,
    /// Addresses this host also owns, each for one tenant only: a VM's
    /// (`[vms.NAME] address`, docs/vms.md). Local for every tenant (a
    /// request to one is handed to this host's listeners), bindable by
    /// its tenant only.
    tenant_addrs: HashMap<Ipv4Addr, TenantId>,
    ids: HashMap<u32, CmId>,
    /// The ids made for requests, by the requester's host, the link the
    /// request came by and the requester's number, so that a REQ sent
    /// again or a REJ for one is found without a walk of every id (a
    /// peer's flood of them costs a lookup each). The link is part of the
    /// key: a restarted daemon numbers its ids from 1 again, and its REQ
    /// is not one its last life sent over the old link.
    requested: HashMap<(Ipv4Addr, Option<LinkId>, u32), u32>,
    /// The live links to each other host, as the driver reported them,
    /// each with whether it is verified (`hca::LinkInfo::verified`): a
    /// new REQ goes by the newest verified one (the highest number), or,
    /// with none verified, by the newest.
    links: HashMap<Ipv4Addr, BTreeMap<LinkId, bool>>,
    per_tenant: HashMap<TenantId, u32>,
    ports: ports::Ports,
    timers: BTreeSet<(Instant, u32)>,
    events: VecDeque<CmEvent>,
    transmit: VecDeque<(Ipv4Addr, Option<LinkId>, CmMessage)>,
    psns: Box<dyn KeySource>,
    next_id: u32,
    /// Ports whose listener went a moment ago, holding their tenant's
    /// requests for the next.
    linger: linger::Linger,
    /// The high bits of every id this manager hands out (the daemon's
    /// number space, `hca::numbering`), so that an id keeps its number
    /// when its tenant moves to a daemon of another space.
    space: u8,
    /// Tenants paused for a migration: messages for their ids are
    /// dropped and their timers do not run (see `migrate`).
    paused: std::collections::HashSet<TenantId>,
}

impl ConnectionManager {
    /// The manager of a host whose device owns `addrs`; `psns` gives the
    /// random first PSN of each connection.
    pub fn new(config: CmConfig, addrs: Vec<Ipv4Addr>, psns: Box<dyn KeySource>) -> ConnectionManager {
        ConnectionManager {
            config,
            addrs,
            tenant_addrs: HashMap::new(),
            ids: HashMap::new(),
            requested: HashMap::new(),
            links: HashMap::new(),
            per_tenant: HashMap::new(),
            ports: ports::Ports::default(),
            timers: BTreeSet::new(),
            events: VecDeque::new(),
            transmit: VecDeque::new(),
            psns,
            next_id: 1,
            linger: linger::Linger::default(),
            space: 0,
            paused: Default::default(),
        }
    }

    /// Numbers ids from now on in number space `space` (its high 8 bits;
    /// 0: from 1 across all of u32, as before).
    pub fn set_number_space(&mut self, space: u8) {
        self.space = space;
        self.next_id = if space == 0 { 1 } else { (u32::from(space) << 24) | 1 };
    }

    /// The addresses this host's device owns.
    pub fn addrs(&self) -> &[Ipv4Addr] {
        &self.addrs
    }

    /// Whether `ip` names this host: one of its addresses (its tenants'
    /// included), or loopback unless this host's own address is a
    /// loopback one (daemons that stand for several hosts on one machine,
    /// as tests run them, each own one loopback address and no other).
    pub fn is_local(&self, ip: Ipv4Addr) -> bool {
        self.addrs.contains(&ip)
            || self.tenant_addrs.contains_key(&ip)
            || ip.is_loopback() && !self.addrs.iter().any(|a| a.is_loopback())
    }

    /// Makes `ip` an address of this host that only `tenant`'s ids may
    /// bind (a VM's address). Refused for an address this host owns
    /// already, the wildcard, loopback, multicast and broadcast.
    pub fn add_tenant_addr(&mut self, ip: Ipv4Addr, tenant: TenantId) -> Result<(), CmError> {
        if ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() || ip.is_broadcast() {
            return Err(CmError::Invalid("a tenant's address must be a unicast, non-loopback address"));
        }
        if self.addrs.contains(&ip) || self.tenant_addrs.contains_key(&ip) {
            return Err(CmError::Invalid("the address is this host's already"));
        }
        self.tenant_addrs.insert(ip, tenant);
        Ok(())
    }

    /// `rdma_create_id`.
    pub fn create_id(&mut self, ctx: ContextId, tenant: TenantId, ps: PortSpace) -> Result<u32, CmError> {
        self.new_id(ctx, tenant, ps, State::Idle)
    }

    fn new_id(
        &mut self,
        ctx: ContextId,
        tenant: TenantId,
        ps: PortSpace,
        state: State,
    ) -> Result<u32, CmError> {
        let held = self.per_tenant.entry(tenant).or_default();
        if *held >= self.config.max_ids_per_tenant {
            return Err(CmError::Quota(self.config.max_ids_per_tenant));
        }
        *held += 1;
        let id = loop {
            let id = self.next_id;
            self.next_id = if self.space == 0 {
                self.next_id.wrapping_add(1).max(1)
            } else {
                (u32::from(self.space) << 24) | (self.next_id.wrapping_add(1) & 0xff_ffff)
            };
            if id != 0 && !self.ids.contains_key(&id) {
                break id;
            }
        };
        let cm_id = CmId {
            ctx,
            tenant,
            ps,
            state,
            local: None,
            remote: None,
            reuse: false,
            peer: None,
            link: None,
            requested_as: None,
            backlog: 0,
            pending: 0,
            listener: None,
            active: false,
            psn: self.psns.next_key() & 0x00ff_ffff,
            ours: None,
            theirs: None,
            deadline: None,
            dreq_waiting: false,
        };
        self.ids.insert(id, cm_id);
        Ok(id)
    }

    fn own(&mut self, ctx: ContextId, id: u32) -> Result<&mut CmId, CmError> {
        self.ids.get_mut(&id).filter(|i| i.ctx == ctx).ok_or(CmError::NoSuchId)
    }

    /// Whether a listener of `tenant` takes requests for `addr` in `ps`
    /// (another tenant's listener does not count: it would not take this
    /// tenant's requests, and must not be seen).
    pub fn has_listener(&self, tenant: TenantId, ps: PortSpace, addr: SocketAddrV4) -> bool {
        self.ports.listener(ps, *addr.ip(), addr.port()).is_some_and(|l| {
            self.ids.get(&l).is_some_and(|i| i.tenant == tenant && i.state == State::Listening)
        })
    }

    /// The context that owns `id`.
    pub fn owner(&self, id: u32) -> Option<ContextId> {
        self.ids.get(&id).map(|i| i.ctx)
    }

    /// The id's state, for its owner.
    pub fn state(&self, ctx: ContextId, id: u32) -> Option<State> {
        self.ids.get(&id).filter(|i| i.ctx == ctx).map(|i| i.state)
    }

    /// The id's port space, for its owner.
    pub fn port_space(&self, ctx: ContextId, id: u32) -> Option<PortSpace> {
        self.ids.get(&id).filter(|i| i.ctx == ctx).map(|i| i.ps)
    }

    /// The id's bound and peer addresses.
    pub fn addresses(&self, ctx: ContextId, id: u32) -> Option<(Option<SocketAddrV4>, Option<SocketAddrV4>)> {
        self.ids.get(&id).filter(|i| i.ctx == ctx).map(|i| (i.local, i.remote))
    }

    /// `rdma_set_option(RDMA_OPTION_ID_REUSEADDR)`: before binding only.
    pub fn set_reuseaddr(&mut self, ctx: ContextId, id: u32, reuse: bool) -> Result<(), CmError> {
        let i = self.own(ctx, id)?;
        if i.state != State::Idle {
            return Err(CmError::WrongState);
        }
        i.reuse = reuse;
        Ok(())
    }

    /// `rdma_bind_addr`: an address of this host (or the wildcard), port 0
    /// for any free one.
    pub fn bind(&mut self, ctx: ContextId, id: u32, addr: SocketAddrV4) -> Result<SocketAddrV4, CmError> {
        let ip = *addr.ip();
        if !ip.is_unspecified() && !self.is_local(ip) {
            return Err(CmError::NotLocal(ip));
        }
        let tenant = self.own(ctx, id)?.tenant;
        // Another tenant's address is not this tenant's to bind: as an
        // address of no interface of its own.
        if self.tenant_addrs.get(&ip).is_some_and(|&t| t != tenant) {
            return Err(CmError::NotLocal(ip));
        }
        let i = self.own(ctx, id)?;
        if i.state != State::Idle {
            return Err(CmError::WrongState);
        }
        let (ps, reuse) = (i.ps, i.reuse);
        let port = self.ports.bind(ps, ip, addr.port(), id, reuse)?;
        let bound = SocketAddrV4::new(ip, port);
        let i = self.own(ctx, id)?;
        i.local = Some(bound);
        i.state = State::Bound;
        Ok(bound)
    }

    /// `rdma_resolve_addr`: binds the id if it is not (to `src`, or to the
    /// address this host reaches `dst` from) and names its destination.
    /// Every unicast address resolves: whether a daemon answers there is
    /// learnt when the REQ goes (UNREACHABLE), as with an IB path.
    pub fn resolve_addr(
        &mut self,
        ctx: ContextId,
        id: u32,
        src: Option<SocketAddrV4>,
        dst: SocketAddrV4,
    ) -> Result<(), CmError> {
        let d = *dst.ip();
        if d.is_unspecified() || d.is_multicast() || d.is_broadcast() {
            return Err(CmError::Invalid("the destination is not a unicast address"));
        }
        let (state, tenant) = {
            let i = self.own(ctx, id)?;
            (i.state, i.tenant)
        };
        match state {
            State::Idle => {
                let from = match src {
                    Some(s) => s,
                    None => SocketAddrV4::new(self.source_for(d, tenant), 0),
                };
                self.bind(ctx, id, from)?;
            }
            // Once, as the kernel's: each resolution is an event the
            // tenant's channel holds, and a loop of them would grow it.
            // A bound id keeps its address whatever `src` says: the
            // kernel's `resolve_prepare_src` does not bind again ("a
            // previously bound ID will not be re-bound and src_addr is
            // ignored"), and refuses only a destination of another
            // address family, which an IPv4-only manager never meets.
            State::Bound => {}
            _ => return Err(CmError::WrongState),
        }
        let local_ip = self.source_for(d, tenant);
        let i = self.own(ctx, id)?;
        // A wildcard binding takes the address the request leaves from.
        if let Some(l) = i.local.as_mut().filter(|l| l.ip().is_unspecified()) {
            l.set_ip(local_ip);
        }
        i.remote = Some(dst);
        i.state = State::AddrResolved;
        let ev = self.event(id, EventKind::AddrResolved, 0);
        self.events.push_back(ev);
        Ok(())
    }

    /// The address a message of `tenant` to `dst` leaves from: a local
    /// destination's own (as the kernel's loopback routes give 127.0.0.1
    /// to 127.0.0.1) unless it is another tenant's, else this host's
    /// first.
    fn source_for(&self, dst: Ipv4Addr, tenant: TenantId) -> Ipv4Addr {
        let others = self.tenant_addrs.get(&dst).is_some_and(|&t| t != tenant);
        if self.is_local(dst) && !others {
            dst
        } else {
            self.addrs.first().copied().unwrap_or(Ipv4Addr::LOCALHOST)
        }
    }

    /// `rdma_resolve_route`.
    pub fn resolve_route(&mut self, ctx: ContextId, id: u32) -> Result<(), CmError> {
        self.resolve_route_reported(ctx, id)?;
        let ev = self.event(id, EventKind::RouteResolved, 0);
        self.events.push_back(ev);
        Ok(())
    }

    /// `rdma_resolve_route` whose ROUTE_RESOLVED the library reported
    /// itself (`CmRequest::RouteReported`): the same checks and the same
    /// state as [`resolve_route`](Self::resolve_route), and no event. A
    /// route needs nothing an address's resolution did not learn (every
    /// path is the host's one port), so the library, which saw the
    /// address resolved, answers the program without asking.
    pub fn resolve_route_reported(&mut self, ctx: ContextId, id: u32) -> Result<(), CmError> {
        let i = self.own(ctx, id)?;
        if i.state != State::AddrResolved {
            return Err(CmError::WrongState);
        }
        i.state = State::RouteResolved;
        Ok(())
    }

    /// `rdma_listen`; an unbound id is bound to every address first.
    pub fn listen(&mut self, ctx: ContextId, id: u32, backlog: i32) -> Result<(), CmError> {
        if self.own(ctx, id)?.state == State::Idle {
            self.bind(ctx, id, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
        }
        let max = self.config.max_backlog;
        let i = self.own(ctx, id)?;
        if i.state != State::Bound {
            return Err(CmError::WrongState);
        }
        let (ps, port) = (i.ps, i.local.map_or(0, |l| l.port()));
        self.ports.listen(ps, port, id)?;
        let i = self.own(ctx, id)?;
        i.backlog = if backlog <= 0 { max } else { (backlog as u32).min(max) };
        i.state = State::Listening;
        // Requests that came while the port lingered come now.
        for (host, link, req) in self.linger.listening(ps, port) {
            self.handle_message_by(host, link, req);
        }
        Ok(())
    }

    /// `rdma_connect` (or, on a UD id, the SIDR request). `conn` carries
    /// this side's QP, depths, retry counts and private data; its
    /// `start_psn` is chosen here.
    pub fn connect(
        &mut self,
        ctx: ContextId,
        id: u32,
        mut conn: ConnInfo,
        now: Instant,
    ) -> Result<(), CmError> {
        let i = self.ids.get(&id).filter(|i| i.ctx == ctx).ok_or(CmError::NoSuchId)?;
        let max =
            if i.ps.is_ud() { message::MAX_SIDR_REQ_PRIVATE_DATA } else { message::MAX_REQ_PRIVATE_DATA };
        check_private(&conn.private_data, max)?;
        if i.state != State::RouteResolved {
            return Err(CmError::WrongState);
        }
        let (Some(src), Some(dst)) = (i.local, i.remote) else { return Err(CmError::WrongState) };
        if i.tenant.is_host_local() && !self.is_local(*dst.ip()) {
            return Err(CmError::Invalid(
                "this tenant exists on this host only (its processes are outside the daemon's network \
                 namespace): it cannot connect to another host",
            ));
        }
        conn.start_psn = i.psn;
        let msg = CmMessage::Req { from: id, tenant: i.tenant.0, ps: i.ps, src, dst, conn: conn.clone() };
        let deadline = now + self.config.connect_timeout;
        let i = self.ids.get_mut(&id).ok_or(CmError::NoSuchId)?;
        i.ours = Some(conn);
        i.active = true;
        i.peer = Some((*dst.ip(), 0));
        i.link = None;
        i.state = State::ReqSent;
        self.send_for(id, msg);
        self.arm(id, Some(deadline));
        Ok(())
    }

    /// `rdma_accept` of a CONNECT_REQUEST (passive), with this side's
    /// QP and private data; a UD id answers with its QP and `qkey`.
    pub fn accept(
        &mut self,
        ctx: ContextId,
        id: u32,
        mut conn: ConnInfo,
        qkey: u32,
        now: Instant,
    ) -> Result<(), CmError> {
        let i = self.ids.get(&id).filter(|i| i.ctx == ctx).ok_or(CmError::NoSuchId)?;
        let ud = i.ps.is_ud();
        let max = if ud { message::MAX_SIDR_REP_PRIVATE_DATA } else { message::MAX_REP_PRIVATE_DATA };
        check_private(&conn.private_data, max)?;
        if i.state != State::ReqReceived {
            return Err(CmError::WrongState);
        }
        let Some((_, theirs)) = i.peer else { return Err(CmError::WrongState) };
        conn.start_psn = i.psn;
        self.send_for(id, CmMessage::Rep { to: theirs, from: id, conn: conn.clone(), qkey });
        self.leave_listener(id);
        let i = self.ids.get_mut(&id).ok_or(CmError::NoSuchId)?;
        i.ours = Some(conn);
        if ud {
            // SIDR has no RTU: the exchange is over for this side.
            i.state = State::Closed;
        } else {
            i.state = State::RepSent;
            let deadline = now + self.config.connect_timeout;
            self.arm(id, Some(deadline));
        }
        Ok(())
    }

    /// The active side's QP is up after CONNECT_RESPONSE: sends the RTU
    /// (`rdma_establish`, or librdmacm's completion of `rdma_connect`).
    /// No event: the library reports ESTABLISHED itself.
    pub fn establish(&mut self, ctx: ContextId, id: u32) -> Result<(), CmError> {
        let i = self.own(ctx, id)?;
        if i.state != State::RepReceived {
            return Err(CmError::WrongState);
        }
        let Some((_, theirs)) = i.peer else { return Err(CmError::WrongState) };
        i.state = State::Established;
        let dreq = std::mem::take(&mut i.dreq_waiting);
        self.send_for(id, CmMessage::Rtu { to: theirs, from: id });
        if dreq {
            // The peer's DREQ, taken now as its resend would be.
            self.send_for(id, CmMessage::Drep { to: theirs, from: id });
            self.close(id, EventKind::Disconnected, 0);
        }
        Ok(())
    }

    /// `rdma_reject` of a CONNECT_REQUEST (or of a CONNECT_RESPONSE).
    pub fn reject(&mut self, ctx: ContextId, id: u32, private_data: Vec<u8>) -> Result<(), CmError> {
        self.reject_with(ctx, id, reject::CONSUMER_DEFINED, private_data)
    }

    /// A REJ with `reason`: the consumer's (`rdma_reject`), or the
    /// daemon's own refusal of a request on the tenant's behalf
    /// (`NO_RESOURCES` when its channel holds all the events it may).
    pub fn reject_with(
        &mut self,
        ctx: ContextId,
        id: u32,
        reason: u16,
        private_data: Vec<u8>,
    ) -> Result<(), CmError> {
        check_private(&private_data, message::MAX_REJ_PRIVATE_DATA)?;
        let i = self.own(ctx, id)?;
        if !matches!(i.state, State::ReqReceived | State::RepReceived) {
            return Err(CmError::WrongState);
        }
        let Some((_, theirs)) = i.peer else { return Err(CmError::WrongState) };
        i.state = State::Closed;
        let msg = CmMessage::Rej { to: theirs, from: id, reason, private_data };
        self.send_for(id, msg);
        self.leave_listener(id);
        Ok(())
    }

    /// `rdma_disconnect`: sends a DREQ; both sides then get DISCONNECTED.
    pub fn disconnect(&mut self, ctx: ContextId, id: u32, now: Instant) -> Result<(), CmError> {
        let i = self.own(ctx, id)?;
        match i.state {
            State::Established | State::RepSent | State::RepReceived => {}
            // Already on its way out: nothing more to send.
            State::DreqSent | State::Closed => return Ok(()),
            _ => return Err(CmError::WrongState),
        }
        let Some((_, theirs)) = i.peer else { return Err(CmError::WrongState) };
        i.state = State::DreqSent;
        self.send_for(id, CmMessage::Dreq { to: theirs, from: id });
        let deadline = now + self.config.disconnect_timeout;
        self.arm(id, Some(deadline));
        Ok(())
    }

    /// `rdma_destroy_id`: the peer of a connection hears of it as the
    /// IB CM tells it (a DREQ once connected, a REJ before). A listener's
    /// port lingers for its tenant from `now` (see `linger`).
    pub fn destroy_id(&mut self, ctx: ContextId, id: u32, now: Instant) -> Result<(), CmError> {
        let i = self.own(ctx, id)?;
        if let (State::Listening, Some(local)) = (i.state, i.local) {
            let (ps, tenant) = (i.ps, i.tenant);
            let until = now + self.config.listen_linger;
            for (host, link, req) in self.linger.listener_gone(ps, local.port(), tenant, until) {
                self.refuse_req(host, link, &req);
            }
        }
        self.remove(id);
        Ok(())
    }

    /// Answers a REQ (from `host`, by `link`) as a port without a
    /// listener is answered.
    fn refuse_req(&mut self, host: Ipv4Addr, link: Option<LinkId>, req: &CmMessage) {
        let msg = CmMessage::Rej {
            to: req.from(),
            from: 0,
            reason: reject::INVALID_SERVICE_ID,
            private_data: vec![],
        };
        self.transmit.push_back((host, link, msg));
    }

    /// Queues `msg` of connection `id` for its peer, by the link the
    /// connection belongs to. Its first message to another host (a REQ,
    /// or the Moved of a connection imported here) goes by the host's
    /// newest link, which the connection keeps from then on; with none up
    /// yet, the driver holds it for its dial (see [`Self::link_up`]).
    fn send_for(&mut self, id: u32, msg: CmMessage) {
        let Some(i) = self.ids.get(&id) else { return };
        let Some((host, _)) = i.peer else { return };
        let link = match i.link {
            Some(l) => Some(l),
            None if self.is_local(host) => None,
            None => self.newest_link(host),
        };
        if let Some(i) = self.ids.get_mut(&id) {
            i.link = link;
        }
        self.transmit.push_back((host, link, msg));
    }

    /// The newest verified live link to `host` the driver reported, or
    /// with none verified the newest: a daemon that claims the host's GID
    /// from another address does not take its new connections over.
    fn newest_link(&self, host: Ipv4Addr) -> Option<LinkId> {
        let links = self.links.get(&host)?;
        let verified = links.iter().rev().find(|(_, &v)| v).map(|(&l, _)| l);
        verified.or_else(|| links.keys().next_back().copied())
    }

    /// Destroys every id of `ctx` (its process closed the device or died).
    pub fn close_context(&mut self, ctx: ContextId) {
        let mine: Vec<u32> = self.ids.iter().filter(|(_, i)| i.ctx == ctx).map(|(&n, _)| n).collect();
        for id in mine {
            self.remove(id);
        }
    }

    fn remove(&mut self, id: u32) {
        self.leave_listener(id);
        self.arm(id, None);
        let Some(i) = self.ids.remove(&id) else { return };
        if let Some(key) = i.requested_as {
            if self.requested.get(&key) == Some(&id) {
                self.requested.remove(&key);
            }
        }
        if let Some(n) = self.per_tenant.get_mut(&i.tenant) {
            *n = n.saturating_sub(1);
        }
        if let Some(l) = i.local {
            self.ports.unbind(i.ps, l.port(), id);
        }
        let Some((host, theirs)) = i.peer else { return };
        let msg = match i.state {
            State::Established | State::RepReceived => Some(CmMessage::Dreq { to: theirs, from: id }),
            // The responder may not have answered yet: it matches the REJ
            // by our number (`to` 0).
            State::ReqSent => {
                Some(CmMessage::Rej { to: theirs, from: id, reason: reject::TIMEOUT, private_data: vec![] })
            }
            State::ReqReceived | State::RepSent => Some(CmMessage::Rej {
                to: theirs,
                from: id,
                reason: reject::CONSUMER_DEFINED,
                private_data: vec![],
            }),
            _ => None,
        };
        if let Some(m) = msg {
            // (Gone from `ids`: sent by its link here, as `send_for` would.)
            let link = i.link.or_else(|| if self.is_local(host) { None } else { self.newest_link(host) });
            self.transmit.push_back((host, link, m));
        }
    }

    /// A child that leaves `ReqReceived` frees its place in the backlog.
    fn leave_listener(&mut self, id: u32) {
        let Some(l) = self.ids.get_mut(&id).and_then(|i| i.listener.take()) else { return };
        if let Some(listener) = self.ids.get_mut(&l) {
            listener.pending = listener.pending.saturating_sub(1);
        }
    }

    fn arm(&mut self, id: u32, deadline: Option<Instant>) {
        let Some(i) = self.ids.get_mut(&id) else { return };
        if let Some(old) = i.deadline.take() {
            self.timers.remove(&(old, id));
        }
        if let Some(d) = deadline {
            i.deadline = Some(d);
            self.timers.insert((d, id));
        }
    }

    fn event(&self, id: u32, kind: EventKind, status: i32) -> CmEvent {
        let (ctx, local, remote) =
            self.ids.get(&id).map_or((ContextId(0), None, None), |i| (i.ctx, i.local, i.remote));
        CmEvent { ctx, id, kind, status, listen_id: None, peer: None, qkey: 0, local, remote }
    }

    /// Ends a connection with `kind` for its owner.
    fn close(&mut self, id: u32, kind: EventKind, status: i32) {
        self.arm(id, None);
        self.leave_listener(id);
        if let Some(i) = self.ids.get_mut(&id) {
            i.state = State::Closed;
        }
        let ev = self.event(id, kind, status);
        self.events.push_back(ev);
    }

    /// A message from the manager of `host`, on this host or by no link
    /// the driver reported ([`Self::handle_message_by`] without a link).
    pub fn handle_message(&mut self, host: Ipv4Addr, msg: CmMessage) {
        self.handle_message_by(host, None, msg);
    }

    /// A message from the manager of `host` that came by `link`: a
    /// connection a REQ makes belongs to the link it came by, and its
    /// answers go by it; a message for a connection that came by another
    /// link than its own is dropped ([`Self::by_its_link`]).
    pub fn handle_message_by(&mut self, host: Ipv4Addr, link: Option<LinkId>, msg: CmMessage) {
        if let CmMessage::Req { from, tenant, ps, src, dst, conn } = msg {
            self.handle_req(host, link, from, TenantId(tenant), ps, src, dst, conn);
            return;
        }
        if let CmMessage::Moved { to, from, tenant } = msg {
            self.handle_moved(host, link, to, from, TenantId(tenant));
            return;
        }
        // A paused tenant's ids hold still (the state being exported must
        // not change); what the peer said is asked again by the Moved
        // frame of the resume (`migrate`).
        if msg.to().and_then(|to| self.ids.get(&to)).is_some_and(|i| self.paused.contains(&i.tenant)) {
            return;
        }
        let (Some(mut to), from) = (msg.to(), msg.from()) else { return };
        if to == 0 {
            if matches!(msg, CmMessage::Rej { .. }) {
                // It may be held for a lingering port.
                self.linger.forget(host, link, Some(from));
            }
            // A REJ from a requester that had not heard from us yet names
            // the connection by its own number.
            let child = self.requested.get(&(host, link, from)).copied().filter(|n| {
                self.ids.get(n).is_some_and(|i| matches!(i.state, State::ReqReceived | State::RepSent))
            });
            match child {
                Some(n) if matches!(msg, CmMessage::Rej { .. }) => to = n,
                _ => return,
            }
        }
        // Only the connection's peer may speak for it; a REQ's sender
        // learns the peer's number from its first answer.
        let Some(i) = self.ids.get(&to) else { return };
        match i.peer {
            Some((h, n)) if h == host && (n == from || n == 0 && i.state == State::ReqSent) => {}
            _ => return,
        }
        // And only by the connection's link: another link to the host may
        // be a daemon that only claims its GID, guessing our numbers.
        if !self.by_its_link(i, host, link) {
            tracing::debug!(%host, ?link, bound = ?i.link, id = to, "an rdma_cm message by another link than its connection's; dropped");
            return;
        }
        if i.link.is_none() && link.is_some() {
            // (The driver sent its REQ by that verified link.)
            self.ids.get_mut(&to).expect("looked up above").link = link;
        }
        let Some(i) = self.ids.get(&to) else { return };
        let state = i.state;
        match msg {
            CmMessage::Rep { conn, qkey, .. } if state == State::ReqSent => {
                let ud = i.ps.is_ud();
                self.arm(to, None);
                let i = self.ids.get_mut(&to).expect("looked up above");
                i.peer = Some((host, from));
                i.theirs = Some(conn.clone());
                i.state = if ud { State::Closed } else { State::RepReceived };
                let kind = if ud { EventKind::Established } else { EventKind::ConnectResponse };
                let mut ev = self.event(to, kind, 0);
                ev.peer = Some(conn);
                ev.qkey = qkey;
                self.events.push_back(ev);
            }
            CmMessage::Rtu { .. } if state == State::RepSent => self.rtu_came(to),
            CmMessage::Rej { reason, private_data, .. } => match state {
                State::ReqSent | State::RepReceived | State::ReqReceived | State::RepSent => {
                    let (kind, status) = if reason == reject::TIMEOUT && state == State::ReqSent {
                        (EventKind::Unreachable, -errno::ETIMEDOUT)
                    } else {
                        (EventKind::Rejected, i32::from(reason))
                    };
                    self.close(to, kind, status);
                    if let Some(ev) = self.events.back_mut() {
                        ev.peer = Some(ConnInfo { private_data, ..ConnInfo::default() });
                    }
                }
                _ => {}
            },
            CmMessage::Dreq { .. } => match state {
                State::Established | State::RepSent => {
                    self.send_for(to, CmMessage::Drep { to: from, from: to });
                    self.close(to, EventKind::Disconnected, 0);
                }
                // Both sides disconnected at once: each answers the
                // other's DREQ, and reports one DISCONNECTED.
                State::DreqSent => {
                    self.send_for(to, CmMessage::Drep { to: from, from: to });
                    self.close(to, EventKind::Disconnected, 0);
                }
                // Ours is gone already: answer, so the peer need not wait.
                State::Closed => self.send_for(to, CmMessage::Drep { to: from, from: to }),
                // The REP not yet answered: as the IB CM, not now (see
                // `dreq_waiting`), but once the RTU has gone.
                State::RepReceived => {
                    if let Some(i) = self.ids.get_mut(&to) {
                        i.dreq_waiting = true;
                    }
                }
                _ => {}
            },
            CmMessage::Drep { .. } if state == State::DreqSent => self.close(to, EventKind::Disconnected, 0),
            _ => {}
        }
    }

    /// The RTU of our connection `id` (in `RepSent`) came, or a Moved that
    /// stands for it (`migrate`): the connection is established.
    fn rtu_came(&mut self, id: u32) {
        self.arm(id, None);
        let Some(i) = self.ids.get_mut(&id) else { return };
        i.state = State::Established;
        let theirs = i.theirs.clone();
        let mut ev = self.event(id, EventKind::Established, 0);
        ev.peer = theirs;
        self.events.push_back(ev);
    }

    /// Whether a message for connection `i` that came from `host` by
    /// `link` came by the connection's link: the one it is bound to (its
    /// REQ went or came by it; `None`: this host, or a driver without
    /// links); for one whose REQ the driver still holds for a link (bound
    /// to none, the peer on another host), a verified link to that host
    /// the driver reported (it sends what it held by such a one), not an
    /// unverified one nor one the manager has not heard of (the driver
    /// holds back the links of a host while a dial to its GID's address
    /// is under way).
    fn by_its_link(&self, i: &CmId, host: Ipv4Addr, link: Option<LinkId>) -> bool {
        match (i.link, link) {
            (Some(bound), came) => came == Some(bound),
            (None, None) => true,
            (None, Some(came)) => {
                !self.is_local(host)
                    && self.links.get(&host).and_then(|s| s.get(&came)).copied() == Some(true)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn handle_req(
        &mut self,
        host: Ipv4Addr,
        link: Option<LinkId>,
        from: u32,
        tenant: TenantId,
        ps: PortSpace,
        src: SocketAddrV4,
        dst: SocketAddrV4,
        conn: ConnInfo,
    ) {
        let refuse = |cm: &mut Self, reason| {
            let msg = CmMessage::Rej { to: from, from: 0, reason, private_data: Vec::new() };
            cm.transmit.push_back((host, link, msg));
        };
        // A REQ sent again (the peer's driver retried) is the same one.
        // (A connection that ended no longer holds its numbers: a peer
        // daemon that restarted numbers its ids from 1 again.)
        let pending = |i: &CmId| matches!(i.state, State::ReqReceived | State::RepSent);
        if self.requested.get(&(host, link, from)).and_then(|c| self.ids.get(c)).is_some_and(pending) {
            return;
        }
        // A tenant numbered by another host's daemon is not ours, whatever
        // its number: it only ever meets a port without a listener here.
        let foreign = tenant.is_host_local() && !self.is_local(host);
        let listener = self
            .ports
            .listener(ps, *dst.ip(), dst.port())
            .filter(|l| self.ids.get(l).is_some_and(|i| i.tenant == tenant && i.state == State::Listening))
            .filter(|_| !foreign);
        let Some(l) = listener else {
            // A port whose listener this tenant just destroyed waits a
            // moment for its next (see `linger`).
            let req = CmMessage::Req { from, tenant: tenant.0, ps, src, dst, conn };
            if foreign || !self.linger.hold(ps, dst.port(), tenant, host, link, req) {
                // No listener, or another tenant's: the same answer.
                refuse(self, reject::INVALID_SERVICE_ID);
            }
            return;
        };
        let max = if ps.is_ud() { message::MAX_SIDR_REQ_PRIVATE_DATA } else { message::MAX_REQ_PRIVATE_DATA };
        let (ctx, backlog, pending) = {
            let li = &self.ids[&l];
            (li.ctx, li.backlog, li.pending)
        };
        if conn.private_data.len() > max || pending >= backlog {
            refuse(self, reject::NO_RESOURCES);
            return;
        }
        let Ok(child) = self.new_id(ctx, tenant, ps, State::ReqReceived) else {
            refuse(self, reject::NO_RESOURCES);
            return;
        };
        if let Some(li) = self.ids.get_mut(&l) {
            li.pending += 1;
        }
        self.requested.insert((host, link, from), child);
        // The requester's address is the host its REQ came from (the
        // link's authenticated peer), whatever its `src` claims; its port
        // is only a name.
        let from_ip = if self.is_local(host) { *src.ip() } else { host };
        let c = self.ids.get_mut(&child).expect("just made");
        c.local = Some(dst);
        c.remote = Some(SocketAddrV4::new(from_ip, src.port()));
        c.peer = Some((host, from));
        c.link = link;
        c.requested_as = Some((host, link, from));
        c.listener = Some(l);
        c.theirs = Some(conn.clone());
        let mut ev = self.event(child, EventKind::ConnectRequest, 0);
        ev.listen_id = Some(l);
        ev.peer = Some(conn);
        self.events.push_back(ev);
    }

    /// A link to `host` is up, `verified` or not (`hca::LinkInfo::verified`):
    /// a new REQ to that host goes by it (the newest, unless it is not
    /// verified and another is), and the connections whose messages waited
    /// for a link to that host (the driver held them for its dial, and
    /// sends them by the first link it tells of, or by the first verified
    /// one) belong to it. (A connection whose message is still queued here
    /// by no link is bound again, when it goes, to the link the driver
    /// sent it by: [`Self::sent_by`].)
    pub fn link_up(&mut self, host: Ipv4Addr, link: LinkId, verified: bool) {
        if self.is_local(host) {
            return;
        }
        let links = self.links.entry(host).or_default();
        let had_verified = links.values().any(|&v| v);
        links.insert(link, verified);
        // (With a verified link up, no message waited for a dial: the
        // driver sent it by that link.)
        if had_verified && !verified {
            return;
        }
        for i in self.ids.values_mut() {
            if i.link.is_none() && i.state != State::Closed && i.peer.is_some_and(|(h, _)| h == host) {
                i.link = Some(link);
            }
        }
    }

    /// Whether connection `id` still waits for a link to `host` (its
    /// messages held for a dial there): the driver drops the held
    /// messages of one that does not (it ended meanwhile), so that the
    /// host's next link does not carry a request for a connection already
    /// ended.
    pub fn awaits_link(&self, host: Ipv4Addr, id: u32) -> bool {
        self.ids.get(&id).is_some_and(|i| {
            i.link.is_none() && i.state != State::Closed && i.peer.is_some_and(|(h, _)| h == host)
        })
    }

    /// `link` to `host` is gone: every connection it carried ends as if
    /// its peer had died; another link's to the same host (a daemon there
    /// restarted and linked again before the first was found dead) go on.
    /// With `link` `None`, no link came for the messages held for a dial
    /// to `host` (it failed, or the host cannot be reached): the
    /// connections that waited for one end.
    pub fn link_down(&mut self, host: Ipv4Addr, link: Option<LinkId>) {
        if let (Some(l), Some(set)) = (link, self.links.get_mut(&host)) {
            set.remove(&l);
            if set.is_empty() {
                self.links.remove(&host);
            }
        }
        self.linger.forget(host, link, None);
        let gone: Vec<(u32, State)> = self
            .ids
            .iter()
            .filter(|(_, i)| {
                i.peer.is_some_and(|(h, _)| h == host) && i.link == link && i.state != State::Closed
            })
            .map(|(&n, i)| (n, i.state))
            .collect();
        for (id, state) in gone {
            self.end_unreached(id, state);
        }
    }

    /// The driver could not send `msg` to `host` by `link`: with a link,
    /// as if it went down ([`Self::link_down`]); with `None` (no link was
    /// up and the driver would not hold it for a dial), the connection
    /// that sent it ends, and only that one: others to the same host whose
    /// messages the driver holds go when the link comes.
    pub fn send_refused(&mut self, host: Ipv4Addr, link: Option<LinkId>, msg: &CmMessage) {
        if link.is_some() {
            self.link_down(host, link);
            return;
        }
        let id = msg.from();
        let state = match self.ids.get(&id) {
            Some(i)
                if i.link.is_none() && i.peer.is_some_and(|(h, _)| h == host) && i.state != State::Closed =>
            {
                i.state
            }
            _ => return,
        };
        self.end_unreached(id, state);
    }

    /// The driver sent `msg`, queued for `host` by no link (its
    /// connection bound to none then: the manager knew no link to the
    /// host, or the Moved of an imported connection), by `link`, the
    /// host's newest as the driver sees it: if it is the connection's
    /// first (a REQ, or a Moved), the connection belongs to that link,
    /// whatever [`Self::link_up`] bound it to meanwhile (a driver may
    /// report several links to the host at once, and the first bound it),
    /// so that its peer's answers, which come by the link its message went
    /// by, are its own ([`Self::by_its_link`]). A later one does not move
    /// it (it went by its connection's link if it had one,
    /// [`Self::poll_transmit_by`]).
    pub fn sent_by(&mut self, host: Ipv4Addr, msg: &CmMessage, link: LinkId) {
        let id = msg.from();
        if id == 0 || self.is_local(host) || !matches!(msg, CmMessage::Req { .. } | CmMessage::Moved { .. }) {
            return;
        }
        if let Some(i) = self.ids.get_mut(&id) {
            if i.state != State::Closed && i.peer.is_some_and(|(h, _)| h == host) {
                i.link = Some(link);
            }
        }
    }

    /// Ends connection `id` (in `state`) whose peer cannot be reached.
    fn end_unreached(&mut self, id: u32, state: State) {
        match state {
            State::ReqSent => self.close(id, EventKind::Unreachable, -errno::ENETUNREACH),
            State::ReqReceived | State::RepSent => {
                self.close(id, EventKind::ConnectError, -errno::ECONNRESET)
            }
            _ => self.close(id, EventKind::Disconnected, 0),
        }
    }

    /// The earliest timer, if any.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let timer = self.timers.first().map(|&(t, _)| t);
        match (timer, self.linger.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs the timers due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        for (host, link, req) in self.linger.expire(now) {
            self.refuse_req(host, link, &req);
        }
        while let Some(&(t, id)) = self.timers.first() {
            if t > now {
                break;
            }
            self.timers.remove(&(t, id));
            let Some(i) = self.ids.get_mut(&id) else { continue };
            i.deadline = None;
            // (A paused tenant's timers were disarmed at the pause.)
            let (state, peer) = (i.state, i.peer.map(|(_, n)| n));
            match state {
                State::ReqSent | State::RepSent => {
                    // Tell the peer, so that a late answer finds no one
                    // waiting (by our number, if it never answered).
                    if let Some(theirs) = peer {
                        let msg = CmMessage::Rej {
                            to: theirs,
                            from: id,
                            reason: reject::TIMEOUT,
                            private_data: vec![],
                        };
                        self.send_for(id, msg);
                    }
                    let kind = if state == State::ReqSent {
                        EventKind::Unreachable
                    } else {
                        EventKind::ConnectError
                    };
                    self.close(id, kind, -errno::ETIMEDOUT);
                }
                State::DreqSent => self.close(id, EventKind::Disconnected, 0),
                _ => {}
            }
        }
    }

    pub fn poll_event(&mut self) -> Option<CmEvent> {
        self.events.pop_front()
    }

    /// The next message to send, and the host it goes to (the link it
    /// goes by left out: for a driver that has none).
    pub fn poll_transmit(&mut self) -> Option<(Ipv4Addr, CmMessage)> {
        self.transmit.pop_front().map(|(host, _, msg)| (host, msg))
    }

    /// The next message to send, the host it goes to, and the link it
    /// goes by: its connection's (`None`: the host's newest, or a dial if
    /// there is none; or this host). A message for a link that is gone
    /// cannot be sent: the driver reports it down.
    ///
    /// One queued by no link (the manager knew none to the host then)
    /// goes by the link its connection is bound to now, if it is
    /// ([`Self::link_up`] bound it meanwhile), unless it is the
    /// connection's first, a REQ or a Moved: that goes by the driver's
    /// choice, which binds the connection ([`Self::sent_by`]).
    pub fn poll_transmit_by(&mut self) -> Option<(Ipv4Addr, Option<LinkId>, CmMessage)> {
        let (host, link, msg) = self.transmit.pop_front()?;
        let link = link.or_else(|| self.bound_link(host, &msg));
        Some((host, link, msg))
    }

    /// The link that connection `msg.from()` (if it is the message's, to
    /// `host`) is bound to, for a message that is not its first (REQ,
    /// Moved).
    fn bound_link(&self, host: Ipv4Addr, msg: &CmMessage) -> Option<LinkId> {
        if matches!(msg, CmMessage::Req { .. } | CmMessage::Moved { .. }) || msg.from() == 0 {
            return None;
        }
        let i = self.ids.get(&msg.from())?;
        match i.peer {
            Some((h, n)) if h == host && Some(n) == msg.to() => i.link,
            _ => None,
        }
    }

    /// Whether messages wait for [`Self::poll_transmit`].
    pub fn transmit_pending(&self) -> bool {
        !self.transmit.is_empty()
    }

    /// The address vector that reaches the device of `remote`'s host: a
    /// peer on this host (by any of its addresses, loopback included) is
    /// reached through this device's own GID.
    fn peer_av(&self, remote: SocketAddrV4) -> AhAttr {
        let host = match self.addrs.first() {
            Some(&own) if self.is_local(*remote.ip()) => own,
            _ => *remote.ip(),
        };
        AhAttr {
            dgid: Gid::from_ipv4(host.octets()),
            dlid: lid_of_ipv4(host.octets()),
            is_global: true,
            hop_limit: 64,
            port_num: 1,
            ..AhAttr::default()
        }
    }

    /// `rdma_init_qp_attr`: the attributes that bring the id's QP to
    /// `state` (INIT, RTR or RTS), from what both sides said, as the
    /// kernel's CMA and IB CM give them.
    pub fn init_qp_attr(
        &self,
        ctx: ContextId,
        id: u32,
        state: QpState,
    ) -> Result<(QpAttr, QpAttrMask), CmError> {
        let i = self.ids.get(&id).filter(|i| i.ctx == ctx).ok_or(CmError::NoSuchId)?;
        let mut a = QpAttr { qp_state: state, port_num: 1, ..QpAttr::default() };
        let (req, rep) = if i.active {
            (i.ours.as_ref(), i.theirs.as_ref())
        } else {
            (i.theirs.as_ref(), i.ours.as_ref())
        };
        // The RDMA reads and atomics this side takes in (responder
        // resources) and sends out at once (initiator depth): the last
        // word of the exchange so far decides, as in the IB CM.
        let (responder, initiator) = match (i.active, rep, req) {
            (true, Some(r), _) => (r.initiator_depth, r.responder_resources),
            (false, Some(r), _) => (r.responder_resources, r.initiator_depth),
            (false, None, Some(q)) => (q.initiator_depth, q.responder_resources),
            (true, None, Some(q)) => (q.responder_resources, q.initiator_depth),
            (_, None, None) => (0, 0),
        };
        let ud = i.ps.is_ud();
        match state {
            QpState::Init => {
                let mut mask = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT;
                if ud {
                    a.qkey = UD_QKEY;
                    mask |= QpAttrMask::QKEY;
                } else {
                    // Before the exchange, no remote access; after it,
                    // writes, and reads and atomics if this side takes any.
                    if i.theirs.is_some() {
                        a.qp_access_flags = AccessFlags::REMOTE_WRITE;
                        if responder > 0 {
                            a.qp_access_flags |= AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
                        }
                    }
                    mask |= QpAttrMask::ACCESS_FLAGS;
                }
                Ok((a, mask))
            }
            QpState::Rtr if ud => {
                // A UD QP takes no address vector, but the peer's is
                // given beside the state (outside the mask) once known:
                // the address handle that rdma_cm's UD events carry.
                if let Some(remote) = i.remote {
                    a.ah_attr = self.peer_av(remote);
                }
                Ok((a, QpAttrMask::STATE))
            }
            QpState::Rts if ud => {
                a.sq_psn = i.psn;
                Ok((a, QpAttrMask::STATE | QpAttrMask::SQ_PSN))
            }
            QpState::Rtr => {
                let t = i.theirs.as_ref().ok_or(CmError::WrongState)?;
                let remote = i.remote.ok_or(CmError::WrongState)?;
                a.path_mtu = Mtu::Mtu4096;
                a.dest_qp_num = t.qp_num;
                a.rq_psn = t.start_psn;
                a.ah_attr = self.peer_av(remote);
                a.max_dest_rd_atomic = responder;
                a.min_rnr_timer = 12;
                let mask = QpAttrMask::STATE
                    | QpAttrMask::AV
                    | QpAttrMask::PATH_MTU
                    | QpAttrMask::DEST_QPN
                    | QpAttrMask::RQ_PSN
                    | QpAttrMask::MAX_DEST_RD_ATOMIC
                    | QpAttrMask::MIN_RNR_TIMER;
                Ok((a, mask))
            }
            QpState::Rts => {
                let q = req.ok_or(CmError::WrongState)?;
                a.sq_psn = i.psn;
                a.timeout = 14;
                a.retry_cnt = q.retry_count.min(7);
                // The REQ's RNR retry count is the responder's, the REP's
                // the requester's.
                a.rnr_retry = match (i.active, rep) {
                    (true, Some(r)) => r.rnr_retry_count,
                    _ => q.rnr_retry_count,
                }
                .min(7);
                a.max_rd_atomic = initiator;
                let mask = QpAttrMask::STATE
                    | QpAttrMask::SQ_PSN
                    | QpAttrMask::TIMEOUT
                    | QpAttrMask::RETRY_CNT
                    | QpAttrMask::RNR_RETRY
                    | QpAttrMask::MAX_QP_RD_ATOMIC;
                Ok((a, mask))
            }
            _ => Err(CmError::Invalid("rdma_init_qp_attr gives INIT, RTR or RTS")),
        }
    }
}

/// The Q_Key of rdma_cm's UD ids (`RDMA_UDP_QKEY`).
pub const UD_QKEY: u32 = 0x0123_4567;

fn check_private(data: &[u8], max: usize) -> Result<(), CmError> {
    if data.len() > max {
        return Err(CmError::PrivateDataTooLong { got: data.len(), max });
    }
    Ok(())
}

impl Default for ConnInfo {
    fn default() -> Self {
        ConnInfo {
            qp_num: 0,
            start_psn: 0,
            responder_resources: 0,
            initiator_depth: 0,
            flow_control: 0,
            retry_count: 7,
            rnr_retry_count: 7,
            srq: false,
            private_data: Vec::new(),
        }
    }
}
