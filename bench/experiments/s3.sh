#!/usr/bin/env bash
# S3 (seed 003, 2024 uring_cmd RFC): passthru with polled completions vs bio, one driver
# core: 4 KiB random reads at QD8 submitted and reaped in batches of 4, and at QD1.
#   bash bench/experiments/s3.sh          (REPEAT=3 by default)
source "$(dirname "$0")/common.sh"
run s3-qd8-batch4 "S3 QD8, batches of 4" bench/jobs/qd8-batch4.fio \
    --compare "path=bio;path=passthru;path=batch;path=request;path=auto"
run s3-qd1 "S3 QD1" --name qd1 --rw=randread --bs=4k --iodepth=1 \
    --runtime="$RUNTIME" --ramp_time=500ms --time_based \
    --compare "path=bio;path=passthru;path=auto"
