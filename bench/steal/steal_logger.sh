#!/bin/bash
# Log this VM's CPU counters every 5 s while benchmarks run, to see when the hypervisor took the
# cores away (steal):   bench/steal/steal_logger.sh FILE &   ...   kill %1
# Each line: epoch seconds, then /proc/stat's aggregate "cpu" line (user nice system idle iowait
# irq softirq steal ...). bench/steal/steal_report.py turns it into steal shares per minute.
out=${1:?usage: bench/steal/steal_logger.sh FILE}
while true; do
  echo "$(date +%s) $(head -1 /proc/stat)" >> "$out"
  sleep 5
done
