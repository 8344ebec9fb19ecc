//! Links the cdylib as rdma-core's `librdmacm.so.1`: its soname, and the
//! version nodes (`RDMACM_1.0` ... `RDMACM_1.3`, those of rdma-core 44)
//! that `.symver` directives in `src/lib.rs` bind each exported function
//! to. Binaries built against rdma-core import `rdma_*@RDMACM_1.0` and
//! the like, and the dynamic linker refuses a library lacking them.

fn main() {
    println!("cargo:rerun-if-changed=librdmacm.map");
    println!("cargo:rerun-if-changed=build.rs");
    // As for vrdma-verbs: x86-64 Linux only (elsewhere the crate is empty).
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    if var("CARGO_CFG_TARGET_OS") != "linux" || var("CARGO_CFG_TARGET_ARCH") != "x86_64" {
        return;
    }
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let map = format!("{dir}/librdmacm.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={map}");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,librdmacm.so.1");
}
