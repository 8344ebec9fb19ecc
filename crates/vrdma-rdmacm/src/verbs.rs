//! The few libibverbs calls this library makes, found at run time in the
//! `libibverbs.so.1` the program loaded.
//!
//! rdma-core's librdmacm links libibverbs and opens its devices with
//! `ibv_get_device_list` / `ibv_open_device`, so `id->verbs` is a context
//! of the very library the program calls `ibv_alloc_pd` and
//! `ibv_create_cq` on. Here that library is vRDMA's drop-in
//! (`crates/vrdma-verbs`), which `vrdma run` puts first on
//! `LD_LIBRARY_PATH`. We look its functions up with `dlopen` by soname
//! and `dlvsym` at the version binaries import (`IBVERBS_1.1`) instead of
//! linking it at build time: the dynamic linker hands back the copy the
//! program already loaded (same soname), and building this crate needs
//! no libibverbs at all.
//!
//! The functions are looked up once per process ([`verbs`]); the device
//! context is opened once per connection to the daemon ([`Device`], held
//! by `cma`'s generation of that connection), together with that
//! connection (the process's first `rdma_create_event_channel` or
//! `rdma_create_id`, as rdma-core's `ucma_init` lists its devices at the
//! first call; the first bind, resolve or listener's request then finds
//! it open, where it used to load this library and open the device
//! itself, about 0.5 ms of a fresh process's first connection): after the daemon was
//! restarted, the ids of the old connection keep the old context (dead,
//! as a device's after a reset), and new ids get a context of the new
//! daemon, opened from a fresh device list.

use std::ffi::{c_int, c_void, CStr};
use std::sync::OnceLock;

use crate::abi::{ibv_pd, ibv_qp, ibv_qp_attr, ibv_qp_init_attr};
use crate::Error;

type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut c_void);
type OpenDevice = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
type AllocPd = unsafe extern "C" fn(*mut c_void) -> *mut ibv_pd;
type DeallocPd = unsafe extern "C" fn(*mut ibv_pd) -> c_int;
type CreateQp = unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
type DestroyQp = unsafe extern "C" fn(*mut ibv_qp) -> c_int;
type ModifyQp = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
type CreateCompChannel = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
type DestroyCompChannel = unsafe extern "C" fn(*mut c_void) -> c_int;
type CreateCq = unsafe extern "C" fn(*mut c_void, c_int, *mut c_void, *mut c_void, c_int) -> *mut c_void;
type DestroyCq = unsafe extern "C" fn(*mut c_void) -> c_int;
type CreateQpCmId = unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr, u32) -> *mut ibv_qp;

/// The libibverbs entry points.
pub struct Verbs {
    pub alloc_pd: AllocPd,
    pub dealloc_pd: DeallocPd,
    pub create_qp: CreateQp,
    pub destroy_qp: DestroyQp,
    pub modify_qp: ModifyQp,
    pub create_comp_channel: CreateCompChannel,
    pub destroy_comp_channel: DestroyCompChannel,
    pub create_cq: CreateCq,
    pub destroy_cq: DestroyCq,
    /// vRDMA's drop-in's own `vrdma_create_qp_cm_id`: `ibv_create_qp`
    /// with the QP attached to an rdma_cm id in the same call (`None`
    /// from a libibverbs without it, where the attach is a call of its
    /// own).
    pub create_qp_cm_id: Option<CreateQpCmId>,
    get_device_list: GetDeviceList,
    free_device_list: FreeDeviceList,
    open_device: OpenDevice,
}

/// A device context of the program's libibverbs: the first device of a
/// fresh list, opened for one connection to the daemon.
pub struct Device {
    /// `struct ibv_context *`, never closed: the program's objects made
    /// on it (`ibv_alloc_pd(id->verbs)`) may outlive every id, and
    /// rdma-core's librdmacm keeps its device contexts open as long as
    /// the process runs too. One per daemon the process met.
    pub context: *mut c_void,
    /// The device's PD, allocated on first use and never freed (as the
    /// context is never closed): see [`Device::pd`].
    pd: OnceLock<usize>,
}

// SAFETY: a context pointer that libibverbs lets any thread use; it is
// never closed, and the PD is set once.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

/// The symbol `name@version` of `lib`.
///
/// # Safety
/// `F` must be the function type of that symbol.
unsafe fn sym<F: Copy>(lib: *mut c_void, name: &CStr, version: &CStr) -> Result<F, Error> {
    // SAFETY: `lib` is a handle from dlopen; the names are C strings.
    let p = unsafe { libc::dlvsym(lib, name.as_ptr(), version.as_ptr()) };
    if p.is_null() {
        return Err(Error::Setup(format!(
            "libibverbs.so.1 lacks {}@{}",
            name.to_string_lossy(),
            version.to_string_lossy()
        )));
    }
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: the caller names the symbol's type; it is a function pointer
    // of pointer size (checked above).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

fn load() -> Result<Verbs, Error> {
    // SAFETY: dlopen of a library by soname; it is (normally) already
    // loaded, and loading it runs only its initialisers.
    let lib = unsafe { libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if lib.is_null() {
        // SAFETY: dlerror returns NULL or a C string valid until the next
        // dl call on this thread.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown".into()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(Error::Setup(format!("cannot load libibverbs.so.1: {why}")));
    }
    let v = c"IBVERBS_1.1";
    // SAFETY: each type is the prototype of that verb in rdma-core 44's
    // <infiniband/verbs.h> (pointers to structures as void where this
    // library does not look inside).
    unsafe {
        Ok(Verbs {
            alloc_pd: sym(lib, c"ibv_alloc_pd", v)?,
            dealloc_pd: sym(lib, c"ibv_dealloc_pd", v)?,
            create_qp: sym(lib, c"ibv_create_qp", v)?,
            destroy_qp: sym(lib, c"ibv_destroy_qp", v)?,
            modify_qp: sym(lib, c"ibv_modify_qp", v)?,
            create_comp_channel: sym(lib, c"ibv_create_comp_channel", c"IBVERBS_1.0")?,
            destroy_comp_channel: sym(lib, c"ibv_destroy_comp_channel", c"IBVERBS_1.0")?,
            create_cq: sym(lib, c"ibv_create_cq", v)?,
            destroy_cq: sym(lib, c"ibv_destroy_cq", v)?,
            create_qp_cm_id: sym(lib, c"vrdma_create_qp_cm_id", c"VRDMA_PRIVATE_1").ok(),
            get_device_list: sym(lib, c"ibv_get_device_list", v)?,
            free_device_list: sym(lib, c"ibv_free_device_list", v)?,
            open_device: sym(lib, c"ibv_open_device", v)?,
        })
    }
}

impl Verbs {
    /// Opens the first device of a fresh device list (the daemon that
    /// answers now).
    pub fn open_first(&self) -> Result<Device, Error> {
        let mut n: c_int = 0;
        // SAFETY: libibverbs' prototypes (see `load`); the list is freed
        // once, after the open.
        unsafe {
            let list = (self.get_device_list)(&mut n);
            if list.is_null() || n < 1 {
                if !list.is_null() {
                    (self.free_device_list)(list);
                }
                return Err(Error::Setup("libibverbs.so.1 lists no device (is it vRDMA's?)".into()));
            }
            let context = (self.open_device)(*list);
            (self.free_device_list)(list);
            if context.is_null() {
                return Err(Error::Setup(format!(
                    "ibv_open_device failed: {}",
                    std::io::Error::last_os_error()
                )));
            }
            Ok(Device { context, pd: OnceLock::new() })
        }
    }
}

impl Device {
    /// The PD an id gets in `id->pd` once it is bound to the device.
    ///
    /// librdmacm allocates one PD per device when an id first binds to it
    /// and shares it among the ids (`ucma_get_device`), and programs rely
    /// on it: UCX's rdmacm connection manager creates its placeholder UD
    /// QP with `ibv_create_qp(id->pd, ...)`. One PD for the device context
    /// does the same.
    pub fn pd(&self, v: &Verbs) -> Result<*mut ibv_pd, Error> {
        if let Some(&p) = self.pd.get() {
            return Ok(p as *mut ibv_pd);
        }
        // Two threads may race here; the loser's PD is freed again.
        // SAFETY: the open device context.
        let pd = unsafe { (v.alloc_pd)(self.context) };
        if pd.is_null() {
            return Err(Error::Setup(format!("ibv_alloc_pd failed: {}", std::io::Error::last_os_error())));
        }
        let kept = *self.pd.get_or_init(|| pd as usize);
        if kept != pd as usize {
            // SAFETY: the PD just allocated, never handed out.
            unsafe { (v.dealloc_pd)(pd) };
        }
        Ok(kept as *mut ibv_pd)
    }
}

/// The libibverbs of this process, loaded on first use (an error is kept
/// and returned to every later caller too).
pub fn verbs() -> Result<&'static Verbs, Error> {
    static VERBS: OnceLock<Result<Verbs, Error>> = OnceLock::new();
    VERBS.get_or_init(load).as_ref().map_err(Clone::clone)
}
