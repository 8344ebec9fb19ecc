//! A VM's region seen from a session: a host process of the VM's uid
//! attaching it (`VmAttach`, what `vrdma vm run` gives QEMU), and a guest
//! session's extents of it for its own memory (`GuestAlloc`, `GuestGrow`,
//! `GuestFree`).
//!
//! Apart from `session` because these calls make no device object: they
//! only hand out or take back bytes of the region (`guest_memory` keeps
//! the extents), and none reaches the engine.

use vrdma_core::proto::Reply;

use super::{error, Answer, Carry, Session, EINVAL, ENOMEM};

impl Session {
    /// VmAttach: the region and port socket of VM `name`, for root or
    /// the VM's tenant uid.
    pub(super) fn vm_attach(&mut self, name: &str) -> Result<Answer, Answer> {
        if self.guest.is_some() {
            return Err(error(libc::EPERM, "a guest cannot attach VMs"));
        }
        let vm = self
            .shared
            .vms
            .get(name)
            .ok_or_else(|| error(libc::ENOENT, format!("no VM {name:?} is configured in this daemon")))?;
        if self.uid != 0 && self.uid != vm.config.tenant {
            return Err(error(
                libc::EPERM,
                format!(
                    "VM {name:?} belongs to uid {}: only that uid or root may attach it, not uid {}",
                    vm.config.tenant, self.uid
                ),
            ));
        }
        let region = vm.region.try_clone().map_err(|e| error(libc::EMFILE, e.to_string()))?;
        Ok(Answer {
            reply: Reply::VmAttached {
                region_len: vm.region_len,
                port_socket: vm.socket.to_string_lossy().into_owned(),
                ports: vm.config.ports,
            },
            fds: vec![Carry::Fd(region)],
        })
    }

    // Each also records the extent under the session's context
    // (`Placed::memory_is`): a migration's snapshot names its owner, so
    // that it moves as the context's whether or not a region lies on it.

    pub(super) fn guest_alloc(&mut self, len: u64) -> Result<Answer, Answer> {
        let ctx = self.ctx.0;
        let g = self.guest.as_mut().ok_or_else(|| error(EINVAL, "GuestAlloc is for guest sessions only"))?;
        let (offset, len) = g.alloc(len).map_err(|m| error(ENOMEM, m))?;
        g.vm.placed().memory_is(ctx, offset, len);
        Ok(Reply::GuestExtent { offset, len }.into())
    }

    pub(super) fn guest_grow(&mut self, offset: u64, len: u64) -> Result<Answer, Answer> {
        let ctx = self.ctx.0;
        let g = self.guest.as_mut().ok_or_else(|| error(EINVAL, "GuestGrow is for guest sessions only"))?;
        let len = g.grow(offset, len).map_err(|(errno, m)| error(errno, m))?;
        g.vm.placed().memory_is(ctx, offset, len);
        Ok(Reply::GuestExtent { offset, len }.into())
    }

    pub(super) fn guest_free(&mut self, offset: u64) -> Result<Answer, Answer> {
        let ctx = self.ctx.0;
        let g = self.guest.as_mut().ok_or_else(|| error(EINVAL, "GuestFree is for guest sessions only"))?;
        g.free(offset).map_err(|(errno, m)| error(errno, m))?;
        g.vm.placed().memory_freed(ctx, offset);
        Ok(Reply::Done.into())
    }
}

#[cfg(test)]
mod tests {
    use vrdma_core::proto::Request;

    /// A guest's extents are in a migration's placement, their lengths
    /// too: taking, growing or freeing one waits while its tenant is
    /// paused, as any call that changes what moves.
    #[test]
    fn a_guests_extent_calls_wait_while_its_tenant_is_paused() {
        for req in [
            Request::GuestAlloc { len: 1 },
            Request::GuestGrow { offset: 0, len: 2 },
            Request::GuestFree { offset: 0 },
        ] {
            assert!(super::super::changes_state(&req), "{req:?}");
        }
    }
}
