//! The `ibv_modify_qp` state machine: which state transitions a QP of each
//! type may make, which attributes each transition requires and which it
//! accepts, following the Linux kernel's `qp_state_table`
//! (`ib_modify_qp_is_ok`), plus range checks of the attribute values against
//! the device and port limits.
//!
//! Real adapters reject a modify that skips a state, leaves out a required
//! attribute or carries one the transition does not take. Applying the same
//! rules here makes a mis-ordered or incomplete bring-up fail on vRDMA as it
//! would on hardware, instead of happening to work and then breaking on the
//! first real HCA.

use crate::verbs::{Mtu, QpAttr, QpAttrMask, QpState, QpType};

/// Device and port limits that attribute values are checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModifyLimits {
    pub max_mtu: Mtu,
    pub gid_tbl_len: u32,
    pub pkey_tbl_len: u16,
    /// Bound for `max_rd_atomic`.
    pub max_qp_rd_atom: u32,
    /// Bound for `max_dest_rd_atomic`.
    pub max_qp_dest_rd_atom: u32,
    /// Ports are numbered `1..=phys_port_cnt`.
    pub phys_port_cnt: u8,
}

/// Why `check_modify` refused a modify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModifyError {
    #[error(
        "invalid QP state transition {} -> {} for QP type {}",
        state_name(.from),
        state_name(.to),
        type_name(.qp_type)
    )]
    InvalidTransition { qp_type: QpType, from: QpState, to: QpState },
    #[error(
        "QP transition {} -> {} requires attributes missing from the mask: {}",
        state_name(.from),
        state_name(.to),
        mask_names(.missing)
    )]
    MissingAttributes { from: QpState, to: QpState, missing: QpAttrMask },
    #[error(
        "QP transition {} -> {} does not accept attributes: {}",
        state_name(.from),
        state_name(.to),
        mask_names(.extra)
    )]
    UnexpectedAttributes { from: QpState, to: QpState, extra: QpAttrMask },
    #[error(
        "cur_qp_state says {} but the QP is in {}",
        state_name(.claimed),
        state_name(.actual)
    )]
    CurrentStateMismatch { claimed: QpState, actual: QpState },
    #[error("{field} = {value} is out of range: it must be at least {min} and below {end}")]
    BadValue {
        field: &'static str,
        value: u64,
        /// Smallest valid value.
        min: u64,
        /// One past the largest valid value (`min == end`: nothing is valid).
        end: u64,
    },
}

/// The attributes one transition must carry and those it may carry, besides
/// `STATE` (and `CUR_STATE`, which is always accepted).
#[derive(Debug, Clone, Copy)]
struct Rule {
    required: QpAttrMask,
    optional: QpAttrMask,
}

/// The kernel's `qp_state_table` rows for RC, UC and UD; `None` for a
/// transition the table does not allow.
fn rule(qp_type: QpType, from: QpState, to: QpState) -> Option<Rule> {
    use QpState::{Err, Init, Reset, Rtr, Rts, Sqd, Sqe};
    use QpType::{Rc, Uc, Ud};
    type M = QpAttrMask;

    let r = |required: M, optional: M| Some(Rule { required, optional });
    let none = M::empty();

    match (from, to) {
        (_, Reset) => r(none, none),
        // As the kernel's table has it: a QP leaves RESET only for INIT.
        (Reset, Err) => None,
        (_, Err) => r(none, none),
        (Reset, Init) => match qp_type {
            Rc | Uc => r(M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, none),
            Ud => r(M::PKEY_INDEX | M::PORT | M::QKEY, none),
        },
        (Init, Init) => match qp_type {
            Rc | Uc => r(none, M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
            Ud => r(none, M::PKEY_INDEX | M::PORT | M::QKEY),
        },
        (Init, Rtr) => {
            let peer = M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN;
            let opt = M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX;
            match qp_type {
                Rc => r(peer | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER, opt),
                Uc => r(peer, opt),
                Ud => r(none, M::PKEY_INDEX | M::QKEY),
            }
        }
        (Rtr, Rts) => {
            let opt = M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE;
            match qp_type {
                Rc => r(
                    M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC,
                    opt | M::MIN_RNR_TIMER,
                ),
                Uc => r(M::SQ_PSN, opt),
                Ud => r(M::SQ_PSN, M::CUR_STATE | M::QKEY),
            }
        }
        (Rts, Rts) | (Sqd, Rts) => {
            let opt = M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE;
            match qp_type {
                Rc => r(none, opt | M::MIN_RNR_TIMER),
                Uc => r(none, opt),
                Ud => r(none, M::CUR_STATE | M::QKEY),
            }
        }
        (Rts, Sqd) => r(none, M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => match qp_type {
            Rc => r(
                none,
                M::PORT
                    | M::AV
                    | M::TIMEOUT
                    | M::RETRY_CNT
                    | M::RNR_RETRY
                    | M::MAX_QP_RD_ATOMIC
                    | M::MAX_DEST_RD_ATOMIC
                    | M::ALT_PATH
                    | M::ACCESS_FLAGS
                    | M::PKEY_INDEX
                    | M::MIN_RNR_TIMER
                    | M::PATH_MIG_STATE,
            ),
            Uc => r(none, M::AV | M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX | M::PATH_MIG_STATE),
            Ud => r(none, M::PKEY_INDEX | M::QKEY),
        },
        // An RC QP never enters SQE (its send errors take it to ERR).
        (Sqe, Rts) => match qp_type {
            Rc => None,
            Uc => r(none, M::CUR_STATE | M::ACCESS_FLAGS),
            Ud => r(none, M::CUR_STATE | M::QKEY),
        },
        _ => None,
    }
}

/// Checks a modify of a QP of `qp_type` currently in `cur` against the rules;
/// returns the target state (`attr.qp_state` when `mask` has `STATE`, else
/// `cur`).
pub fn check_modify(
    qp_type: QpType,
    cur: QpState,
    attr: &QpAttr,
    mask: QpAttrMask,
    limits: &ModifyLimits,
) -> Result<QpState, ModifyError> {
    if mask.contains(QpAttrMask::CUR_STATE) && attr.cur_qp_state != cur {
        return Err(ModifyError::CurrentStateMismatch { claimed: attr.cur_qp_state, actual: cur });
    }

    let to = if mask.contains(QpAttrMask::STATE) { attr.qp_state } else { cur };
    let Some(rule) = rule(qp_type, cur, to) else {
        return Err(ModifyError::InvalidTransition { qp_type, from: cur, to });
    };

    let missing = rule.required.difference(mask);
    if !missing.is_empty() {
        return Err(ModifyError::MissingAttributes { from: cur, to, missing });
    }

    // IBV_QP_CUR_STATE is optional only on the way back to RTS, from a
    // state a QP can be in without knowing it (the kernel's table).
    let cur_state_ok =
        to == QpState::Rts && matches!(cur, QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe);
    let mut allowed = rule.required | rule.optional | QpAttrMask::STATE;
    if cur_state_ok {
        allowed |= QpAttrMask::CUR_STATE;
    }
    // Raw bits, so that bits naming no attribute count as unexpected too.
    let extra = QpAttrMask::from_bits_retain(mask.bits() & !allowed.bits());
    if !extra.is_empty() {
        return Err(ModifyError::UnexpectedAttributes { from: cur, to, extra });
    }

    check_values(attr, mask, limits)?;
    Ok(to)
}

/// Range checks of the values whose attributes are in `mask`.
fn check_values(attr: &QpAttr, mask: QpAttrMask, limits: &ModifyLimits) -> Result<(), ModifyError> {
    const PSN_END: u64 = 1 << 24;
    let port_end = u64::from(limits.phys_port_cnt) + 1;
    let has = |m: QpAttrMask| mask.contains(m);

    if has(QpAttrMask::PKEY_INDEX) {
        in_range("pkey_index", attr.pkey_index.into(), 0, limits.pkey_tbl_len.into())?;
    }
    if has(QpAttrMask::PORT) {
        in_range("port_num", attr.port_num.into(), 1, port_end)?;
    }
    if has(QpAttrMask::AV) {
        let ah = &attr.ah_attr;
        if ah.is_global {
            in_range("ah_attr.grh.sgid_index", ah.sgid_index.into(), 0, limits.gid_tbl_len.into())?;
        }
        in_range("ah_attr.port_num", ah.port_num.into(), 1, port_end)?;
    }
    if has(QpAttrMask::PATH_MTU) {
        in_range(
            "path_mtu",
            attr.path_mtu.raw().into(),
            Mtu::Mtu256.raw().into(),
            u64::from(limits.max_mtu.raw()) + 1,
        )?;
    }
    if has(QpAttrMask::TIMEOUT) {
        in_range("timeout", attr.timeout.into(), 0, 32)?;
    }
    if has(QpAttrMask::RETRY_CNT) {
        in_range("retry_cnt", attr.retry_cnt.into(), 0, 8)?;
    }
    if has(QpAttrMask::RNR_RETRY) {
        in_range("rnr_retry", attr.rnr_retry.into(), 0, 8)?;
    }
    if has(QpAttrMask::RQ_PSN) {
        in_range("rq_psn", attr.rq_psn.into(), 0, PSN_END)?;
    }
    if has(QpAttrMask::MAX_QP_RD_ATOMIC) {
        in_range("max_rd_atomic", attr.max_rd_atomic.into(), 0, u64::from(limits.max_qp_rd_atom) + 1)?;
    }
    if has(QpAttrMask::MIN_RNR_TIMER) {
        in_range("min_rnr_timer", attr.min_rnr_timer.into(), 0, 32)?;
    }
    if has(QpAttrMask::SQ_PSN) {
        in_range("sq_psn", attr.sq_psn.into(), 0, PSN_END)?;
    }
    if has(QpAttrMask::MAX_DEST_RD_ATOMIC) {
        in_range(
            "max_dest_rd_atomic",
            attr.max_dest_rd_atomic.into(),
            0,
            u64::from(limits.max_qp_dest_rd_atom) + 1,
        )?;
    }
    if has(QpAttrMask::DEST_QPN) {
        in_range("dest_qp_num", attr.dest_qp_num.into(), 0, PSN_END)?;
    }
    Ok(())
}

fn in_range(field: &'static str, value: u64, min: u64, end: u64) -> Result<(), ModifyError> {
    if (min..end).contains(&value) {
        Ok(())
    } else {
        Err(ModifyError::BadValue { field, value, min, end })
    }
}

/// Copies the masked attributes of `attr` into `stored` and sets
/// `stored.qp_state`/`cur_qp_state` to `new_state`. Only call after
/// [`check_modify`] passed. `ALT_PATH`, `PATH_MIG_STATE` and `RATE_LIMIT`
/// have no stored field (vRDMA has no path migration or rate limiting) and
/// change nothing.
pub fn apply_modify(stored: &mut QpAttr, attr: &QpAttr, mask: QpAttrMask, new_state: QpState) {
    type M = QpAttrMask;
    let has = |m: M| mask.contains(m);

    if has(M::EN_SQD_ASYNC_NOTIFY) {
        stored.en_sqd_async_notify = attr.en_sqd_async_notify;
    }
    if has(M::ACCESS_FLAGS) {
        stored.qp_access_flags = attr.qp_access_flags;
    }
    if has(M::PKEY_INDEX) {
        stored.pkey_index = attr.pkey_index;
    }
    if has(M::PORT) {
        stored.port_num = attr.port_num;
    }
    if has(M::QKEY) {
        stored.qkey = attr.qkey;
    }
    if has(M::AV) {
        stored.ah_attr = attr.ah_attr;
    }
    if has(M::PATH_MTU) {
        stored.path_mtu = attr.path_mtu;
    }
    if has(M::TIMEOUT) {
        stored.timeout = attr.timeout;
    }
    if has(M::RETRY_CNT) {
        stored.retry_cnt = attr.retry_cnt;
    }
    if has(M::RNR_RETRY) {
        stored.rnr_retry = attr.rnr_retry;
    }
    if has(M::RQ_PSN) {
        stored.rq_psn = attr.rq_psn;
    }
    if has(M::MAX_QP_RD_ATOMIC) {
        stored.max_rd_atomic = attr.max_rd_atomic;
    }
    if has(M::MIN_RNR_TIMER) {
        stored.min_rnr_timer = attr.min_rnr_timer;
    }
    if has(M::SQ_PSN) {
        stored.sq_psn = attr.sq_psn;
    }
    if has(M::MAX_DEST_RD_ATOMIC) {
        stored.max_dest_rd_atomic = attr.max_dest_rd_atomic;
    }
    if has(M::CAP) {
        stored.cap = attr.cap;
    }
    if has(M::DEST_QPN) {
        stored.dest_qp_num = attr.dest_qp_num;
    }
    stored.qp_state = new_state;
    stored.cur_qp_state = new_state;
}

fn state_name(state: &QpState) -> &'static str {
    match state {
        QpState::Reset => "RESET",
        QpState::Init => "INIT",
        QpState::Rtr => "RTR",
        QpState::Rts => "RTS",
        QpState::Sqd => "SQD",
        QpState::Sqe => "SQE",
        QpState::Err => "ERR",
    }
}

fn type_name(qp_type: &QpType) -> &'static str {
    match qp_type {
        QpType::Rc => "RC",
        QpType::Uc => "UC",
        QpType::Ud => "UD",
    }
}

/// `IBV_QP_A | IBV_QP_B`, as `<infiniband/verbs.h>` spells the bits.
fn mask_names(mask: &QpAttrMask) -> String {
    let mut names: Vec<String> = mask.iter_names().map(|(name, _)| format!("IBV_QP_{name}")).collect();
    let unknown = mask.bits() & !QpAttrMask::all().bits();
    if unknown != 0 {
        names.push(format!("{unknown:#x}"));
    }
    names.join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{AccessFlags, AhAttr, Gid, QpCap};
    // `QpState::Err` stays qualified: a bare `Err` is `Result::Err`.
    use QpState::{Init, Reset, Rtr, Rts, Sqd, Sqe};
    use QpType::{Rc, Uc, Ud};

    type M = QpAttrMask;

    const ERR: QpState = QpState::Err;
    const ALL_STATES: [QpState; 7] = [Reset, Init, Rtr, Rts, Sqd, Sqe, ERR];
    const ALL_TYPES: [QpType; 3] = [Rc, Uc, Ud];

    const RC_INIT: M = M::STATE.union(M::PKEY_INDEX).union(M::PORT).union(M::ACCESS_FLAGS);
    const UD_INIT: M = M::STATE.union(M::PKEY_INDEX).union(M::PORT).union(M::QKEY);
    const UC_RTR: M = M::STATE.union(M::AV).union(M::PATH_MTU).union(M::DEST_QPN).union(M::RQ_PSN);
    const RC_RTR: M = UC_RTR.union(M::MAX_DEST_RD_ATOMIC).union(M::MIN_RNR_TIMER);
    const RC_RTS: M = M::STATE
        .union(M::SQ_PSN)
        .union(M::TIMEOUT)
        .union(M::RETRY_CNT)
        .union(M::RNR_RETRY)
        .union(M::MAX_QP_RD_ATOMIC);
    const UC_RTS: M = M::STATE.union(M::SQ_PSN);

    fn limits() -> ModifyLimits {
        ModifyLimits {
            max_mtu: Mtu::Mtu1024,
            gid_tbl_len: 4,
            pkey_tbl_len: 1,
            max_qp_rd_atom: 16,
            max_qp_dest_rd_atom: 16,
            phys_port_cnt: 1,
        }
    }

    /// Valid, non-default values for every attribute, moving to `to`.
    fn attr(to: QpState) -> QpAttr {
        QpAttr {
            qp_state: to,
            cur_qp_state: Reset,
            path_mtu: Mtu::Mtu1024,
            qkey: 0x1111_1111,
            rq_psn: 0x00ab_cdef,
            sq_psn: 0x0012_3456,
            dest_qp_num: 0x42,
            qp_access_flags: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            cap: QpCap::default(),
            ah_attr: AhAttr {
                dgid: Gid::from_ipv4([10, 0, 0, 2]),
                sgid_index: 1,
                hop_limit: 64,
                is_global: true,
                port_num: 1,
                ..AhAttr::default()
            },
            pkey_index: 0,
            en_sqd_async_notify: true,
            sq_draining: false,
            max_rd_atomic: 4,
            max_dest_rd_atomic: 4,
            min_rnr_timer: 12,
            port_num: 1,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
        }
    }

    fn check(t: QpType, cur: QpState, a: &QpAttr, mask: M) -> Result<QpState, ModifyError> {
        check_modify(t, cur, a, mask, &limits())
    }

    /// Checks `cur -> to` with `mask` and the valid attributes.
    fn check_to(t: QpType, cur: QpState, to: QpState, mask: M) -> Result<QpState, ModifyError> {
        let mut a = attr(to);
        a.cur_qp_state = cur;
        check(t, cur, &a, mask)
    }

    /// Checks and applies one step, asserting it succeeds.
    fn step(t: QpType, stored: &mut QpAttr, to: QpState, mask: M) {
        let a = attr(to);
        let from = stored.qp_state;
        let got = check(t, from, &a, mask).unwrap_or_else(|e| panic!("{from:?} -> {to:?} failed: {e}"));
        assert_eq!(got, to);
        apply_modify(stored, &a, mask, got);
        assert_eq!(stored.qp_state, to);
        assert_eq!(stored.cur_qp_state, to);
    }

    #[test]
    fn rc_bring_up_with_exact_required_masks() {
        let mut qp = QpAttr::default();
        step(Rc, &mut qp, Init, RC_INIT);
        step(Rc, &mut qp, Rtr, RC_RTR);
        step(Rc, &mut qp, Rts, RC_RTS);
        let want = attr(Rts);
        assert_eq!(qp.dest_qp_num, want.dest_qp_num);
        assert_eq!(qp.rq_psn, want.rq_psn);
        assert_eq!(qp.sq_psn, want.sq_psn);
        assert_eq!(qp.ah_attr, want.ah_attr);
        assert_eq!(qp.timeout, want.timeout);
        assert_eq!(qp.max_rd_atomic, want.max_rd_atomic);
        assert_eq!(qp.max_dest_rd_atomic, want.max_dest_rd_atomic);
        assert_eq!(qp.qp_access_flags, want.qp_access_flags);
        // The QKEY was never in a mask, so it stays as created.
        assert_eq!(qp.qkey, 0);
    }

    #[test]
    fn uc_bring_up_with_exact_required_masks() {
        let mut qp = QpAttr::default();
        step(Uc, &mut qp, Init, RC_INIT);
        step(Uc, &mut qp, Rtr, UC_RTR);
        step(Uc, &mut qp, Rts, UC_RTS);
    }

    #[test]
    fn ud_bring_up() {
        let mut qp = QpAttr::default();
        step(Ud, &mut qp, Init, UD_INIT);
        assert_eq!(qp.qkey, 0x1111_1111);
        step(Ud, &mut qp, Rtr, M::STATE);
        step(Ud, &mut qp, Rts, UC_RTS);
        assert_eq!(qp.sq_psn, 0x0012_3456);
        // UD has no peer: the connection attributes are refused.
        assert_eq!(
            check_to(Ud, Init, Rtr, UC_RTR),
            Err(ModifyError::UnexpectedAttributes {
                from: Init,
                to: Rtr,
                extra: M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
            })
        );
    }

    #[test]
    fn each_missing_required_attribute_is_named() {
        let steps = [
            (Rc, Reset, Init, RC_INIT),
            (Rc, Init, Rtr, RC_RTR),
            (Rc, Rtr, Rts, RC_RTS),
            (Uc, Reset, Init, RC_INIT),
            (Uc, Init, Rtr, UC_RTR),
            (Uc, Rtr, Rts, UC_RTS),
            (Ud, Reset, Init, UD_INIT),
            (Ud, Rtr, Rts, UC_RTS),
        ];
        for (t, from, to, full) in steps {
            for bit in full.difference(M::STATE).iter() {
                assert_eq!(
                    check_to(t, from, to, full.difference(bit)),
                    Err(ModifyError::MissingAttributes { from, to, missing: bit }),
                    "{t:?} {from:?} -> {to:?} without {bit:?}"
                );
            }
        }
    }

    #[test]
    fn missing_attributes_are_all_reported() {
        assert_eq!(
            check_to(Rc, Init, Rtr, M::STATE | M::AV),
            Err(ModifyError::MissingAttributes {
                from: Init,
                to: Rtr,
                missing: RC_RTR.difference(M::STATE | M::AV),
            })
        );
    }

    #[test]
    fn unexpected_attributes_are_refused() {
        let cases = [
            // RESET->INIT of a connected QP takes no QKEY; UD has no access rights.
            (Rc, Reset, Init, RC_INIT, M::QKEY),
            (Ud, Reset, Init, UD_INIT, M::ACCESS_FLAGS),
            // The send side is set on RTR->RTS, not before.
            (Rc, Init, Rtr, RC_RTR, M::SQ_PSN),
            (Rc, Init, Rtr, RC_RTR, M::TIMEOUT),
            // UC has no RDMA reads or RNR NAKs.
            (Uc, Init, Rtr, UC_RTR, M::MAX_DEST_RD_ATOMIC),
            (Uc, Rtr, Rts, UC_RTS, M::RETRY_CNT),
            // The primary path is only changed in INIT->RTR or SQD->SQD.
            (Rc, Rtr, Rts, RC_RTS, M::AV),
            (Rc, Rts, Rts, M::STATE, M::SQ_PSN),
            (Rc, Rts, Rts, M::empty(), M::PATH_MTU),
            // vRDMA has no rate limiting; CAP is never modifiable here.
            (Rc, Rtr, Rts, RC_RTS, M::RATE_LIMIT),
            (Rc, Reset, Init, RC_INIT, M::CAP),
            // ->ERR and ->RESET take nothing.
            (Rc, Rts, ERR, M::STATE, M::PORT),
            (Ud, Init, Reset, M::STATE, M::QKEY),
            (Rc, Rts, Sqd, M::STATE, M::ACCESS_FLAGS),
            (Uc, Sqe, Rts, M::STATE, M::ALT_PATH),
            // Bits that name no attribute.
            (Rc, Reset, Init, RC_INIT, M::from_bits_retain(1 << 30)),
        ];
        for (t, from, to, mask, extra) in cases {
            assert_eq!(
                check_to(t, from, to, mask | extra),
                Err(ModifyError::UnexpectedAttributes { from, to, extra }),
                "{t:?} {from:?} -> {to:?} with {extra:?}"
            );
        }
    }

    #[test]
    fn optional_attributes_are_accepted() {
        let cases = [
            (Rc, Init, Init, M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
            (Ud, Init, Init, M::QKEY),
            (Rc, Init, Rtr, RC_RTR | M::ACCESS_FLAGS | M::PKEY_INDEX | M::ALT_PATH),
            (Ud, Init, Rtr, M::STATE | M::QKEY | M::PKEY_INDEX),
            (Rc, Rtr, Rts, RC_RTS | M::MIN_RNR_TIMER | M::ACCESS_FLAGS),
            (Uc, Rtr, Rts, UC_RTS | M::PATH_MIG_STATE | M::ACCESS_FLAGS),
            (Ud, Rtr, Rts, UC_RTS | M::QKEY),
            (Rc, Rts, Rts, M::ACCESS_FLAGS | M::MIN_RNR_TIMER | M::ALT_PATH | M::PATH_MIG_STATE),
            (Uc, Rts, Rts, M::STATE | M::ACCESS_FLAGS),
            (Ud, Rts, Rts, M::QKEY),
            (Rc, Rts, Sqd, M::STATE | M::EN_SQD_ASYNC_NOTIFY),
            (Ud, Rts, Sqd, M::STATE | M::EN_SQD_ASYNC_NOTIFY),
            (Rc, Sqd, Sqd, M::PORT | M::AV | M::TIMEOUT | M::RETRY_CNT | M::MAX_DEST_RD_ATOMIC),
            (Uc, Sqd, Sqd, M::AV | M::PKEY_INDEX),
            (Ud, Sqd, Sqd, M::QKEY),
            (Rc, Sqd, Rts, M::STATE | M::MIN_RNR_TIMER),
            (Uc, Sqe, Rts, M::STATE | M::ACCESS_FLAGS),
            (Ud, Sqe, Rts, M::STATE | M::QKEY),
            (Rc, Reset, Reset, M::empty()),
        ];
        for (t, from, to, mask) in cases {
            assert_eq!(check_to(t, from, to, mask), Ok(to), "{t:?} {from:?} -> {to:?}");
            // CUR_STATE, when right, is optional on the way back to RTS only.
            let back_to_rts = to == Rts && matches!(from, Rtr | Rts | Sqd | Sqe);
            assert_eq!(
                check_to(t, from, to, mask | M::CUR_STATE).is_ok(),
                back_to_rts,
                "{t:?} {from:?} -> {to:?}"
            );
        }
    }

    #[test]
    fn without_state_the_qp_stays_put_if_the_table_allows() {
        let a = attr(Reset); // qp_state is ignored without STATE
        assert_eq!(check(Rc, Rts, &a, M::ACCESS_FLAGS), Ok(Rts));
        assert_eq!(check(Rc, Init, &a, M::PORT), Ok(Init));
        assert_eq!(check(Rc, Sqd, &a, M::TIMEOUT), Ok(Sqd));
        assert_eq!(check(Rc, ERR, &a, M::empty()), Ok(ERR));
        // There is no RTR->RTR, so an RTR QP cannot be modified in place.
        assert_eq!(
            check(Rc, Rtr, &a, M::SQ_PSN),
            Err(ModifyError::InvalidTransition { qp_type: Rc, from: Rtr, to: Rtr })
        );
    }

    #[test]
    fn invalid_transitions_are_refused() {
        let cases = [
            (Rc, Reset, Rts),
            (Rc, Reset, Rtr),
            (Rc, Init, Rts),
            (Rc, Rtr, Sqd),
            (Rc, Sqe, Rts),
            (Rc, Rts, Rtr),
            (Rc, Rts, Init),
            (Rc, ERR, Init),
            (Rc, ERR, Rts),
            (Ud, Reset, Rts),
            (Uc, Init, Rts),
            (Uc, Sqd, Init),
            (Ud, Rtr, Rtr),
        ];
        for (t, from, to) in cases {
            // Even with every attribute, the transition itself is refused.
            assert_eq!(
                check_to(t, from, to, M::all()),
                Err(ModifyError::InvalidTransition { qp_type: t, from, to }),
                "{t:?} {from:?} -> {to:?}"
            );
        }
        // Nothing enters SQE by a modify.
        for t in ALL_TYPES {
            for from in ALL_STATES {
                assert!(matches!(
                    check_to(t, from, Sqe, M::STATE),
                    Err(ModifyError::InvalidTransition { .. })
                ));
            }
        }
    }

    #[test]
    fn any_state_to_err_or_reset_needs_only_state() {
        for t in ALL_TYPES {
            for from in ALL_STATES {
                for to in [ERR, Reset] {
                    if (from, to) == (Reset, ERR) {
                        continue; // Not in the kernel's table: see below.
                    }
                    assert_eq!(check_to(t, from, to, M::STATE), Ok(to), "{t:?} {from:?} -> {to:?}");
                    assert!(check_to(t, from, to, M::STATE | M::CUR_STATE).is_err());
                }
            }
        }
    }

    /// The field and value of the `BadValue` that `cur -> to` with `mask`
    /// and the valid attributes changed by `edit` fails with.
    fn bad(cur: QpState, to: QpState, mask: M, edit: fn(&mut QpAttr)) -> (&'static str, u64) {
        let mut a = attr(to);
        edit(&mut a);
        match check(Rc, cur, &a, mask) {
            Err(ModifyError::BadValue { field, value, .. }) => (field, value),
            other => panic!("{cur:?} -> {to:?}: expected BadValue, got {other:?}"),
        }
    }

    #[test]
    fn values_are_checked_against_limits() {
        let mtu = bad(Init, Rtr, RC_RTR, |a| a.path_mtu = Mtu::Mtu2048);
        assert_eq!(mtu, ("path_mtu", 4));
        let mtu = bad(Init, Rtr, RC_RTR, |a| a.path_mtu = Mtu::Mtu4096);
        assert_eq!(mtu, ("path_mtu", 5));
        assert_eq!(bad(Rtr, Rts, RC_RTS, |a| a.timeout = 32), ("timeout", 32));
        assert_eq!(bad(Rtr, Rts, RC_RTS, |a| a.retry_cnt = 8), ("retry_cnt", 8));
        assert_eq!(bad(Rtr, Rts, RC_RTS, |a| a.rnr_retry = 8), ("rnr_retry", 8));
        let rnr = bad(Init, Rtr, RC_RTR, |a| a.min_rnr_timer = 32);
        assert_eq!(rnr, ("min_rnr_timer", 32));
        let psn = bad(Rtr, Rts, RC_RTS, |a| a.sq_psn = 1 << 24);
        assert_eq!(psn, ("sq_psn", 1 << 24));
        let psn = bad(Init, Rtr, RC_RTR, |a| a.rq_psn = u32::MAX);
        assert_eq!(psn, ("rq_psn", 0xffff_ffff));
        let qpn = bad(Init, Rtr, RC_RTR, |a| a.dest_qp_num = 1 << 24);
        assert_eq!(qpn, ("dest_qp_num", 1 << 24));
        assert_eq!(bad(Reset, Init, RC_INIT, |a| a.port_num = 0), ("port_num", 0));
        assert_eq!(bad(Reset, Init, RC_INIT, |a| a.port_num = 2), ("port_num", 2));
        assert_eq!(bad(Init, Init, M::PORT, |a| a.port_num = 2), ("port_num", 2));
        let pkey = bad(Reset, Init, RC_INIT, |a| a.pkey_index = 1);
        assert_eq!(pkey, ("pkey_index", 1));
        let rd = bad(Rtr, Rts, RC_RTS, |a| a.max_rd_atomic = 17);
        assert_eq!(rd, ("max_rd_atomic", 17));
        let rd = bad(Init, Rtr, RC_RTR, |a| a.max_dest_rd_atomic = 17);
        assert_eq!(rd, ("max_dest_rd_atomic", 17));
        let gid = bad(Init, Rtr, RC_RTR, |a| a.ah_attr.sgid_index = 4);
        assert_eq!(gid, ("ah_attr.grh.sgid_index", 4));
        let port = bad(Init, Rtr, RC_RTR, |a| a.ah_attr.port_num = 2);
        assert_eq!(port, ("ah_attr.port_num", 2));
        // The same checks apply on the later transitions that take them.
        assert_eq!(bad(Sqd, Sqd, M::TIMEOUT, |a| a.timeout = 255), ("timeout", 255));
        let port = bad(Sqd, Sqd, M::AV, |a| a.ah_attr.port_num = 9);
        assert_eq!(port, ("ah_attr.port_num", 9));
        let rnr = bad(Rts, Rts, M::MIN_RNR_TIMER, |a| a.min_rnr_timer = 40);
        assert_eq!(rnr, ("min_rnr_timer", 40));
    }

    #[test]
    fn boundary_values_are_accepted() {
        let mut a = attr(Rts);
        a.timeout = 31;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.sq_psn = 0x00ff_ffff;
        a.max_rd_atomic = 16;
        assert_eq!(check(Rc, Rtr, &a, RC_RTS), Ok(Rts));

        let mut a = attr(Rtr);
        a.path_mtu = Mtu::Mtu1024;
        a.rq_psn = 0x00ff_ffff;
        a.dest_qp_num = 0x00ff_ffff;
        a.min_rnr_timer = 31;
        a.max_dest_rd_atomic = 16;
        a.ah_attr.sgid_index = 3;
        assert_eq!(check(Rc, Init, &a, RC_RTR), Ok(Rtr));

        // Without a GRH the sgid_index is unused.
        a.ah_attr.is_global = false;
        a.ah_attr.sgid_index = 200;
        assert_eq!(check(Rc, Init, &a, RC_RTR), Ok(Rtr));

        // Any QKEY is valid.
        let mut a = attr(Init);
        a.qkey = u32::MAX;
        assert_eq!(check(Ud, Reset, &a, UD_INIT), Ok(Init));
    }

    #[test]
    fn values_outside_the_mask_are_not_checked() {
        let mut a = attr(Rtr);
        a.timeout = 200;
        a.retry_cnt = 200;
        a.sq_psn = u32::MAX;
        a.port_num = 0;
        assert_eq!(check(Rc, Init, &a, RC_RTR), Ok(Rtr));
    }

    #[test]
    fn bad_value_reports_the_valid_range() {
        let mut a = attr(Init);
        a.port_num = 2;
        let err = check(Rc, Reset, &a, RC_INIT).unwrap_err();
        let want = ModifyError::BadValue { field: "port_num", value: 2, min: 1, end: 2 };
        assert_eq!(err, want);
        assert_eq!(err.to_string(), "port_num = 2 is out of range: it must be at least 1 and below 2");
    }

    #[test]
    fn cur_state_must_match() {
        let mut a = attr(Rts);
        a.cur_qp_state = Rtr;
        let mask = M::STATE | M::CUR_STATE;
        assert_eq!(
            check(Rc, Rts, &a, mask),
            Err(ModifyError::CurrentStateMismatch { claimed: Rtr, actual: Rts })
        );
        a.cur_qp_state = Rts;
        assert_eq!(check(Rc, Rts, &a, mask), Ok(Rts));

        // Checked on any transition, before the table.
        let mut a = attr(Init);
        a.cur_qp_state = Init;
        assert_eq!(
            check(Rc, Reset, &a, RC_INIT | M::CUR_STATE),
            Err(ModifyError::CurrentStateMismatch { claimed: Init, actual: Reset })
        );
        // Without CUR_STATE the field is ignored.
        assert_eq!(check(Rc, Reset, &a, RC_INIT), Ok(Init));
    }

    #[test]
    fn apply_copies_only_masked_fields() {
        let src =
            QpAttr { cap: QpCap { max_send_wr: 9, ..QpCap::default() }, sq_draining: true, ..attr(Rtr) };
        let before = QpAttr::default();
        let mut stored = before;
        let mask = M::STATE | M::DEST_QPN | M::RQ_PSN | M::AV | M::MIN_RNR_TIMER | M::CAP;
        apply_modify(&mut stored, &src, mask, Rtr);

        let want = QpAttr {
            qp_state: Rtr,
            cur_qp_state: Rtr,
            dest_qp_num: src.dest_qp_num,
            rq_psn: src.rq_psn,
            ah_attr: src.ah_attr,
            min_rnr_timer: src.min_rnr_timer,
            cap: src.cap,
            ..before
        };
        assert_eq!(stored, want);
        // The unmasked fields of src differ, so they really were left alone.
        assert_ne!(src.sq_psn, stored.sq_psn);
        assert_ne!(src.timeout, stored.timeout);
        assert_ne!(src.qp_access_flags, stored.qp_access_flags);
        assert_ne!(src.sq_draining, stored.sq_draining);
    }

    type Getter = fn(&QpAttr) -> u64;

    #[test]
    fn apply_copies_every_field_under_its_own_bit() {
        let src = QpAttr { pkey_index: 3, ..attr(Rts) };
        let cases: [(M, Getter); 16] = [
            (M::EN_SQD_ASYNC_NOTIFY, |a| a.en_sqd_async_notify.into()),
            (M::ACCESS_FLAGS, |a| a.qp_access_flags.bits().into()),
            (M::PKEY_INDEX, |a| a.pkey_index.into()),
            (M::PORT, |a| a.port_num.into()),
            (M::QKEY, |a| a.qkey.into()),
            (M::AV, |a| a.ah_attr.hop_limit.into()),
            (M::PATH_MTU, |a| a.path_mtu.raw().into()),
            (M::TIMEOUT, |a| a.timeout.into()),
            (M::RETRY_CNT, |a| a.retry_cnt.into()),
            (M::RNR_RETRY, |a| a.rnr_retry.into()),
            (M::RQ_PSN, |a| a.rq_psn.into()),
            (M::MAX_QP_RD_ATOMIC, |a| a.max_rd_atomic.into()),
            (M::MIN_RNR_TIMER, |a| a.min_rnr_timer.into()),
            (M::SQ_PSN, |a| a.sq_psn.into()),
            (M::MAX_DEST_RD_ATOMIC, |a| a.max_dest_rd_atomic.into()),
            (M::DEST_QPN, |a| a.dest_qp_num.into()),
        ];
        let blank = QpAttr { path_mtu: Mtu::Mtu256, ..QpAttr::default() };
        for (bit, get) in cases {
            assert_ne!(get(&blank), get(&src), "{bit:?} would not show a copy");
            let mut stored = blank;
            apply_modify(&mut stored, &src, bit, Init);
            assert_eq!(get(&stored), get(&src), "{bit:?}");
            assert_eq!(stored.qp_state, Init);
            assert_eq!(stored.cur_qp_state, Init);
            // Nothing else moved.
            let mut back = stored;
            apply_modify(&mut back, &blank, bit, blank.qp_state);
            assert_eq!(back, blank, "{bit:?}");
        }
    }

    #[test]
    fn apply_without_state_keeps_the_current_state() {
        let mut stored = QpAttr { qp_state: Rts, cur_qp_state: Rts, ..QpAttr::default() };
        let a = attr(Reset);
        let to = check(Rc, Rts, &a, M::ACCESS_FLAGS).unwrap();
        apply_modify(&mut stored, &a, M::ACCESS_FLAGS, to);
        assert_eq!(stored.qp_state, Rts);
        assert_eq!(stored.qp_access_flags, a.qp_access_flags);
    }

    #[test]
    fn error_messages_name_states_and_bits() {
        let err = check_to(Rc, Reset, Init, M::STATE | M::PORT).unwrap_err();
        assert_eq!(
            err.to_string(),
            "QP transition RESET -> INIT requires attributes missing from the mask: \
             IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX"
        );
        let err = check_to(Rc, Sqe, Rts, M::STATE).unwrap_err();
        assert_eq!(err.to_string(), "invalid QP state transition SQE -> RTS for QP type RC");
        let err = check_to(Rc, Rts, Rts, M::from_bits_retain(1 << 29) | M::QKEY).unwrap_err();
        assert_eq!(
            err.to_string(),
            "QP transition RTS -> RTS does not accept attributes: IBV_QP_QKEY | 0x20000000"
        );
        let mut a = attr(ERR);
        a.cur_qp_state = Init;
        let err = check(Ud, Rts, &a, M::STATE | M::CUR_STATE).unwrap_err();
        assert_eq!(err.to_string(), "cur_qp_state says INIT but the QP is in RTS");
    }

    /// The kernel's ib_modify_qp_is_ok refuses IBV_QP_CUR_STATE unless the
    /// QP is in RTR, RTS, SQD or SQE *and* the transition lists it as
    /// optional (RTR->RTS, RTS->RTS, SQD->RTS, SQE->RTS): mlx5 and every
    /// other kernel provider answer EINVAL to these.
    #[test]
    fn cur_state_only_where_the_kernel_table_takes_it() {
        for (t, from, to, mask) in [
            (Rc, Reset, Init, RC_INIT),
            (Rc, Init, Rtr, RC_RTR),
            (Rc, Rts, Sqd, M::STATE),
            (Rc, Rts, ERR, M::STATE),
            (Ud, Init, Reset, M::STATE),
        ] {
            assert!(
                check_to(t, from, to, mask | M::CUR_STATE).is_err(),
                "{t:?} {from:?} -> {to:?} with IBV_QP_CUR_STATE was accepted"
            );
        }
    }

    /// qp_state_table[IB_QPS_RESET] has only RESET and INIT: RESET -> ERR is
    /// EINVAL on a kernel provider.
    #[test]
    fn reset_to_err_is_not_in_the_kernel_table() {
        for t in ALL_TYPES {
            assert!(check_to(t, Reset, ERR, M::STATE).is_err(), "{t:?} RESET -> ERR was accepted");
        }
    }

    /// uverbs' modify_qp refuses IBV_QP_AV whose ah_attr.port_num is not a
    /// valid port (rdma_is_port_valid): port 0 is EINVAL on real hardware.
    #[test]
    fn av_port_zero_is_refused() {
        let mut a = attr(Rtr);
        a.ah_attr.is_global = false;
        a.ah_attr.port_num = 0;
        assert!(check(Rc, Init, &a, RC_RTR).is_err(), "INIT -> RTR with ah_attr.port_num = 0 accepted");
    }
}
