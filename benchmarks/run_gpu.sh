#!/usr/bin/env bash
# Every GPU test and benchmark of kvfuse, on the device machine, printing a short table last.
#
#   bash benchmarks/run_gpu.sh [tests-ops | tests-ops-attention tests-ops-rest] [tests-native] [tests-models] [write] [attention] [decode] [focus] [variants] [prefill] [prefill-sweep] [hf] [rope] [rope-native] [native] [tp]
#
# No argument: tests-ops tests-native tests-models write attention decode. The GPU suite is split
# in three phases (Triton/reference/FlashInfer ops; the native kernels' tests and their
# compute-sanitizer run; compile/models/integrations), each well inside one call's 10 minutes. `hf` is the
# transformers decode benchmark, `rope` the fused rotary write, `rope-native` the native rotary
# write's GPU tests and its build variants (ROPE_VARIANTS) beside Triton, `native` the native kernels' own
# loop (their GPU tests and the launch-constant sweep), `tp` the two-GPU tensor-parallel test and
# benchmark (needs a machine with 2 GPUs).
#
# Run from the repository root with the wheels from ../shared/gpu/fetch-wheels.sh --flashinfer in
# .whl/ (the device has no network). Phases can be split over calls to fit one call's time
# limit; FlashInfer's JIT builds stay cached while the machine stays warm. Results (JSON, logs)
# go to $OUT/results.tgz; benchmarks/summary.py prints the table from them.
set -uo pipefail
phases=${*:-tests-ops tests-native tests-models write attention decode}
OUT=${OUT:-/tmp/kvfuse-gpu}
RES=$OUT/results
mkdir -p "$RES"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 BENCH_COMMIT=${BENCH_COMMIT:-unknown} MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$RES/device.txt"
SECONDS=0
for phase in $phases; do
  case $phase in
    tests-ops|tests-ops-attention|tests-ops-rest|tests-native|tests-models)
      # Native build first, so its time is not charged to a test's timeout.
      python3 -c "from kvfuse.ops import native; print(native.build_info(build=True))" 2>&1 | tail -3
      case $phase in
        tests-ops) dirs="tests/ops tests/test_*.py --ignore tests/ops/test_native.py" ;;
        # The op phase in two halves, each inside one call's 10 minutes (the whole took longer).
        tests-ops-attention) dirs="tests/ops/test_triton_attention.py tests/ops/test_attention_features.py
          tests/ops/test_new_token_prefill.py tests/ops/test_quantized_prefill.py tests/ops/test_per_token_head.py
          tests/ops/test_head_scales.py" ;;
        tests-ops-rest) dirs="tests/ops tests/test_*.py --ignore tests/ops/test_native.py
          --ignore tests/ops/test_triton_attention.py --ignore tests/ops/test_attention_features.py
          --ignore tests/ops/test_new_token_prefill.py --ignore tests/ops/test_quantized_prefill.py
          --ignore tests/ops/test_per_token_head.py
          --ignore tests/ops/test_head_scales.py" ;;
        tests-native) dirs="tests/ops/test_native.py tests/ops/test_native_attention.py tests/ops/test_native_prefill.py
          tests/ops/test_per_token_head.py" ;;
        *) dirs="tests/compile tests/models tests/integrations tests/distributed" ;;
      esac
      # -v names every result as it happens (a summary printed at the end is lost when the phase
      # limit cuts the run); the whole log comes back in results.tgz, its failures are listed here.
      KVFUSE_FAILURE_LOG=$RES/failures_$phase.txt timeout 480 python3 -m pytest -v --tb=short -m gpu -n 8 $dirs -p no:cacheprovider -rfE \
        --ignore tests/models/test_memory.py > "$RES/gpu_$phase.log" 2>&1
      echo "pytest rc=$? (124: cut by the phase limit)"
      grep -E '^\[gw[0-9]+\].* (FAILED|ERROR) ' "$RES/gpu_$phase.log" | sed 's/^\[gw[0-9]*\] *//' | head -40
      grep -cE '^\[gw[0-9]+\].* PASSED ' "$RES/gpu_$phase.log" | sed 's/^/passed so far: /'
      tail -3 "$RES/gpu_$phase.log"
      if [ "$phase" = tests-models ]; then
        timeout 120 python3 -m pytest -q -m gpu tests/models/test_memory.py -p no:cacheprovider 2>&1 \
          | tail -5 | tee -a "$RES/gpu_$phase.log"
      elif [ "$phase" = tests-native ]; then
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
          --kernel-name kns=rows_kernel python3 tests/ops/_native_sanitize.py > "$RES/sanitizer.log" 2>&1
        echo "compute-sanitizer memcheck rc=$? ($(grep -c 'ERROR SUMMARY: 0 errors' "$RES/sanitizer.log") clean summaries)"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
          --kernel-name kns=decode_attention python3 tests/ops/_native_attention_sanitize.py > "$RES/sanitizer_attention.log" 2>&1
        echo "compute-sanitizer memcheck (decode attention) rc=$? ($(tail -3 "$RES/sanitizer_attention.log" | tr '\n' ' '))"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
          --kernel-name kns=per_token_head python3 tests/ops/_native_attention_sanitize.py write > "$RES/sanitizer_pth_write.log" 2>&1
        echo "compute-sanitizer memcheck (per-token-head write) rc=$? ($(tail -3 "$RES/sanitizer_pth_write.log" | tr '\n' ' '))"
        # The rotary write's cases; no kernel filter, so its separate query kernel is checked too.
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 \
          python3 tests/ops/_native_sanitize.py rope > "$RES/sanitizer_rope.log" 2>&1
        echo "compute-sanitizer memcheck (rotary write) rc=$? ($(tail -3 "$RES/sanitizer_rope.log" | tr '\n' ' '))"
      fi
      ;;
    hf)
      timeout 420 python3 -m benchmarks.hf_decode --out "$RES" 2>&1 | grep '^|' | cut -c1-200
      ;;
    rope)
      # Native build first, so its time is not charged to the benchmark's timeout.
      python3 -c "from kvfuse.ops import native; print(native.build_info(build=True))" 2>&1 | tail -3
      # ROPE_ROUNDS=N: the variants of each case timed in turn, N rounds, ratios round by round.
      # Its whole table (one column per variant) is rope_write.md; the summary prints the goal's columns.
      timeout 400 python3 -m benchmarks.rope_write --out "$RES" ${ROPE_ROUNDS:+--rounds "$ROPE_ROUNDS"} \
        > "$RES/rope_write.log" 2>&1
      echo "rope_write rc=$? (124: cut)"
      ;;
    rope-native)
      # The native rotary write: its GPU tests, then the benchmark on the default build and on each
      # build of ROPE_VARIANTS (';'-separated nvcc flag sets, each built in its own directory), so
      # one call compares them against the same Triton rows. All builds run at once, first.
      IFS=';' read -ra rope_variants <<< "${ROPE_VARIANTS:--DKVFUSE_ROPE_FP8_NARROW_BELOW=0;-DKVFUSE_ROPE_PARTNER_SHUFFLE=0}"
      for flags in "" "${rope_variants[@]}"; do
        KVFUSE_NATIVE_CUDA_FLAGS="$flags" MAX_JOBS=8 python3 -c "from kvfuse.ops import native
i = native.build_info(build=True); print('build ${flags:-default}:', i.get('built'), i.get('build_seconds'), i.get('error'))" \
          2>&1 | grep '^build ' &
      done
      wait
      timeout 150 python3 -m pytest -v -m gpu -n 6 tests/ops/test_rope_kv_write.py -k native -p no:cacheprovider \
        --tb=short > "$RES/gpu_rope_native.log" 2>&1
      echo "pytest rc=$? (124: cut), $(grep -c ' PASSED' "$RES/gpu_rope_native.log") passed"
      grep -E ' (FAILED|ERROR) ' "$RES/gpu_rope_native.log" | sed 's/^\[gw[0-9]*\] *//' | head -10
      for flags in "" "${rope_variants[@]}"; do
        tag=$(printf '%s' "${flags:-default}" | tr -c 'A-Za-z0-9_' '_')
        mkdir -p "$RES/rope_$tag"
        echo "rope_write, build: ${flags:-default}"
        KVFUSE_NATIVE_CUDA_FLAGS="$flags" timeout 200 python3 -m benchmarks.rope_write --quick --out "$RES/rope_$tag" \
          --tokens 64,256,1024,4096 --formats fp8,nvfp4 \
          --variants "write;rope_k+write (native);rope_k+write (triton);rope_qk+write (native);rope_qk+write (triton)" \
          2>&1 | grep -E '^\||differ' | cut -c1-200
      done
      # Triton's launch configs for the rotary write (ROPE_SWEEP_TOKENS, empty: none).
      if [[ -n "${ROPE_SWEEP_TOKENS-4096}" ]]; then
        mkdir -p "$RES/rope_sweep"
        timeout 240 python3 -m benchmarks.rope_write --quick --sweep --out "$RES/rope_sweep" \
          --tokens "${ROPE_SWEEP_TOKENS-4096}" --formats fp8,nvfp4 2>&1 | grep -vE '^\{|^sweep ' | tail -8
      fi
      ;;
    tp)
      # NVLink multicast stays off for every process of this phase (the host's GPUs are shared;
      # see DEVELOPERS.md). TP_PARTS="tests" or "bench" runs one half when a call's 10 minutes
      # do not hold both.
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      if [[ " ${TP_PARTS:-tests bench} " == *" tests "* ]]; then
        # The demo model and transformers' own TP (tp_plan "auto"), each NCCL against tp_size 1.
        timeout 240 python3 -m pytest -q -m gpu tests/distributed -p no:cacheprovider -rfE 2>&1 | tail -8 \
          | tee "$RES/gpu_tp.log"
      fi
      if [[ " ${TP_PARTS:-tests bench} " == *" bench "* ]]; then
        timeout 330 torchrun --nproc-per-node 2 -m benchmarks.tp_decode_step --out "$RES" 2>&1 | tail -12
      fi
      ;;
    write)
      timeout 300 python3 -m benchmarks.cache_write --out "$RES" 2>&1 | grep -v '^ ' | tail -12
      timeout 150 python3 -m benchmarks.host_overhead --out "$RES" 2>&1 | tail -6
      timeout 150 python3 -m benchmarks.compile_pass --skip-compile --out "$RES/gpu_layer" 2>&1 | tail -6
      ;;
    attention)
      # kvfuse over the whole decode/prefill matrix, then every anchor at the issue's reference
      # point (B=64, ctx 4096; 4k prefill): FlashInfer's JIT builds make a full anchor matrix
      # cost more device time than the kvfuse kernels themselves.
      timeout 240 python3 -m benchmarks.attention --impls kvfuse --out "$RES/attention_matrix" 2>&1 \
        | grep -v '^ ' | tail -4
      timeout 240 python3 -m benchmarks.attention --quick --out "$RES" 2>&1 | grep -v '^ ' | tail -4
      ;;
    prefill)
      # Issue 16's prefill matrix with its anchors (FlashInfer paged prefill, SDPA): 4k and 16k
      # fresh prompts, chunked prefill and 4-token speculative decode, bf16 / FP8 / NVFP4 caches;
      # kvfuse_native is csrc/cuda/prefill_attention.cu (sm_90), kvfuse the Triton kernels; two
      # round-robin rounds (medians), since a long compute-bound run lowers the clock.
      timeout 560 python3 -m benchmarks.attention --only prefill,extend --prefills 4096,16384 --modes bf16,fp8,nvfp4 \
        --impls kvfuse,kvfuse_native,flashinfer,torch_sdpa --rounds 2 --out "$RES/prefill" 2>&1 \
        | grep -v '^ ' | tail -4
      ;;
    prefill-sweep)
      # The new-token tiles (bf16 step K/V, FP8 dots) and the prefix-partial tiles of quantized
      # chunked prefill, one round: what picked the defaults.
      timeout 560 python3 -m benchmarks.attention --only prefill,extend --prefills 4096,16384 --modes bf16,fp8,nvfp4 \
        --impls kvfuse --sweep-new-tokens --out "$RES/prefill_sweep" 2>&1 | grep -v '^ ' | tail -4
      ;;
    decode)
      timeout 200 python3 -m benchmarks.decode_step --out "$RES" 2>&1 | tail -6
      ;;
    focus)
      # Decode tile variants at B=64 ctx 4096 (benchmarks/attention.py FOCUS_VARIANTS), by default
      # the per-token-head tile and the page prefetch of the FP8 and NVFP4 tiles against in-place reads.
      export BENCH_FOCUS_ONLY=${BENCH_FOCUS_ONLY:-"pth default,pth r128 inplace pages,pth uncapped inplace pages,pth n128 w4 s2,pth n32 w4 s4,pth n64 w8 s3,fp8 default,fp8 inplace pages,nvfp4 default,nvfp4 inplace pages"}
      timeout 420 python3 -m benchmarks.attention --focus --out "$RES" 2>&1 | grep -v '^ ' | tail -24
      ;;
    variants)
      # The quick attention matrix (decode B=64 ctx 4096, 4k prefill, chunked prefill, spec decode)
      # with the default tiles and with the tile fields not yet on by default, in one run.
      for v in ${BENCH_VARIANTS:-default "PREFETCH_PAGES=0 LONGEST_FIRST=0"}; do
        tiles=""; [ "$v" = default ] || for f in $v; do tiles="$tiles --tile $f"; done
        timeout 140 python3 -m benchmarks.attention --quick --impls kvfuse $tiles --out "$RES/attention_${v// /_}" 2>&1 \
          | grep -v '^ ' | tail -2
      done
      ;;
    native)
      python3 -c "from kvfuse.ops import native; print(native.build_info(build=True))" 2>&1 | tail -3
      timeout 240 python3 -m pytest -q -m gpu -n 8 tests/ops/test_native.py -p no:cacheprovider 2>&1 \
        | tail -8 | tee "$RES/native_tests.log"
      timeout 480 python3 -m benchmarks.native_sweep --out "$RES" ${SWEEP_ARGS:-} 2>&1 | tail -40
      ;;
    *) echo "unknown phase $phase (tests-ops | tests-ops-attention | tests-ops-rest | tests-native | tests-models | write | attention | decode | focus | variants | prefill | prefill-sweep | hf | rope | rope-native | native | tp)"; exit 2 ;;
  esac
  echo "[$phase done at ${SECONDS}s]"
done
python3 -m benchmarks.summary "$RES"
(cd "$OUT" && tar czf results.tgz results && rm -rf results)
