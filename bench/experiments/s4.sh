#!/usr/bin/env bash
# S4 (seed 004's SATA counter-case): request vs bio on a simulated 7200 rpm disk
# (hdd:1G, served in arrival order like a host using noop), sequential and random 4 KiB
# reads and writes at QD32. The request path is run with the default dispatch depth (the
# ring's size) and with 2, which is what auto uses on a disk that reports it is rotational.
# Then the same jobs on hdd:1G:norot, which does not report it (as most virtual disks
# over a hard disk do): auto has to find the shallow depth by measuring. Its first choice
# takes about 1 s on sequential I/O and 12 s on random (slots long enough for 32 requests
# to drain through the disk, see crates/driver/src/path/auto/mod.rs); the ramp_time
# covers it, so the table compares the paths as they run once chosen. The model is
# deterministic, so one run per variant suffices (REPEAT=1 by default).
#   bash bench/experiments/s4.sh            # both parts
#   PART=norot bash bench/experiments/s4.sh # only the hidden-hint part
# With JSON_OUT=DIR, each table's JSON goes to DIR (bench/experiments/common.sh).
REPEAT=${REPEAT:-1}
PART=${PART:-all}
# NOROT_RANDOM=0 leaves out the hidden-hint random rows (45 s per variant; quick runs).
NOROT_RANDOM=${NOROT_RANDOM:-1}
source "$(dirname "$0")/common.sh"
VARIANTS="path=request;path=request,queue_depth=2;path=bio;path=batch;path=auto"
if [ "$PART" != norot ]; then
    for rw in read write randread randwrite; do
        run "s4-hdd-$rw" "S4 hdd $rw 4 KiB QD32" --disk hdd:1G --name "$rw" --rw="$rw" --bs=4k --iodepth=32 \
            --runtime="$((RUNTIME + 2))" --ramp_time=1 --time_based --compare "$VARIANTS"
    done
fi
for rw in read write randread randwrite; do
    case $rw in
    rand*)
        [ "$NOROT_RANDOM" = 1 ] || continue
        ramp=15 runtime=30
        ;;
    *) ramp=3 runtime=$((RUNTIME + 2)) ;;
    esac
    run "s4-norot-$rw" "S4 hdd:1G:norot $rw 4 KiB QD32" --disk hdd:1G:norot --name "$rw" --rw="$rw" --bs=4k \
        --iodepth=32 --runtime="$runtime" --ramp_time="$ramp" --time_based --compare "$VARIANTS"
done
