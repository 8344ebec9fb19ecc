#!/usr/bin/env bash
# vRDMA's benchmarks on a machine with no package registry (a lab box, a
# lent machine with many cores): pack here, carry the kit, run there.
#
#   tools/offline-bench.sh pack [NAME=REV ...]   (here, with network)
#   tools/offline-bench.sh run  [MODE ...]       (there, from the repo root)
#
# `pack` builds each revision in release (default: `main=HEAD`: this tree as
# it is, uncommitted changes included; another REV in a worktree of its own),
# strips `vrdma` and the libraries it puts beside programs, and collects
# the anchor tools the benchmarks compare with (perftest, qperf, UCX's
# ucx_perftest, sockperf, redis, iperf3, and `ip` for bench-hosts) with
# every shared library they load except glibc's and the verbs libraries
# vRDMA replaces. Everything goes to `.bench-kit/` (ignored by git; some
# 20 MB per build plus the tools).
#
# `run` unpacks the tools to a scratch folder, puts them first on PATH and
# LD_LIBRARY_PATH, and runs `vrdma bench` rows for every packed build in
# turn, ROUNDS times (default 3), so that builds are compared in the same
# minutes of the same machine. Modes (default `env lat`):
#   env      the machine (cores, kernel, CPU) and whether each tool starts
#   lat      --direct-lat  (8 B write/send, direct path, beside UCX posix)
#   bw       --direct-bw   (64 KiB / 1 MiB, beside memcpy)
#   cm       --cm-setup    (rdma_cm connection setup, beside TCP)
#   sockets  --sockets     (carried TCP applications, beside plain TCP)
#   qos      --qos and --attacks (tenants; needs root)
#   report   the default report (perftest and qperf on the drop-in)
# Each figure is printed with its anchor from the same run; read medians.
set -euo pipefail
cd "$(dirname "$0")/.."
kit=.bench-kit
libs=(vrdma libvrdma_verbs.so libvrdma_rdmacm.so libvrdma_sockets.so libvrdma_companions.so)
tools=(ib_write_lat ib_send_lat ib_read_lat ib_write_bw ib_send_bw ib_read_bw qperf ucx_perftest ucx_info ip
    sockperf redis-server redis-benchmark redis-cli iperf3)

die() {
    echo "offline-bench: $*" >&2
    exit 1
}

# Strips one build's files from DIR into the kit as NAME.
stage_build() {
    local name=$1 dir=$2 out=$kit/build-$name
    rm -rf "$out" && mkdir -p "$out"
    for f in "${libs[@]}"; do
        [ -f "$dir/$f" ] || die "$dir/$f missing: did the release build fail?"
        strip -o "$out/$f" "$dir/$f"
    done
    tar -C "$kit" -cJf "$kit/build-$name.tar.xz" "build-$name"
    rm -rf "$out"
}

# The shared libraries FILE loads, less glibc's and the verbs libraries.
deps() {
    ldd "$1" 2>/dev/null | awk '/=> \// {print $3}' |
        grep -Ev '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*|libibverbs|librdmacm)\.so' || true
}

pack_tools() {
    local t=$kit/tools
    rm -rf "$t" && mkdir -p "$t/bin" "$t/lib"
    local missing=()
    for p in "${tools[@]}"; do
        local path
        path=$(command -v "$p" || true)
        if [ -z "$path" ]; then
            missing+=("$p")
            continue
        fi
        cp -L "$path" "$t/bin/"
        for l in $(deps "$path"); do cp -Ln "$l" "$t/lib/" 2>/dev/null || true; done
    done
    # UCX loads its transports from `ucx/` beside libucs.
    local ucx
    ucx=$(dirname "$(ldconfig -p | awk '/libucs\.so\.0 / {print $NF; exit}')")/ucx
    if [ -d "$ucx" ]; then
        mkdir -p "$t/lib/ucx"
        cp -L "$ucx"/*.so* "$t/lib/ucx/" 2>/dev/null || true
        for m in "$t"/lib/ucx/*.so*; do
            for l in $(deps "$m"); do cp -Ln "$l" "$t/lib/" 2>/dev/null || true; done
        done
    fi
    [ ${#missing[@]} -eq 0 ] || echo "offline-bench: not installed here, left out: ${missing[*]} (apt-get install perftest qperf ucx-utils sockperf redis-server redis-tools)" >&2
    tar -C "$kit" -cJf "$kit/tools.tar.xz" tools
    rm -rf "$t"
}

pack() {
    [ $# -gt 0 ] || set -- main=HEAD
    mkdir -p "$kit"
    rm -f "$kit"/build-*.tar.xz
    for spec in "$@"; do
        local name=${spec%%=*} rev=${spec#*=}
        [[ $name =~ ^[A-Za-z0-9_-]+$ ]] || die "bad build name '$name' (letters, digits, - and _)"
        if [ "$rev" = HEAD ]; then
            local dirty=""
            git diff --quiet HEAD || dirty=", with its uncommitted changes"
            echo "== $name: this tree ($(git rev-parse --short HEAD)$dirty), release build"
            cargo build --release --workspace
            stage_build "$name" target/release
        else
            local wt
            wt=$(mktemp -d /tmp/offline-bench-XXXXXX)
            echo "== $name: $rev in $wt, release build"
            git worktree add -q --detach "$wt" "$rev"
            # A failed build leaves no worktree (nor its target) behind.
            trap 'git worktree remove --force "$wt" 2>/dev/null; rm -rf "$wt"' EXIT
            (cd "$wt" && cargo build --release --workspace)
            stage_build "$name" "$wt/target/release"
            git worktree remove --force "$wt"
            trap - EXIT
        fi
    done
    pack_tools
    du -sh "$kit"
    echo "carry it: run(command=\"bash tools/offline-bench.sh run lat cm\", carry=[\"$kit\"])"
}

run_builds() {
    local rounds=${ROUNDS:-3} label=$1
    shift
    for r in $(seq 1 "$rounds"); do
        for b in "$scratch"/build-*; do
            echo "== $label, round $r of $rounds, build ${b##*/build-} ($(date -u +%T))"
            "$b/vrdma" bench "$@" || echo "(exit $? from build ${b##*/build-})"
        done
    done
}

run() {
    [ -f "$kit/tools.tar.xz" ] || die "no kit here: pack it first (tools/offline-bench.sh pack) and carry $kit"
    [ $# -gt 0 ] || set -- env lat
    scratch=$(mktemp -d /tmp/offline-bench-run-XXXXXX)
    trap 'rm -rf "$scratch"' EXIT
    for f in "$kit"/*.tar.xz; do tar -C "$scratch" -xJf "$f"; done
    export PATH="$scratch/tools/bin:$PATH"
    export LD_LIBRARY_PATH="$scratch/tools/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # `bench-hosts` runs `ip` with an environment of its own: the kit's
    # `ip` finds its libraries through a wrapper.
    if [ -x "$scratch/tools/bin/ip" ]; then
        mv "$scratch/tools/bin/ip" "$scratch/tools/ip.bin"
        printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$scratch/tools/lib" "$scratch/tools/ip.bin" >"$scratch/tools/bin/ip"
        chmod +x "$scratch/tools/bin/ip"
    fi
    for mode in "$@"; do
        case $mode in
        env)
            echo "== machine: $(nproc) cores, $(uname -r), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
            # The verbs libraries come from `vrdma run` (the drop-ins).
            for p in "$scratch"/tools/bin/*; do
                local missing
                missing=$(ldd "$p" 2>&1 | grep 'not found' | grep -Ev 'libibverbs|librdmacm' | awk '{print $1}' | tr '\n' ' ' || true)
                local sys
                sys=$(deps "$p" | grep -v "^$scratch/" | tr '\n' ' ' || true)
                echo "${p##*/}: ${missing:+cannot load, missing }${missing:-loads}${sys:+ (from this machine, not the kit: $sys)}"
            done
            ls -d "$scratch"/build-* | sed 's,.*/build-,build: ,'
            ;;
        lat) run_builds "direct-path latency" --direct-lat --runs 3 ;;
        bw) run_builds "direct-path bandwidth" --direct-bw --runs 3 ;;
        cm) run_builds "rdma_cm setup" --cm-setup --runs 3 ;;
        sockets) run_builds "sockets" --sockets ;;
        qos)
            run_builds "tenant QoS" --qos
            run_builds "attacks" --attacks
            ;;
        report) run_builds "default report" --runs 3 ;;
        *) die "unknown mode '$mode' (env lat bw cm sockets qos report)" ;;
        esac
    done
}

case ${1:-} in
pack)
    shift
    pack "$@"
    ;;
run)
    shift
    run "$@"
    ;;
*) die "usage: tools/offline-bench.sh pack [NAME=REV ...] | run [MODE ...]" ;;
esac
