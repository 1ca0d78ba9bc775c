# Sourced by bench/all.sh. machine_txt MODE_LINE COMMAND COMMIT: the run's machine.txt (the
# machine and its state at the start; bench/render.py prints it above the tables). Also
# usable for a run of one script by hand whose JSON render.py is to read:
#   . bench/lib/machine.sh; machine_txt "devices.sh tables ..." "bash bench/devices.sh ..." \
#     "$(git rev-parse --short HEAD)" > OUT/machine.txt
machine_txt() {
  echo "mode: $1"
  echo "command: $2"
  echo "commit: $3"
  echo "started: $(date -u +%FT%TZ)"
  echo "machine: $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), kernel $(uname -r), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "host disk scheduler: $(cat /sys/block/vda/queue/scheduler 2> /dev/null || echo unknown) (not changed)"
  echo "file system of the image: $(df -T /var/tmp | awk 'NR==2 {print $2}') on $(df /var/tmp | awk 'NR==2 {print $1}')"
  echo "qemu-storage-daemon: $(qemu-storage-daemon --version | head -1)"
  echo "rustc: $(rustc --version)"
}
