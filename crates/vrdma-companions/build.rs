//! Links the cdylib with the version nodes of rdma-core 44's
//! `libmlx5.so.1`, `libmlx4.so.1`, `libefa.so.1` and `libmana.so.1`
//! (`companions.map`), which the `.symver` directives of `src/lib.rs`
//! bind each function to.

fn main() {
    println!("cargo:rerun-if-changed=companions.map");
    println!("cargo:rerun-if-changed=build.rs");
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    if var("CARGO_CFG_TARGET_OS") != "linux" || var("CARGO_CFG_TARGET_ARCH") != "x86_64" {
        return;
    }
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/companions.map");
}
