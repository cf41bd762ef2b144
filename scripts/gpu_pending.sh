#!/usr/bin/env bash
# What results/gpu-runs.md lists as "not run on the GPU with the final code", in device-call-sized
# stages (each well under 10 minutes on an H100/H200), so that a session with device time runs
# them in a few calls. Writes <stage>.txt (and JSON where a bench writes it) to $OUT.
#
#   OUT=/tmp/out bash scripts/gpu_pending.sh fp8      # issue #30: the grouped Triton kernels' device
#                                                     # tests, the FP8 GPU tests with them forced, the
#                                                     # packed FP8 tests, the end-to-end host breakdown
#                                                     # (auto vs forced), the bench, the FP8 varlen probe
#   OUT=/tmp/out bash scripts/gpu_pending.sh shapes   # issue #28: new_length, decode calls and a profiled
#                                                     # generation, hf_generate, hf_dynamic_padding, the
#                                                     # shapes and folded tests, compute-sanitizer
#   OUT=/tmp/out bash scripts/gpu_pending.sh lengths  # issue #28, the part of "shapes" that fits one short
#                                                     # call: the shapes and folded tests, new_length on
#                                                     # three paths, the new-length breakdown,
#                                                     # hf_dynamic_padding under enable() (its builds), and
#                                                     # the right-padded HF model tests (length_terms)
#   OUT=/tmp/out bash scripts/gpu_pending.sh generate # issue #28, the rest of "shapes" in one call: decode
#                                                     # calls, the bare decode graphs (decode_rows_probe.py,
#                                                     # batch 8 and 1), hf_generate (four paths, batch 8 and 1),
#                                                     # hf_dynamic_padding (three paths), each in this
#                                                     # process's children as bench_shapes.py runs them
#   OUT=/tmp/out bash scripts/gpu_pending.sh host     # issues #28 and #30 in one short call: the FP8 host
#                                                     # time per function, cuDNN's FP8 kernels with GQA
#                                                     # against K/V expanded, the new-length host segments,
#                                                     # the FP8 end-to-end profile, the shapes/folded and
#                                                     # FP8 recipe tests, a Triton launch's host cost
#   OUT=/tmp/out bash scripts/gpu_pending.sh rows     # issue #30, causal FP8 backward by batch rows: the
#                                                     # GQA probe (whole batch, per row, package) at 8k
#                                                     # and 4k, the FP8 GPU tests, the bench's two causal
#                                                     # GQA cases, the FP8 backward's plan sweep
#   OUT=/tmp/out bash scripts/gpu_pending.sh floor    # issue #30's targets: `cudnn-sdpa bench --shapes fp8`
#                                                     # (quantisation as `auto` picks it), then
#                                                     # fp8_e2e_profile.py at each of its ten shapes:
#                                                     # wall, host and kernels per path, and the
#                                                     # kernels' ratio (the floor with the host hidden)
#   OUT=/tmp/out bash scripts/gpu_pending.sh graphed  # issue #30 with the host hidden: fp8_graphed.py (the
#                                                     # delayed recipe's call captured in a CUDA graph against
#                                                     # native eager and replayed, with its errors vs fp32) at
#                                                     # b1 4k, b4 GQA 4k and b1 8k, causal and not
#   OUT=/tmp/out bash scripts/gpu_pending.sh hfhost   # issue #28's host-bound HF row (l2 d256, padded): the
#                                                     # step's host time by where the code lives and its
#                                                     # device syncs (hf_step_profile.py --host), on one
#                                                     # core (taskset, as run 76 measured 0.60x) and unpinned
#   OUT=/tmp/out bash scripts/gpu_pending.sh tier     # the engine/provider/reliability/layouts tier
#                                                     # (run it after swapping in a newer cuDNN: issue #27)
#
# Needs nvidia-cudnn-frontend's wheel in .whl/ (docs/gpu-tier.md); FRONTEND (default 1.32.0).
set -u
stage=${1:?usage: gpu_pending.sh fp8|shapes|lengths|generate|host|rows|floor|graphed|hfhost|tier}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
fe=${FRONTEND:-1.32.0}
site=${SITE_ROOT:-/tmp}/csp-fe-$fe
if [ ! -d "$site/cudnn" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/nvidia_cudnn_frontend-"$fe"-*.whl \
    || { echo "gpu_pending: cannot install nvidia-cudnn-frontend $fe from .whl/" >&2; exit 2; }
fi
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
log="$OUT/$stage.txt"
status=0
run() {  # run NAME COMMAND...: a section of the log; a failing command marks the stage failed, the rest still run
  echo "===== $1 ($(date -u +%H:%M:%S))" | tee -a "$log"
  shift
  timeout "${STEP_TIMEOUT:-420}" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { status=1; echo "===== exit $rc" | tee -a "$log"; }
}
versions="print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version(), 'frontend', cudnn.__version__,"
versions="$versions 'backend', cudnn.backend_version(), torch.cuda.get_device_name())"
python3 -c "import torch, cudnn; $versions" | tee "$log"
case "$stage" in
  fp8)
    run grouped_kernels_on_device python3 -m pytest tests/gpu/test_fp8_recipes_gpu.py --gpu -q -p no:cacheprovider \
      -k "grouped or twins or forced_triton or triton_kernels"
    run fp8_tests_forced env CUDNN_SDPA_PROVIDER_FP8_QUANT=triton python3 -m pytest tests/gpu/test_fp8.py \
      tests/gpu/test_fp8_recipes_gpu.py --gpu -q -p no:cacheprovider
    run fp8_varlen_tests python3 -m pytest tests/gpu/test_fp8_varlen_gpu.py --gpu -q -p no:cacheprovider
    run e2e_auto python3 scripts/fp8_e2e_profile.py --calls 20
    run e2e_grouped env CUDNN_SDPA_PROVIDER_FP8_QUANT=triton python3 scripts/fp8_e2e_profile.py --calls 20 --cprofile 20
    run bench_fp8_grouped env CUDNN_SDPA_PROVIDER_FP8_QUANT=triton python3 -m cudnn_sdpa_provider bench --shapes fp8 \
      --repeats 10 --warmup 3 --json "$OUT/bench-fp8.json"
    run fp8_varlen_probe python3 scripts/fp8_varlen_probe.py --json "$OUT/fp8-varlen-probe.json"
    ;;
  shapes|lengths)
    run shapes_tests python3 -m pytest tests/gpu/test_shapes.py tests/gpu/test_folded_gpu.py \
      tests/gpu/test_packed_buckets.py --gpu -q -p no:cacheprovider
    for path in provider native flash; do
      run "new_length_$path" python3 scripts/bench_shapes.py new_length "$path"
    done
    run new_length_breakdown python3 scripts/new_length_breakdown.py
    if [ "$stage" = lengths ]; then  # HF's padding mask under enable() (ops/bias_lengths.py): builds per doubling?
      run hf_dynamic_padding_provider python3 scripts/bench_shapes.py hf_dynamic_padding provider
      # right-padded HF models through the integration and under enable(), forward and backward against
      # eager: every layer after the first on the row terms kept on the lengths (core/length_terms.py)
      run hf_models_padded python3 -m pytest tests/gpu/test_models.py --gpu -q -p no:cacheprovider \
        -k "served_and_equal_to_eager or inside_enable_served"
    fi
    [ "$stage" = lengths ] && { echo "===== stage lengths: $([ $status = 0 ] && echo passed || echo FAILED)" | tee -a "$log"; exit $status; }
    run decode_calls python3 scripts/decode_profile.py calls --steps 64
    run decode_generate python3 scripts/decode_profile.py generate provider --batch 8
    run hf_all python3 scripts/bench_shapes.py all --json "$OUT/shapes.json"
    # exit 4: no compute-sanitizer on the machine, nothing run (said in the log, not a failure)
    run sanitize_folded bash -c 'OUT="$1" TIMEOUT=400 bash scripts/sanitize_folded.sh; rc=$?
      if [ $rc = 4 ]; then echo "compute-sanitizer not found: not run"; exit 0; fi; exit $rc' _ "$OUT"
    ;;
  generate)
    run decode_calls python3 scripts/decode_profile.py calls --steps 64
    for batch in 8 1; do  # a KV group's query heads as query rows against today's fold and the exact graph
      run "decode_rows_probe_$batch" python3 scripts/decode_rows_probe.py --shape "$batch,32,8,128"
    done
    for batch in 8 1; do
      for path in provider cudnn native flash; do
        run "hf_generate_${path}_$batch" python3 scripts/bench_shapes.py hf_generate "$path" "$batch"
      done
    done
    for path in provider cudnn native; do
      run "hf_dynamic_padding_$path" python3 scripts/bench_shapes.py hf_dynamic_padding "$path"
    done
    ;;
  host)
    run fp8_host_breakdown python3 scripts/fp8_host_breakdown.py
    run fp8_gqa_bwd_probe python3 scripts/fp8_gqa_bwd_probe.py
    run new_length_segments python3 scripts/new_length_breakdown.py --segments
    run fp8_e2e python3 scripts/fp8_e2e_profile.py --calls 20
    run fp8_gqa_bwd_probe_4k python3 scripts/fp8_gqa_bwd_probe.py --shape 4,32,8,4096,128
    run shapes_folded_tests python3 -m pytest tests/gpu/test_shapes.py tests/gpu/test_folded_gpu.py --gpu -q \
      -p no:cacheprovider
    run fp8_recipe_tests python3 -m pytest tests/gpu/test_fp8_recipes_gpu.py --gpu -q -p no:cacheprovider
    run triton_launch_probe python3 scripts/triton_launch_probe.py
    ;;
  rows)
    run fp8_gqa_bwd_probe python3 scripts/fp8_gqa_bwd_probe.py
    run fp8_gqa_bwd_probe_4k python3 scripts/fp8_gqa_bwd_probe.py --shape 4,32,8,4096,128
    run fp8_tests python3 -m pytest tests/gpu/test_fp8.py tests/gpu/test_fp8_recipes_gpu.py --gpu -q -p no:cacheprovider
    run bench_fp8_gqa_causal python3 -m cudnn_sdpa_provider bench \
      --shapes fp8_b4_h32kv8_s4096_d128_causal,fp8_b4_h32kv8_s8192_d128_causal --repeats 10 --warmup 3 \
      --json "$OUT/bench-fp8-gqa-causal.json"
    run fp8_plan_sweep python3 scripts/plan_sweep.py --cases "" --repeats 10 --fp8 4,32,8,8192,128,causal \
      --fp8 1,32,32,8192,128,causal
    ;;
  floor)
    run bench_fp8 python3 -m cudnn_sdpa_provider bench --shapes fp8 --repeats 10 --warmup 3 --json "$OUT/bench-fp8.json"
    for shape in 1,32,32,4096,128 1,32,32,8192,128 1,32,32,16384,128 4,32,8,4096,128 4,32,8,8192,128; do
      IFS=, read -r b h hk s d <<< "$shape"
      run "fp8_e2e_b${b}_h${h}kv${hk}_s${s}_causal" python3 scripts/fp8_e2e_profile.py --shape "$shape" --calls 10
      run "fp8_e2e_b${b}_h${h}kv${hk}_s${s}" python3 scripts/fp8_e2e_profile.py --shape "$shape" --no-causal --calls 10
    done
    ;;
  graphed)
    for shape in 1,32,32,4096,128 4,32,8,4096,128 1,32,32,8192,128; do
      IFS=, read -r b h hk s d <<< "$shape"
      run "fp8_graphed_b${b}_h${h}kv${hk}_s${s}_causal" python3 scripts/fp8_graphed.py --shape "$shape"
      run "fp8_graphed_b${b}_h${h}kv${hk}_s${s}" python3 scripts/fp8_graphed.py --shape "$shape" --no-causal
    done
    ;;
  hfhost)
    core=${CORE:-$(( $(nproc) > 3 ? 3 : 0 ))}  # one core (3, as in run 76, where there is one)
    run hf_step_host_one_core taskset -c "$core" python3 scripts/hf_step_profile.py \
      --case hf_llama_l2_d256_b2_s256_padded --repeats 300 --host 50
    run hf_step_host_unpinned python3 scripts/hf_step_profile.py --case hf_llama_l2_d256_b2_s256_padded \
      --repeats 300 --host 50
    ;;
  tier)
    run tier python3 -m pytest tests/gpu/test_known_issues_gpu.py tests/gpu/test_engine.py tests/gpu/test_provider.py \
      tests/gpu/test_reliability.py tests/gpu/test_layouts.py --gpu -q -p no:cacheprovider -m "gpu and not slow"
    ;;
  *)
    echo "gpu_pending: unknown stage $stage (fp8, shapes, lengths, generate, host, rows, floor, graphed, hfhost, tier)" >&2
    exit 2
    ;;
esac
echo "===== stage $stage: $([ $status = 0 ] && echo passed || echo FAILED)" | tee -a "$log"
exit $status
