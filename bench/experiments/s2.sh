#!/usr/bin/env bash
# S2 (seed 000, 2011 BIO-batch RFC): request vs bio vs batch, the 16-job matrix (4 KiB IOPS
# and 1 MiB bandwidth for read, write, randread, randwrite, rw, randrw; 16 jobs, one queue
# each, QD16) on the embedded RAM disk.
#   bash bench/experiments/s2.sh          (REPEAT=3 by default; 5 s per run)
source "$(dirname "$0")/common.sh"
run s2-matrix "S2 16-job matrix" bench/jobs/matrix-16.fio \
    --compare "path=request;path=bio;path=batch;path=auto"
