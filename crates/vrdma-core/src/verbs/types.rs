use bitflags::bitflags;
use serde::{Deserialize, Serialize};

macro_rules! verbs_enum {
    ($(#[$m:meta])* $name:ident : $repr:ty { $($(#[$vm:meta])* $v:ident = $n:expr),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[repr($repr)]
        pub enum $name { $($(#[$vm])* $v = $n),+ }

        impl $name {
            /// Decodes the verbs.h value; `None` for a value that names nothing.
            pub fn from_raw(raw: $repr) -> Option<Self> {
                match raw { $($n => Some(Self::$v),)+ _ => None }
            }
            pub fn raw(self) -> $repr { self as $repr }
        }
    };
}

verbs_enum!(
    /// `enum ibv_qp_state`.
    QpState: u8 { Reset = 0, Init = 1, Rtr = 2, Rts = 3, Sqd = 4, Sqe = 5, Err = 6 }
);

verbs_enum!(
    /// `enum ibv_qp_type` (the subset vRDMA implements).
    QpType: u8 { Rc = 2, Uc = 3, Ud = 4 }
);

verbs_enum!(
    /// `enum ibv_mtu`.
    Mtu: u8 { Mtu256 = 1, Mtu512 = 2, Mtu1024 = 3, Mtu2048 = 4, Mtu4096 = 5 }
);

impl Mtu {
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

verbs_enum!(
    /// `enum ibv_wc_status`.
    WcStatus: u8 {
        Success = 0, LocLenErr = 1, LocQpOpErr = 2, LocEecOpErr = 3, LocProtErr = 4,
        WrFlushErr = 5, MwBindErr = 6, BadRespErr = 7, LocAccessErr = 8, RemInvReqErr = 9,
        RemAccessErr = 10, RemOpErr = 11, RetryExcErr = 12, RnrRetryExcErr = 13,
        LocRddViolErr = 14, RemInvRdReqErr = 15, RemAbortErr = 16, InvEecnErr = 17,
        InvEecStateErr = 18, FatalErr = 19, RespTimeoutErr = 20, GeneralErr = 21,
    }
);

impl WcStatus {
    /// `ibv_wc_status_str`'s wording.
    pub fn as_str(self) -> &'static str {
        use WcStatus::*;
        match self {
            Success => "success",
            LocLenErr => "local length error",
            LocQpOpErr => "local QP operation error",
            LocEecOpErr => "local EE context operation error",
            LocProtErr => "local protection error",
            WrFlushErr => "Work Request Flushed Error",
            MwBindErr => "memory management operation error",
            BadRespErr => "bad response error",
            LocAccessErr => "local access error",
            RemInvReqErr => "remote invalid request error",
            RemAccessErr => "remote access error",
            RemOpErr => "remote operation error",
            RetryExcErr => "transport retry counter exceeded",
            RnrRetryExcErr => "RNR retry counter exceeded",
            LocRddViolErr => "local RDD violation error",
            RemInvRdReqErr => "remote invalid RD request",
            RemAbortErr => "aborted error",
            InvEecnErr => "invalid EE context number",
            InvEecStateErr => "invalid EE context state",
            FatalErr => "fatal error",
            RespTimeoutErr => "response timeout error",
            GeneralErr => "general error",
        }
    }
}

verbs_enum!(
    /// `enum ibv_wc_opcode`.
    WcOpcode: u8 {
        Send = 0, RdmaWrite = 1, RdmaRead = 2, CompSwap = 3, FetchAdd = 4,
        Recv = 128, RecvRdmaWithImm = 129,
    }
);

verbs_enum!(
    /// `enum ibv_wr_opcode` (the opcodes vRDMA executes).
    SendOpcode: u8 {
        RdmaWrite = 0, RdmaWriteWithImm = 1, Send = 2, SendWithImm = 3, RdmaRead = 4,
        AtomicCmpAndSwp = 5, AtomicFetchAndAdd = 6,
    }
);

impl WcOpcode {
    /// A completion of a receive WR (the others complete send WRs).
    #[inline]
    pub fn is_recv(self) -> bool {
        matches!(self, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm)
    }
}

impl SendOpcode {
    /// The opcode of the requester's completion.
    #[inline]
    pub fn wc_opcode(self) -> WcOpcode {
        match self {
            SendOpcode::Send | SendOpcode::SendWithImm => WcOpcode::Send,
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => WcOpcode::RdmaWrite,
            SendOpcode::RdmaRead => WcOpcode::RdmaRead,
            SendOpcode::AtomicCmpAndSwp => WcOpcode::CompSwap,
            SendOpcode::AtomicFetchAndAdd => WcOpcode::FetchAdd,
        }
    }

    pub fn is_atomic(self) -> bool {
        matches!(self, SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd)
    }

    /// Whether the responder consumes a receive work request.
    pub fn consumes_recv(self) -> bool {
        matches!(self, SendOpcode::Send | SendOpcode::SendWithImm | SendOpcode::RdmaWriteWithImm)
    }

    #[inline]
    pub fn has_imm(self) -> bool {
        matches!(self, SendOpcode::SendWithImm | SendOpcode::RdmaWriteWithImm)
    }

    /// Whether the requester's local SGEs are written (reads and atomics).
    pub fn writes_local(self) -> bool {
        matches!(self, SendOpcode::RdmaRead) || self.is_atomic()
    }
}

verbs_enum!(
    /// `enum ibv_event_type`.
    AsyncEventType: u8 {
        CqErr = 0, QpFatal = 1, QpReqErr = 2, QpAccessErr = 3, CommEst = 4, SqDrained = 5,
        PathMig = 6, PathMigErr = 7, DeviceFatal = 8, PortActive = 9, PortErr = 10,
        LidChange = 11, PkeyChange = 12, SmChange = 13, SrqErr = 14, SrqLimitReached = 15,
        QpLastWqeReached = 16, ClientReregister = 17, GidChange = 18,
    }
);

bitflags! {
    /// `enum ibv_access_flags`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
    pub struct AccessFlags: u32 {
        const LOCAL_WRITE = 1;
        const REMOTE_WRITE = 1 << 1;
        const REMOTE_READ = 1 << 2;
        const REMOTE_ATOMIC = 1 << 3;
        const MW_BIND = 1 << 4;
        const ZERO_BASED = 1 << 5;
        const ON_DEMAND = 1 << 6;
        const HUGETLB = 1 << 7;
        const RELAXED_ORDERING = 1 << 20;
    }
}

impl AccessFlags {
    /// What a memory region of vRDMA may ask for: no memory windows, no
    /// zero-based or on-demand regions, no huge-page hint.
    pub const FOR_REGIONS: AccessFlags = AccessFlags::LOCAL_WRITE
        .union(AccessFlags::REMOTE_WRITE)
        .union(AccessFlags::REMOTE_READ)
        .union(AccessFlags::REMOTE_ATOMIC)
        .union(AccessFlags::RELAXED_ORDERING);

    /// Remote write or atomic access needs local write, as `ibv_reg_mr` demands.
    pub fn is_consistent(self) -> bool {
        !self.intersects(Self::REMOTE_WRITE | Self::REMOTE_ATOMIC) || self.contains(Self::LOCAL_WRITE)
    }
}

bitflags! {
    /// `enum ibv_send_flags`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
    pub struct SendFlags: u32 {
        const FENCE = 1;
        const SIGNALED = 1 << 1;
        const SOLICITED = 1 << 2;
        const INLINE = 1 << 3;
        const IP_CSUM = 1 << 4;
    }
}

bitflags! {
    /// `enum ibv_wc_flags`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
    pub struct WcFlags: u32 {
        const GRH = 1;
        const WITH_IMM = 1 << 1;
        const IP_CSUM_OK = 1 << 2;
        const WITH_INV = 1 << 3;
    }
}

bitflags! {
    /// `enum ibv_qp_attr_mask`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
    pub struct QpAttrMask: u32 {
        const STATE = 1;
        const CUR_STATE = 1 << 1;
        const EN_SQD_ASYNC_NOTIFY = 1 << 2;
        const ACCESS_FLAGS = 1 << 3;
        const PKEY_INDEX = 1 << 4;
        const PORT = 1 << 5;
        const QKEY = 1 << 6;
        const AV = 1 << 7;
        const PATH_MTU = 1 << 8;
        const TIMEOUT = 1 << 9;
        const RETRY_CNT = 1 << 10;
        const RNR_RETRY = 1 << 11;
        const RQ_PSN = 1 << 12;
        const MAX_QP_RD_ATOMIC = 1 << 13;
        const ALT_PATH = 1 << 14;
        const MIN_RNR_TIMER = 1 << 15;
        const SQ_PSN = 1 << 16;
        const MAX_DEST_RD_ATOMIC = 1 << 17;
        const PATH_MIG_STATE = 1 << 18;
        const CAP = 1 << 19;
        const DEST_QPN = 1 << 20;
        const RATE_LIMIT = 1 << 25;
    }
}
