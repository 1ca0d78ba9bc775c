#!/usr/bin/env bash
# S4 (seed 004's SATA counter-case): request vs bio on a simulated 7200 rpm disk
# (hdd:1G, served in arrival order like a host using noop), sequential and random 4 KiB
# reads and writes at QD32. The request path is run with the default dispatch depth (the
# ring's size) and with 2, which is what auto uses on a disk that reports it is rotational.
# The model is deterministic, so one run per variant suffices (REPEAT=1 by default).
#   bash bench/experiments/s4.sh
REPEAT=${REPEAT:-1}
source "$(dirname "$0")/common.sh"
for rw in read write randread randwrite; do
    run "S4 hdd $rw 4 KiB QD32" --disk hdd:1G --name "$rw" --rw="$rw" --bs=4k --iodepth=32 \
        --runtime="$((RUNTIME + 2))" --ramp_time=1 --time_based \
        --compare "path=request;path=request,queue_depth=2;path=bio;path=batch;path=auto"
done
