#!/usr/bin/env bash
# One device call after bench/gpu_session.sh's staging (issue 24): install once per machine,
# then rebuild the package tree of symlinks from this call's copy of the tree, and run
#   bash bench/probes/gpu_rounds.sh tests           # TESTS="..." TEST_LIMIT=s; saves ptx.tgz
#   bash bench/probes/gpu_rounds.sh probe ARGS...   # bench/probes/device_probe.py at 128k
#   bash bench/probes/gpu_rounds.sh run COMMAND...  # any command in bench/ (LIMIT=s)
#   bash bench/probes/gpu_rounds.sh spy ARGS...     # the probe under py-spy --native --threads
# Staging: carry .device/part-00, then .device/part-02 and .device/ptx.tgz (MLX's compiled
# kernels from an earlier call's $OUT/ptx.tgz), each with `bash bench/gpu_session.sh stage`,
# then carry .device/part-01 with this script's call. The spy mode installs the py-spy wheel
# carried as .device/py_spy*.whl (`pip download --no-deps py-spy`). Results go to $OUT.
# TREE=DIR takes tiered/, cpu/, metal/ and scheduler/ from DIR instead (another commit's,
# e.g. `git archive COMMIT tiered cpu metal scheduler | tar x -C .device/old`, carried), to
# time two trees in one lease.
set -uo pipefail
R=$PWD
T=${TREE:-$PWD}
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
if [ ! -d /tmp/site/mlx ]; then
  { bash bench/gpu_session.sh stage .device/part-01 && bash bench/gpu_session.sh install; } \
    >/dev/null || exit 1
fi
[ -d /tmp/mlx ] || { [ -f /tmp/stage/ptx.tgz ] && tar xzf /tmp/stage/ptx.tgz -C /tmp; }
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/tiered
for f in "$T"/tiered/*; do ln -s "$f" /tmp/pkg/tiered/; done
for sub in cpu metal scheduler; do ln -s "$T/$sub" "/tmp/pkg/tiered/$sub"; done
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
mode=${1:?usage: gpu_rounds.sh tests | probe ARGS | run COMMAND | spy ARGS}
shift
case "$mode" in
  tests)
    TESTS="${TESTS:-tests/test_staging.py tests/test_streams.py tests/test_dispatch.py \
tests/test_device_decode.py tests/test_device_attend_kernels.py tests/test_device_door.py \
tests/test_heavy.py tests/test_refresh_plan.py}" \
      TEST_LIMIT=${TEST_LIMIT:-400} bash bench/gpu_session.sh tests
    rc=$?
    (cd /tmp && tar czf "$OUT/ptx.tgz" mlx 2>/dev/null)
    exit $rc ;;
  probe)
    cd bench && timeout -k 5 "${LIMIT:-560}" python3 probes/device_probe.py --model llama3-8b \
      --context 131072 "$@" 2>&1 | tee "$OUT/probe.log" | grep -v "^  " | tail -60 ;;
  run)  # SAVE_PTX=1: MLX's compiled kernels saved to $OUT/ptx.tgz after the command
    (cd bench && timeout -k 5 "${LIMIT:-560}" "$@" 2>&1 | tee "$OUT/run.log" | tail -80)
    [ -z "${SAVE_PTX:-}" ] || (cd /tmp && tar czf "$OUT/ptx.tgz" mlx 2>/dev/null) ;;
  spy)
    [ -x /tmp/spy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps \
      --target /tmp/spy "$R"/.device/py_spy*.whl
    cd bench
    rm -f /tmp/spy128.go
    timeout -k 5 "${LIMIT:-500}" python3 probes/device_probe.py --model llama3-8b --context 131072 \
      --kernels 0 --no-ops --spy /tmp/spy128 --spy-seconds 10 "$@" > "$OUT/probe.log" 2>&1 &
    sleep 1
    pid=$(pgrep -P $! | head -1)  # python, not timeout
    while [ ! -e /tmp/spy128.go ] && kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
    /tmp/spy/bin/py-spy record --pid "$pid" --native --threads -r 100 -d 8 -f raw \
      -o "$OUT/spy.txt" > "$OUT/spy.err" 2>&1 || echo "py-spy failed"
    wait
    grep -v "^  " "$OUT/probe.log" | tail -30
    echo "summarize: python bench/probes/stack_summary.py spy.txt --under Model.__call__" ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
