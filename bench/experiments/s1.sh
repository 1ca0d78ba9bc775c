#!/usr/bin/env bash
# S1 (seed 004, 2012 use_bio): bio vs request+deadline on a RAM disk, sequential and random
# 4 KiB reads and writes; IOPS and CPU per I/O on both sides. The embedded device (a 1 GiB
# preallocated RAM disk) runs on the last CPU, the job on CPU 0.
#   bash bench/experiments/s1.sh          (REPEAT=3 RUNTIME=3 by default)
source "$(dirname "$0")/common.sh"
for rw in read write randread randwrite; do
    run "s1-$rw" "S1 $rw 4 KiB QD32" --name "$rw" --rw="$rw" --bs=4k --iodepth=32 \
        --runtime="$RUNTIME" --ramp_time=500ms --time_based \
        --compare "path=request,elevator=deadline;path=bio;path=batch;path=auto"
done
