#!/usr/bin/env bash
# Native py-spy profiles of a long run's phases (issue 24): runs the command in the background
# with --marks DIR added, and when the run touches DIR/<phase>.go records that phase for its
# seconds into $OUT/spy_<phase>.txt (raw collapsed stacks; bench/probes/stack_summary.py reads
# them).
#   bash bench/probes/spy_phases.sh "prefill:40 decode:20" \
#     python3 bench/million.py --model llama3-8b ...
set -uo pipefail
phases=${1:?usage: spy_phases.sh "phase:seconds ..." command...}
shift
out=${OUT:-/tmp/out}
marks=$(mktemp -d)
mkdir -p "$out"
"$@" --marks "$marks" &
pid=$!
for ps in $phases; do
  phase=${ps%%:*} secs=${ps##*:}
  while [ ! -e "$marks/$phase.go" ] && kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
  kill -0 "$pid" 2>/dev/null || break
  py-spy record --pid "$pid" --native -r 50 -d "$secs" -f raw -o "$out/spy_$phase.txt" \
    >/dev/null 2>&1 || echo "py-spy failed for $phase" >&2
done
wait "$pid"
