"""launch/xla_flags.sh, the one home of the accelerator XLA flags: every GPU flag is one the installed XLA
knows (an unknown flag aborts JAX at start-up), user flags come last and win, and it can be turned off."""

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS_FILE = ROOT / "launch" / "xla_flags.sh"


def sourced(**env: str) -> dict[str, str]:
    """XLA_FLAGS and LIBTPU_INIT_ARGS after sourcing the file in bash with ``env``."""
    script = f'source {FLAGS_FILE} && printf "%s\\n%s\\n" "${{XLA_FLAGS-unset}}" "${{LIBTPU_INIT_ARGS-unset}}"'
    base = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
    out = subprocess.run(["bash", "-c", script], env=dict(base, **env), capture_output=True, text=True, check=True)
    xla, libtpu = out.stdout.splitlines()
    return {"XLA_FLAGS": xla, "LIBTPU_INIT_ARGS": libtpu}


def test_every_gpu_flag_is_known_to_the_installed_xla():
    flags = sourced()["XLA_FLAGS"]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", "import jax; jax.numpy.ones(1).block_until_ready()"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_user_flags_come_last_and_none_turns_them_off():
    mine = "--xla_gpu_enable_latency_hiding_scheduler=false"
    flags = sourced(XLA_FLAGS=mine, LIBTPU_INIT_ARGS="--xla_tpu_x=1")
    assert flags["XLA_FLAGS"].endswith(mine) and flags["XLA_FLAGS"].startswith("--xla_gpu")
    assert flags["LIBTPU_INIT_ARGS"].endswith("--xla_tpu_x=1")
    assert sourced(OODJAX_XLA_FLAGS="none") == {"XLA_FLAGS": "unset", "LIBTPU_INIT_ARGS": "unset"}


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not installed: apt-get install -y shellcheck"
    result = subprocess.run(
        [shellcheck, "-x", "--shell=bash", str(FLAGS_FILE)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout
