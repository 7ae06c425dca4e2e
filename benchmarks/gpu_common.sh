# Shared set-up of the GPU check scripts (`gpu_check.sh`, `gpu_target_check.sh`), sourced by each with
# LOG_NAME set: $OUT, the tee'd log, summary.txt and `check NAME STATUS DETAIL`, the carried wheels installed,
# and a stop unless JAX sees the GPU.
set -u
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
exec > >(tee "$OUT/$LOG_NAME") 2>&1
summary="$OUT/summary.txt"
: >"$summary"
check() { # check NAME STATUS DETAIL
  local verdict=FAIL
  [ "$2" = 0 ] && verdict=PASS
  echo "$verdict $1${3:+: $3}" | tee -a "$summary"
}

echo "== environment"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  check "carried wheels installed" $? "$(ls .whl | wc -l) wheels"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import jax, flax, optax; d = jax.devices()[0]; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, '|', jax.device_count(), 'x', d.device_kind, d.platform); assert d.platform == 'gpu'"
status=$?
check "JAX sees the GPU" $status
[ "$status" = 0 ] || exit 1

