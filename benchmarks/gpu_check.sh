#!/usr/bin/env bash
# One bounded accelerator check on an NVIDIA GPU (written for one H200: its image's python3 with JAX 0.11 +
# CUDA 13, no network), about 8 minutes of run time, every stage under its own timeout:
#
#   1. the block attention tests (tests/kernels) on the GPU: the Mosaic GPU kernel compiled and run on the
#      GPU against the dense reference (tests/kernels/test_pallas_gpu_block_attention.py; interpret mode
#      elsewhere), the chunked XLA path, the dispatcher and the config keys (fp32 matmuls at full
#      precision); the TPU kernel's cases run in interpret mode;
#   2. benchmarks/block_attention.py at paper shapes: the Mosaic GPU kernel, chunked XLA, dense reference
#      and tokamax's fused attention (Mosaic GPU, then its own choice) under the dense block mask, with
#      max |d| vs XLA;
#   3. benchmarks/train_step.py: the paper micro-step (4 rows, as on each of the seed's 4 GPUs) x 8 per
#      optimizer step, its time, and MFU against the 989 TFLOP/s dense bf16 peak of an H200 SXM.
#
# Packages the image lacks travel as wheels in .whl/ (see the download command below); with the device
# tool, from the repository root:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
# Everything lands in $OUT (or /tmp/gpu_check_out): gpu_check.log, one log per stage, and summary.txt with
# one PASS/FAIL line per check.
#
# Wheels (here, once; .whl/ is ignored through .git/info/exclude):
#   for p in grain==0.2.18 array-record==0.8.6 portpicker ml-collections==1.1.0 gguf==0.19.0 \
#       tokamax==0.0.12 qwix einshape pydantic pydantic-core annotated-types typing-inspection \
#       typing-extensions typeguard==2.13.3 immutabledict tensorboardx; do
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl "$p"; done
LOG_NAME=gpu_check.log
. "$(dirname "$0")/gpu_common.sh"

echo "== 1. tests/kernels on the GPU"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels \
  2>&1 | tee "$OUT/tests_kernels.log" | tail -25
check "tests/kernels on the GPU" "${PIPESTATUS[0]}" "$(tail -1 "$OUT/tests_kernels.log")"

echo "== 2. block attention at paper shapes"
timeout 140 python3 benchmarks/block_attention.py --shapes=paper --passes=fwd,fwd+bwd --repeats=3 \
  --implementations=pallas,xla,reference,tokamax:mosaic,tokamax 2>&1 | tee "$OUT/block_attention_paper.txt"
status=${PIPESTATUS[0]}
python3 - "$OUT/block_attention_paper.txt" <<'EOF'
import math, sys
rows = [line.split() for line in open(sys.argv[1]) if line.startswith("paper")]
fwd = {r[2]: r for r in rows if r[1] == "fwd" and "failed:" not in r}
assert "xla" in fwd, "no paper fwd xla row"
assert "reference" in fwd and float(fwd["reference"][-1]) < 5e-2, "xla differs from the dense reference"
assert "pallas" in fwd and float(fwd["pallas"][-1]) < 5e-2, "the Mosaic GPU kernel differs from xla"
print(f"Mosaic GPU kernel {fwd['pallas'][3]} ms vs xla {fwd['xla'][3]} ms")
tokamax = [k for k in fwd if k.startswith("tokamax")]
print("tokamax rows:", ", ".join(f"{k} {fwd[k][3]} ms max|d| {fwd[k][-1]}" for k in tokamax) or "none ran")
EOF
check "block attention benchmark (Mosaic GPU kernel, xla, reference at paper shapes)" $((status || $?))

echo "== 3. paper train step and MFU"
timeout 200 python3 benchmarks/train_step.py --presets=paper --shape_only --steps=3 --peak_tflops=989 \
  --overrides=train.global_batch=32,train.grad_accum=8 2>&1 | tee "$OUT/train_step_paper.txt"
status=${PIPESTATUS[0]}
python3 - "$OUT/train_step_paper.txt" <<'EOF'
import math, sys
line = next(l for l in open(sys.argv[1]) if l.startswith("paper"))
step_s, tflop, achieved, mfu = float(line.split()[2]), float(line.split()[6]), float(line.split()[7]), line.split()[8]
assert math.isfinite(achieved) and achieved > 0
print(f"paper step of 32 samples (8 micro-steps of 4): {step_s:.3f} s, {tflop:.1f} TFLOP, {achieved:.1f} TFLOP/s, "
      f"MFU {mfu}; the seed's 512-sample step on this one GPU: ~{16 * step_s:.1f} s")
EOF
check "paper train step time and MFU" $((status || $?))

echo "== summary"
cat "$summary"
! grep -q '^FAIL' "$summary"
rc=$?
sleep 1 # lets tee finish gpu_check.log
exit $rc
