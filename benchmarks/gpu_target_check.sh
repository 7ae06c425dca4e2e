#!/usr/bin/env bash
# One bounded accelerator check of the hybrid and sparse targets on an NVIDIA GPU (written for one H200: its
# image's python3 with JAX 0.11 + CUDA 13, no network), about 7 minutes, every stage under its own timeout:
#
#   1. the Gated DeltaNet, MoE and hybrid-target tests on the GPU (tests/target: chunked = recurrent, both
#      against transformers' torch reference; the sparse MoE against Qwen3-MoE / Qwen3-Next / Qwen 3.5-MoE
#      blocks; the hybrid targets' logits, every layer and the per-row roll-back; fp32 matmuls at full
#      precision);
#   2. benchmarks/moe_forward.py at a Qwen3-30B-A3B layer's shapes (128 experts, top 8, H 2048, I 768, bf16):
#      the tiled experts (the GPU's default) and ragged_dot against the dense all-experts reference; PASS
#      when the tiled forward is >= 2x faster than the dense one at 2,048 tokens (issue 50);
#   3. benchmarks/hybrid_target.py: the verify cycle, dense vs hybrid MoE target, with state selection;
#   4. benchmarks/online_training.py: seconds per step offline vs online at the demo and accel shapes.
#
# Wheels as for gpu_check.sh (its header); with the device tool, from the repository root:
#   run(command="bash benchmarks/gpu_target_check.sh", carry=[".whl"], timeout_s=600)
# Everything lands in $OUT: gpu_target_check.log, one log per stage, summary.txt (PASS/FAIL per check).
LOG_NAME=gpu_target_check.log
. "$(dirname "$0")/gpu_common.sh"

echo "== 1. tests/target (Gated DeltaNet, MoE, hybrid targets) on the GPU"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout -s INT 180 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/target/test_gated_deltanet.py tests/target/test_moe.py tests/target/test_hybrid.py \
  -k "not greedy_generation" 2>&1 | tee "$OUT/tests_target.log" | tail -25
check "tests/target (hybrid, MoE, Gated DeltaNet) on the GPU" "${PIPESTATUS[0]}" "$(tail -1 "$OUT/tests_target.log")"

echo "== 2. sparse MoE forward vs all experts"
timeout 100 python3 benchmarks/moe_forward.py --shape=qwen3-30b-a3b --tokens=256,2048 --dtype=bfloat16 \
  --repeats=3 2>&1 | tee "$OUT/moe_forward.txt"
check "MoE forward benchmark" "${PIPESTATUS[0]}"
speedup=$(awk '$1 == 2048 && $2 == "tiled" {print $4}' "$OUT/moe_forward.txt" | tr -d x)
awk -v s="${speedup:-0}" 'BEGIN {exit !(s >= 2)}'
check "tiled experts >= 2x the dense reference at 2,048 tokens" $? "${speedup:-none}x"

echo "== 3. verify cycle, dense vs hybrid MoE target"
timeout 80 python3 benchmarks/hybrid_target.py --rows=8 --context=256 --repeats=5 2>&1 | tee "$OUT/hybrid_target.txt"
check "hybrid verify-cycle benchmark" "${PIPESTATUS[0]}"

echo "== 4. online vs offline step seconds"
timeout 150 python3 benchmarks/online_training.py --presets=demo,accel --steps=5 2>&1 \
  | tee "$OUT/online_training.txt"
check "online training benchmark" "${PIPESTATUS[0]}"

echo "== summary"
cat "$summary"
! grep -q '^FAIL' "$summary"
rc=$?
sleep 1 # lets tee finish the log
exit $rc
