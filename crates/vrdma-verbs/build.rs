//! Links the cdylib as rdma-core's `libibverbs.so.1`: its soname, and the
//! version nodes (`IBVERBS_1.0` ... `IBVERBS_1.14`, `IBVERBS_PRIVATE_34`)
//! that `.symver` directives in `src/lib.rs` bind each exported function
//! to. Binaries built against rdma-core import `ibv_*@IBVERBS_1.1` and the
//! like, and the dynamic linker refuses a library lacking those versions.

fn main() {
    println!("cargo:rerun-if-changed=libibverbs.map");
    println!("cargo:rerun-if-changed=build.rs");
    // The library is built for x86-64 Linux only (elsewhere the crate is
    // empty; see src/lib.rs), and only there is rust-lld the default linker.
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    if var("CARGO_CFG_TARGET_OS") != "linux" || var("CARGO_CFG_TARGET_ARCH") != "x86_64" {
        return;
    }
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let map = format!("{dir}/libibverbs.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={map}");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
}
