//! `vrdma devinfo`: what `ibv_devinfo -v` shows, from the running daemon.

use std::path::PathBuf;

use anyhow::Result;
use vrdma::Mtu;

#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

fn mtu(m: Mtu) -> String {
    format!("{} ({})", m.bytes(), m.raw())
}

fn port_state(s: u8) -> &'static str {
    match s {
        1 => "PORT_DOWN",
        2 => "PORT_INIT",
        3 => "PORT_ARMED",
        4 => "PORT_ACTIVE",
        5 => "PORT_ACTIVE_DEFER",
        _ => "PORT_NOP",
    }
}

fn guid(g: u64) -> String {
    let b = g.to_be_bytes();
    format!(
        "{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]
    )
}

pub fn run(socket: Option<PathBuf>, args: Args) -> Result<()> {
    // Without a socket named, the device of a QEMU guest (its
    // virtio-serial ports and ivshmem BAR, docs/vms.md) where it is one.
    let path = socket.clone().unwrap_or_else(vrdmad::default_socket_path);
    let ctx = crate::embedded::open_existing(socket)?;
    let path = if ctx.is_guest() { PathBuf::from("(a VM's port)") } else { path };
    let d = ctx.query_device()?;
    let p = ctx.query_port(1)?;
    let mut gids = Vec::new();
    for i in 0..p.gid_tbl_len {
        gids.push(ctx.query_gid(1, i)?);
    }
    if args.json {
        let v = serde_json::json!({
            "hca_id": vrdmad::DEVICE_NAME,
            "socket": path,
            "device": format!("{d:?}"),
            "port": format!("{p:?}"),
            "gids": gids.iter().map(|g| g.to_string()).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("hca_id:\t{}", vrdmad::DEVICE_NAME);
    println!("\ttransport:\t\t\tInfiniBand (0)");
    println!("\tfw_ver:\t\t\t\t{}", d.fw_ver);
    println!("\tnode_guid:\t\t\t{}", guid(d.node_guid));
    println!("\tsys_image_guid:\t\t\t{}", guid(d.sys_image_guid));
    println!("\tvendor_id:\t\t\t{:#06x}", d.vendor_id);
    println!("\tvendor_part_id:\t\t\t{}", d.vendor_part_id);
    println!("\thw_ver:\t\t\t\t{:#x}", d.hw_ver);
    println!("\tphys_port_cnt:\t\t\t{}", d.phys_port_cnt);
    println!("\tmax_mr_size:\t\t\t{:#x}", d.max_mr_size);
    println!("\tpage_size_cap:\t\t\t{:#x}", d.page_size_cap);
    for (k, v) in [
        ("max_qp", d.max_qp),
        ("max_qp_wr", d.max_qp_wr),
        ("max_sge", d.max_sge),
        ("max_sge_rd", d.max_sge_rd),
        ("max_cq", d.max_cq),
        ("max_cqe", d.max_cqe),
        ("max_mr", d.max_mr),
        ("max_pd", d.max_pd),
        ("max_qp_rd_atom", d.max_qp_rd_atom),
        ("max_res_rd_atom", d.max_res_rd_atom),
        ("max_qp_init_rd_atom", d.max_qp_init_rd_atom),
        ("max_ah", d.max_ah),
        ("max_srq", d.max_srq),
        ("max_srq_wr", d.max_srq_wr),
        ("max_srq_sge", d.max_srq_sge),
        ("max_inline_data", d.max_inline_data),
    ] {
        println!("\t{k}:{}{v}", tabs(k, 3));
    }
    println!("\tatomic_cap:\t\t\tATOMIC_HCA ({})", d.atomic_cap);
    println!("\tmax_pkeys:\t\t\t{}", d.max_pkeys);
    println!("\tlocal_ca_ack_delay:\t\t{}", d.local_ca_ack_delay);
    println!("\t\tport:\t1");
    println!("\t\t\tstate:\t\t\t{} ({})", port_state(p.state), p.state);
    println!("\t\t\tmax_mtu:\t\t{}", mtu(p.max_mtu));
    println!("\t\t\tactive_mtu:\t\t{}", mtu(p.active_mtu));
    println!("\t\t\tsm_lid:\t\t\t{}", p.sm_lid);
    println!("\t\t\tport_lid:\t\t{}", p.lid);
    println!("\t\t\tport_lmc:\t\t{:#04x}", p.lmc);
    println!("\t\t\tlink_layer:\t\t{}", if p.link_layer == 2 { "Ethernet" } else { "InfiniBand" });
    println!("\t\t\tmax_msg_sz:\t\t{:#x}", p.max_msg_sz);
    println!("\t\t\tmax_vl_num:\t\t{}", p.max_vl_num);
    println!("\t\t\tpkey_tbl_len:\t\t{}", p.pkey_tbl_len);
    println!("\t\t\tgid_tbl_len:\t\t{}", p.gid_tbl_len);
    println!("\t\t\tphys_state:\t\tLINK_UP ({})", p.phys_state);
    for (i, g) in gids.iter().enumerate() {
        println!("\t\t\tGID[{i:>3}]:\t\t{g}");
    }
    println!("\t\t\tpaths:\t\t\tsame host: shared memory; other hosts: TCP links between daemons");
    for line in super::stat::render_links(&ctx.stat()?).lines() {
        println!("\t\t\t{line}");
    }
    Ok(())
}

fn tabs(key: &str, width: usize) -> String {
    let used = (key.len() + 2) / 8;
    "\t".repeat(width.saturating_sub(used).max(1))
}
