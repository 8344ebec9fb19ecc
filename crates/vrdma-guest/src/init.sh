#!/bin/busybox sh
# /init of vRDMA's guest image (crates/vrdma-guest/src/image.rs builds it).
# Mounts the kernel's file systems, loads the virtio modules, says which
# accelerator runs the guest, then runs shell commands for the harness
# (crates/vrdma-guest/src/guest.rs), which waits for the @@VRDMA- markers
# printed here and around each command.
/bin/busybox mkdir -p /proc /sys /dev /tmp /run /root /sbin /usr/bin /usr/sbin
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox --install -s
export PATH=/opt/vrdma/bin:/usr/sbin:/usr/bin:/sbin:/bin
export LD_LIBRARY_PATH=/opt/vrdma/lib
export HOME=/root
cd /root
for m in $(cat /etc/vrdma-guest/modules); do
    insmod "/lib/modules/vrdma-guest/$m.ko" || echo "@@VRDMA-WARN insmod $m failed"
done
# The loopback, and the first NIC (a virtio-net on QEMU's user network,
# `-nic user,model=virtio-net-pci`) with that network's fixed addresses:
# the guest 10.0.2.15, the host (QEMU's side) 10.0.2.2. Verbs programs
# exchange their QP numbers over it.
ip link set lo up
for n in /sys/class/net/*; do
    i=${n##*/}
    [ "$i" = lo ] && continue
    ip link set "$i" up && ip addr add 10.0.2.15/24 dev "$i" && ip route add default via 10.0.2.2
    break
done
# KVM shows the guest its signature; TCG shows none.
if dmesg | grep -q "Hypervisor detected: KVM"; then accel=kvm; else accel=tcg; fi
# With vrdma-guest.shell on the kernel command line, or without the
# harness's port, a person gets a shell on the console instead.
console_shell() {
    echo "vrdma-guest: $1; a shell on the console (accelerator $accel)"
    exec setsid cttyhack /bin/sh
}
grep -q vrdma-guest.shell /proc/cmdline && console_shell "vrdma-guest.shell given"
# The harness talks to this guest over a virtio-serial port of its own
# (named below; not org.vrdma.K, so the guest library never takes it),
# not over the serial console: under TCG the emulated UART stopped
# delivering input after a few commands. The port appears shortly after
# virtio_console loads.
port=
i=0
while [ -z "$port" ] && [ $i -lt 200 ]; do
    for p in /sys/class/virtio-ports/*; do
        if [ "$(cat $p/name 2>/dev/null)" = vrdma-guest.harness ] && [ -c /dev/${p##*/} ]; then port=/dev/${p##*/}; fi
    done
    [ -n "$port" ] || sleep 0.05
    i=$((i + 1))
done
[ -n "$port" ] || console_shell "no vrdma-guest.harness port in /sys/class/virtio-ports"
echo "vrdma-guest: harness on $port, accelerator $accel"
exec 3<>"$port"
echo "@@VRDMA-READY accel=$accel release=$(uname -r)" >&3
# Commands come as lines: "c CHUNK" appends a chunk of a base64-encoded
# script, "r N" runs the script gathered so far in a child sh (so that the
# loop survives whatever it does), standard input from /dev/null, output
# to the port, framed by markers with its number N and exit status.
while read -r op arg <&3; do
    case "$op" in
    c) echo "$arg" >>/tmp/.vrdma-cmd.b64 ;;
    r)
        echo "@@VRDMA-BEGIN $arg" >&3
        base64 -d /tmp/.vrdma-cmd.b64 >/tmp/.vrdma-cmd && sh /tmp/.vrdma-cmd </dev/null >&3 2>&3 3>&-
        st=$?
        rm -f /tmp/.vrdma-cmd.b64
        printf '\n@@VRDMA-DONE %s %s\n' "$arg" "$st" >&3
        ;;
    esac
done
echo "vrdma-guest: the harness port closed"
poweroff -f
