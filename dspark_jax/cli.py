"""What every command shares (each command is one module, `python -m dspark_jax.<command>` runs
`dspark_jax/<command>.py`: its flags and `main`): the `--config` flag, validated before any work, path flags,
quiet logging, and `run`, which turns user errors into one `error:` line and an exit status."""

from __future__ import annotations

import difflib
import importlib.util
import logging
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from dspark_jax.errors import UsageError
from dspark_jax.run import config_lib
from dspark_jax.run.checkpoints import run_config
from dspark_jax.run.config_lib import REPO_ROOT, resolve_path, with_absolute_paths
from dspark_jax.target.generate import SamplingParams

DEFAULT_CONFIG = f"{REPO_ROOT / 'configs' / 'memory.py'}:demo"  # the main job


def define_config_flag(default: str | None = DEFAULT_CONFIG):
    """`--config=configs/<experiment>.py[:preset]` with `--config.key=value` overrides.

    `default=None` makes the flag optional (commands that read a run's stored config).
    Experiment configs import `configs.base`, so the repository root goes on `sys.path`.
    """
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return config_flags.DEFINE_config_file("config", default, "Experiment config file[:preset].")


def config_value(flag):
    """The flag's config, validated (a one-line error naming the key, before any expensive work)."""
    config = with_absolute_paths(flag.value)
    config_lib.validate(config)
    return config


def check_flags(**checks: tuple[bool, str]) -> None:
    """Raises `UsageError` for the first failed `name=(ok, requirement)`: `--name must <requirement>`."""
    for name, (ok, requirement) in checks.items():
        if not ok:
            raise UsageError(f"--{name} {requirement}")


def checkpoint_config(flag, checkpoint: str):
    """The config of the run in `checkpoint`: the stored one, or `--config` when given and consistent."""
    config = run_config(checkpoint, given=with_absolute_paths(flag.value))
    config_lib.validate(config)
    return config


class SamplingFlags:
    """`--temperature`, `--top_p`, `--seed` and `--max_new_tokens`, each overriding the config when given."""

    def __init__(self):
        self._temperature = flags.DEFINE_float("temperature", None, "Overrides config.generate.temperature.")
        self._top_p = flags.DEFINE_float("top_p", None, "Overrides config.generate.top_p.")
        self._seed = flags.DEFINE_integer("seed", None, "Overrides config.seed.")
        self._max_new = flags.DEFINE_integer(
            "max_new_tokens", None, "Overrides config.generate.max_new_tokens."
        )

    def check(self) -> None:
        """Refuses given values that cannot work, before any config or model is read."""
        given = self._max_new.value
        check_flags(max_new_tokens=(given is None or given >= 1, f"must be >= 1, got {given}"))

    def resolve(self, config) -> tuple[SamplingParams, int, int]:
        """`(sampling, seed, max_new_tokens)` from the flags, falling back to `config.generate` and
        `config.seed`."""
        pick = lambda flag, default: default if flag.value is None else flag.value
        params = SamplingParams(
            temperature=pick(self._temperature, config.generate.temperature),
            top_p=pick(self._top_p, config.generate.top_p),
        )
        max_new = pick(self._max_new, config.generate.max_new_tokens)
        check_flags(max_new_tokens=(max_new >= 1, f"must be >= 1, got {max_new}"))
        return params, pick(self._seed, config.seed), max_new


def config_overrides(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """The `--config=FILE[:preset]` value and the `--config.KEY` override keys of a command line."""
    spec, keys = None, []
    for arg in argv:
        if arg.startswith("--config="):
            spec = arg.split("=", 1)[1]
        elif arg.startswith("--config."):
            keys.append(arg[len("--config.") :].split("=", 1)[0])
    return spec, keys


def unknown_override(argv: Sequence[str], default: str | None) -> str | None:
    """A message naming the first `--config.KEY` that the config file lacks, with the nearest keys; None
    when every key is known or there is none (the AttributeError was not about an override)."""
    spec, keys = config_overrides(argv)
    spec = spec or default
    if not keys:
        return None
    if spec is None:
        return "--config.KEY overrides need --config=FILE[:preset]"
    path, _, preset = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_config_for_check", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = module.get_config(preset) if preset else module.get_config()
    known = config_lib.flatten(config.to_dict())
    prefixes = {name.rsplit(".", i)[0] for name in known for i in range(name.count(".") + 1)}
    for key in keys:
        if key not in known and key not in prefixes:
            near = difflib.get_close_matches(key, list(known), n=3)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            return f"--config.{key}: {key} is not a key of {path}{hint}"
    return None


class _Console(logging.Handler):
    """The terminal at default verbosity: this package's INFO lines as plain text, anyone's warnings."""

    def __init__(self):
        super().__init__(logging.INFO)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.startswith("dspark_jax")

    def emit(self, record: logging.LogRecord) -> None:
        prefix = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        print(prefix + record.getMessage(), file=sys.stderr, flush=True)


def configure_logging() -> None:
    """Quiet terminal by default: progress, evaluations, warnings and summaries. Library INFO logs
    (orbax, absl, grain, jax) and per-item messages only reach a log file (`log_to_file`), unless
    `--verbosity` is given, which restores absl's full logging to the terminal."""
    root = logging.getLogger()
    root.setLevel(logging.DEBUG)
    if flags.FLAGS["verbosity"].present:
        return
    absl_handler = absl_logging.get_absl_handler()
    if absl_handler in root.handlers:
        root.removeHandler(absl_handler)
    root.addHandler(_Console())


def log_to_file(path: str | os.PathLike) -> None:
    """Every log record (DEBUG and up, libraries included) also goes to `path` (a local file)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)


_PATH_FLAGS: list[str] = []


def define_path_flag(name: str, default: str | None, help: str, **kwargs):
    """A string flag holding a path or URL; `run` makes it absolute before `main` sees it."""
    _PATH_FLAGS.append(name)
    return flags.DEFINE_string(name, default, help, **kwargs)


# glibc hands large freed blocks (a step's vocabulary-sized temporaries) back to the kernel and faults
# fresh 4 KiB pages in again on the next step: on a 2-core CPU host that was half the demo step's time
# (50% system time, ~280k page faults/s). Transparent huge pages for malloc's mapped chunks cut that.
HOST_MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"


def tune_host_malloc() -> None:
    """Re-executes the running command once with `HOST_MALLOC_TUNABLE` added to `GLIBC_TUNABLES` (read by
    glibc at start-up only). Only for a `dspark_jax` command run as `__main__` on Linux glibc, never twice;
    `DSPARK_JAX_MALLOC=default` keeps the default allocator."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (
        main_spec is None
        or not main_spec.name.startswith("dspark_jax")
        or not sys.platform.startswith("linux")
        or platform.libc_ver()[0] != "glibc"
        or "glibc.malloc.hugetlb" in tunables
        or os.environ.get("DSPARK_JAX_MALLOC") == "default"
    ):
        return
    os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, [tunables, HOST_MALLOC_TUNABLE]))
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def run(main: Callable, *, config_default: str | None = DEFAULT_CONFIG) -> None:
    """`absl.app.run(main)` with quiet logging, where user errors print one `error:` line.

    Usage errors (`UsageError`, a `--config.KEY` the config lacks, a bad config value) exit 2; other
    errors about inputs (`ValueError`, `FileNotFoundError`, ...) exit 1. `--verbose` re-raises them
    with the traceback. The command first re-executes itself with `tune_host_malloc`.
    """
    tune_host_malloc()
    verbose = "--verbose" in sys.argv
    argv = [a for a in sys.argv if a != "--verbose"]

    def quiet_main(args):
        configure_logging()
        for name in _PATH_FLAGS:
            if getattr(flags.FLAGS, name):
                setattr(flags.FLAGS, name, resolve_path(getattr(flags.FLAGS, name)))
        return main(args)

    try:
        app.run(quiet_main, argv=argv)
    except AttributeError:
        message = unknown_override(argv[1:], config_default)
        if verbose or message is None:
            raise
        _fail(message, 2)
    except UsageError as e:
        if verbose:
            raise
        _fail(str(e), 2)
    except (ValueError, OSError, KeyError, IndexError) as e:
        if verbose:
            raise
        _fail(str(e), 1)


def _fail(message: str, status: int) -> None:
    print(f"error: {message} (--verbose shows the traceback)", file=sys.stderr)
    sys.exit(status)
