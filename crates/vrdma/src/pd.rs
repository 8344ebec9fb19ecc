//! Protection domains.

use std::sync::Arc;

use vrdma_core::proto::{Reply, Request};
use vrdma_core::verbs::{AccessFlags, AhAttr, QpCap, SrqAttr};

use crate::ah::AddressHandle;
use crate::context::Context;
use crate::control;
use crate::cq::CompletionQueue;
use crate::error::{Error, Result};
use crate::mr::MemoryRegion;
use crate::qp::{QpInit, QueuePair};
use crate::srq::SharedReceiveQueue;

/// A protection domain (`ibv_pd`): memory regions, QPs and SRQs of one PD
/// may work together; keys of other PDs are refused.
///
/// Cheap to clone; deallocated when the last clone and the last object in
/// it are gone.
#[derive(Clone, Debug)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

#[derive(Debug)]
pub(crate) struct PdInner {
    pub(crate) ctx: Context,
    pub(crate) pd: u32,
    /// Its regions registered in this process, for direct writes' local
    /// SGEs ([`crate::direct`]).
    pub(crate) local_keys: crate::direct::LocalKeys,
}

impl Drop for PdInner {
    fn drop(&mut self) {
        self.ctx.inner.control.destroy(Request::DeallocPd { pd: self.pd });
    }
}

impl ProtectionDomain {
    pub(crate) fn alloc(ctx: &Context) -> Result<ProtectionDomain> {
        let req = Request::AllocPd;
        match ctx.inner.control.call(&req, &[])?.reply {
            Reply::Pd { pd } => Ok(ProtectionDomain {
                inner: Arc::new(PdInner { ctx: ctx.clone(), pd, local_keys: Default::default() }),
            }),
            other => Err(control::unexpected(&req, &other)),
        }
    }

    /// The daemon's number for this PD.
    pub fn pd_id(&self) -> u32 {
        self.inner.pd
    }

    /// The context the PD belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Allocates `len` bytes of zeroed, page-aligned memory and registers
    /// them (`ibv_reg_mr` over a fresh buffer). The region owns the memory:
    /// it is freed when the region is dropped.
    pub fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        MemoryRegion::alloc(self, len, access)
    }

    /// Registers memory the process already owns (`ibv_reg_mr` on an
    /// existing buffer): a heap `Vec`'s bytes, `posix_memalign` or
    /// anonymous `mmap` memory, huge pages (`MAP_HUGETLB`) included. The
    /// region does not own the memory and never frees it.
    ///
    /// The pages covering the range are *re-backed* so that the daemon
    /// can map them: their current bytes are copied into a memfd that is
    /// then mapped over the same addresses (`MAP_SHARED | MAP_FIXED`).
    /// Pointers into the memory stay valid and see the same bytes.
    /// Refused with [`Error::InvalidArgument`]: the main thread's
    /// `[stack]` and the calling thread's stack (other threads' stacks
    /// cannot be told from other anonymous memory: never register them),
    /// file-backed (but for the data segment of the program or a loaded
    /// library), shared, read-only or unmapped pages, and a range whose
    /// covering pages partially overlap pages re-backed for an earlier
    /// registration that is still alive. A range lying fully inside such
    /// pages shares their memfd without remapping.
    ///
    /// Caveats of re-backing:
    /// - Huge pages are re-backed by a memfd of huge pages, which needs as
    ///   many free huge pages again while the bytes are copied (else the
    ///   call fails with `ENOMEM`).
    /// - The whole first and last pages are re-backed, so bytes next to the
    ///   range that share those pages (other heap objects) also become
    ///   shared memory. They keep their values and addresses; only a
    ///   registration whose page bounds partially overlap theirs is refused.
    /// - Writes to those pages by other threads *while this call runs*
    ///   wait until the new mapping is in place (a userfaultfd
    ///   write-protects the pages meanwhile). Where the kernel offers no
    ///   such protection (before Linux 6.4, or under a seccomp profile
    ///   that refuses `userfaultfd`), such writes may be lost: register
    ///   before sharing the memory with other threads. Where it protects
    ///   only against user-mode writes (an unprivileged process under
    ///   `vm.unprivileged_userfaultfd = 0`), a system call writing into
    ///   those pages meanwhile fails with `EFAULT`.
    /// - After `fork` the child gets private copies of the re-backed pages,
    ///   taken as it starts (bytes written meanwhile by the parent's other
    ///   threads or the device may be in them); the parent keeps its
    ///   registrations. A `fork` while another thread is in this call
    ///   waits for it to finish.
    /// - Re-backed pages stay memfd-backed after deregistration until the
    ///   application unmaps them; that is harmless to the allocator.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be memory this process owns, valid for reads
    /// and writes, and must stay allocated and mapped for as long as the
    /// returned region lives. While the region is registered the daemon
    /// may read and write it at any time (when work requests or remote
    /// peers name it), so the caller must not hold Rust references (`&`,
    /// `&mut`) into it across such accesses that assume nobody else writes
    /// it; use the region's [`read`](MemoryRegion::read) and
    /// [`write`](MemoryRegion::write) or raw pointers.
    pub unsafe fn register_raw(&self, ptr: *mut u8, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        // SAFETY: the caller's contract is exactly `register`'s.
        unsafe { MemoryRegion::register(self, ptr, len, access) }
    }

    /// `ibv_create_srq`: a shared receive queue of at least `attr.max_wr`
    /// requests of `attr.max_sge` SGEs, firing `SrqLimitReached` when fewer
    /// than a non-zero `attr.srq_limit` remain.
    pub fn create_srq(&self, attr: SrqAttr) -> Result<SharedReceiveQueue> {
        SharedReceiveQueue::create(self, attr)
    }

    /// `ibv_create_qp`.
    pub fn create_qp(&self, init: &QpInit<'_>) -> Result<QueuePair> {
        QueuePair::create(self, init)
    }

    /// `rdma_create_qp` of an rdma_cm id by its number, in one call: a QP
    /// of this PD, attached to the id as [`crate::cm::CmId::create_qp`]
    /// attaches it. The id may be of another context of this process (the
    /// drop-in `librdmacm.so.1` holds its ids in a context of its own,
    /// the program's QPs are its `libibverbs.so.1`'s); if the attach
    /// fails, the QP is destroyed and this fails with the attach's error.
    pub fn create_qp_for_cm_id(&self, init: &QpInit<'_>, cm_id: u32) -> Result<QueuePair> {
        QueuePair::create_for(self, init, Some(cm_id))
    }

    /// An RC QP with its own receive queue, not signalling every send.
    pub fn create_rc_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        cap: QpCap,
    ) -> Result<QueuePair> {
        self.create_qp(&QpInit::rc(send_cq, recv_cq, cap))
    }

    /// A UD QP with its own receive queue, brought to RTS on port 1 with
    /// Q_Key `qkey` and ready to send and receive datagrams (see
    /// [`QpInit::ud`] and [`QueuePair::to_init_ud`] for a QP brought up
    /// step by step).
    pub fn create_ud_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        cap: QpCap,
        qkey: u32,
    ) -> Result<QueuePair> {
        let qp = self.create_qp(&QpInit::ud(send_cq, recv_cq, cap))?;
        qp.to_init_ud(crate::qp::defaults::PORT, qkey)?;
        qp.to_rtr_ud()?;
        qp.to_rts_ud(qp.psn())?;
        Ok(qp)
    }

    /// `ibv_create_ah`: an address handle for UD sends from QPs of this PD.
    /// `attr.port_num` must name the port (1); a LID in the multicast range
    /// or a multicast GID is refused (`EOPNOTSUPP`). The destination is
    /// not checked: a datagram to nowhere is lost, as on a fabric.
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        AddressHandle::create(self, attr)
    }

    /// Checks that `ctx` is this PD's context.
    pub(crate) fn same_context(&self, ctx: &Context, what: &str) -> Result<()> {
        if Arc::ptr_eq(&self.inner.ctx.inner, &ctx.inner) {
            Ok(())
        } else {
            Err(Error::invalid(format!("{what} belongs to another context than the protection domain")))
        }
    }
}
