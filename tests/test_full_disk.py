"""A full disk, for real: results and checkpoints written to a 4 MiB tmpfs until it fills.

The file system is mounted in a user and mount namespace (`unshare -rm`, no root needed where the kernel
allows unprivileged user namespaces, as it does here and on common CI runners); without `unshare` this
file fails rather than skips. A write that finds the disk full must raise one NoSpaceError naming the path
being written, and leave the previous metrics.npz and the earlier checkpoints as they were; the
interrupted checkpoint is never listed, and its leftovers go once the next job starts saving.
"""

import asyncio
import errno
import json
import pathlib
import shutil
import subprocess
import sys
import threading

import pytest

from tests.engine_configs import SHRUNK_DEMO_ARGS

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs inside the namespace, with the tmpfs mounted at argv[1]; prints one JSON line of observations.
SCRIPT = """
import json, pathlib, sys
import jax, jax.numpy as jnp, numpy as np
from oodjax import storage
from oodjax.engine import checkpoints, results

root = pathlib.Path(sys.argv[1])
seen = {}
metrics = root / "run" / "metrics.npz"
storage.write_npz_atomic(metrics, {"step": np.arange(3)})
before = metrics.read_bytes()
try:
    storage.write_npz_atomic(metrics, {"step": np.arange(3), "margins": np.random.default_rng(0).random(1_000_000)})
except storage.NoSpaceError as error:
    seen["results_error"] = str(error)
seen["results_intact"] = metrics.read_bytes() == before
seen["results_files"] = sorted(path.name for path in metrics.parent.iterdir())

checkpointer = checkpoints.RunCheckpointer(root / "run", name="run")
checkpointer.save(1, {"a": jnp.full(256, 1.0)}, {"step": 1})
checkpointer.wait()
big = jnp.asarray(np.random.default_rng(1).random(2_000_000, dtype=np.float32))
try:
    checkpointer.save(2, {"a": big}, {"step": 2})
    checkpointer.wait()
except storage.NoSpaceError as error:
    seen["checkpoint_error"] = str(error)
seen["steps"] = checkpoints.checkpoint_steps(root / "run")
seen["left"] = sorted(path.name for path in checkpoints.checkpoint_dir(root / "run").iterdir())
restored = checkpoints.restore_newest(root / "run", {"a": jax.ShapeDtypeStruct((256,), jnp.float32)})
seen["restored"] = [restored.step, float(restored.state["a"].sum())]
checkpointer.close()

metrics.unlink()  # space freed: the next job's checkpointer clears what the failed save left
checkpoints.RunCheckpointer(root / "run", name="run").close()
seen["after_restart"] = sorted(path.name for path in checkpoints.checkpoint_dir(root / "run").iterdir())
print(json.dumps(seen))
"""


def test_a_full_disk_stops_with_one_error_naming_the_path_and_keeps_what_was_written(tmp_path):
    unshare = shutil.which("unshare")
    assert unshare, "unshare (util-linux) is needed to mount a small file system without root"
    mount = tmp_path / "small"
    mount.mkdir()
    command = f'mount -t tmpfs -o size=4m tmpfs {mount} && exec {sys.executable} -c "$0" {mount}'
    result = subprocess.run(
        [unshare, "-rm", "sh", "-c", command, SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    metrics = mount / "run" / "metrics.npz"
    assert seen["results_error"] == (
        f"[Errno 28] No space left on device while writing {metrics}; the previous metrics.npz is intact. "
        "Free space and rerun to resume"
    )
    assert seen["results_intact"] and seen["results_files"] == ["metrics.npz"]  # no temporary file left
    directory = mount / "run" / "checkpoints"
    assert seen["checkpoint_error"] == (
        f"[Errno 28] No space left on device while writing {directory}; the checkpoints at steps [1] are intact. "
        "Free space and rerun to resume"
    )
    assert seen["steps"] == [1]  # the interrupted step 2 is not a checkpoint
    assert seen["left"] == ["1", "2.orbax-checkpoint-tmp"]
    assert seen["restored"] == [1, 256.0]
    assert seen["after_restart"] == ["1"]


# Runs `oodjax.main` on the shrunk demo (one run, 4 steps, checkpoints at 2 and 4) with its output on the tmpfs
# at argv[2], which is filled just before the checkpoint of step argv[1] is saved (the earlier saves complete).
FILLED_JOB = """
import os, pathlib, sys
from oodjax import main
from oodjax.engine import checkpoints

fill_at, root = int(sys.argv[1]), pathlib.Path(sys.argv[2])
save = checkpoints.RunCheckpointer.save


def save_on_a_full_disk(self, step, *args, **kwargs):
    if step == fill_at:
        self.wait()
        descriptor = os.open(root / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        for size in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    os.write(descriptor, bytes(size))
            except OSError:
                pass
        os.close(descriptor)
    return save(self, step, *args, **kwargs)


checkpoints.RunCheckpointer.save = save_on_a_full_disk
sys.argv = ["oodjax-train", *sys.argv[3:]]
try:
    main.run()
finally:  # the steps the run's metrics.npz holds, for the test (the file system goes with the namespace)
    import numpy as np
    metrics = root / "out" / "opt-tiny-random_mnli_seed0_shots32" / "metrics.npz"
    print(np.load(metrics)["step"].tolist() if metrics.exists() else None)
"""


def filled_job(tmp_path, fill_at):
    """The job of FILLED_JOB, its disk filled before the checkpoint of step ``fill_at``: (status, stderr's lines,
    the run's folder, the steps its metrics.npz held)."""
    unshare = shutil.which("unshare")
    assert unshare, "unshare (util-linux) is needed to mount a small file system without root"
    mount = tmp_path / "small"
    mount.mkdir()
    arguments = [*SHRUNK_DEMO_ARGS, "--config.runs.seeds=0", "--config.checkpoint_every=2"]
    arguments.append(f"--config.output_dir={mount / 'out'}")
    command = f'mount -t tmpfs -o size=8m tmpfs {mount} && exec {sys.executable} -c "$0" "$@"'
    result = subprocess.run(
        [unshare, "-rm", "sh", "-c", command, FILLED_JOB, str(fill_at), str(mount), *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "JAX_PLATFORMS": "cpu",
            "HOME": str(tmp_path),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        },
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    steps = json.loads(result.stdout.strip().splitlines()[-1])
    return result.returncode, lines, mount / "out" / "opt-tiny-random_mnli_seed0_shots32", steps


def library_noise(lines):
    return [line for line in lines if any(word in line for word in ("Traceback", "Task exception", "orbax", "Errno"))]


def test_a_job_whose_disk_fills_says_so_in_one_line_and_nothing_else(tmp_path):
    status, lines, run_dir, _ = filled_job(tmp_path, fill_at=2)
    assert status == 1, "\n".join(lines[-40:])
    directory = run_dir / "checkpoints"
    error = (
        f"ERROR [Errno 28] No space left on device while writing {directory}; there is no earlier checkpoint. "
        "Free space and rerun to resume"
    )
    assert lines[-1].endswith(error), "\n".join(lines[-40:])
    assert library_noise(lines) == [lines[-1]], "\n".join(lines[-40:])  # the one line, and no library's
    reports = [line for line in lines if " ERROR " in line or " WARNING " in line]
    assert [line for line in reports if "evaluated fewer than" not in line] == [lines[-1]]  # a 4-step job's warning


def test_a_job_whose_final_checkpoint_fills_the_disk_is_done_with_a_warning(tmp_path):
    status, lines, run_dir, steps = filled_job(tmp_path, fill_at=4)
    assert status == 0, "\n".join(lines[-40:])
    warning = (
        f"WARNING the disk filled up while writing {run_dir / 'checkpoints'}, a final checkpoint; every run's "
        "results are complete (each metrics.npz holds its last step), so the job is done"
    )
    assert lines[-1].endswith(warning), "\n".join(lines[-40:])
    assert library_noise(lines) == [] and [line for line in lines if " ERROR " in line] == []
    assert steps == [0, 2, 4]


def test_a_failed_write_s_callbacks_into_its_closed_event_loop_are_dropped_and_other_reports_kept(monkeypatch):
    """orbax's way of failing a save, reproduced: a gather of TensorStore writes fails (one write ends 0.2 s later)
    and its event loop is closed; the late write's callback into the closed loop, which Python reports through
    ``sys.unraisablehook`` as a bare "Event loop is closed" traceback, is dropped, and any other report kept."""
    import tensorstore as ts

    from oodjax.engine import checkpoints

    def fail_a_write_with_one_in_flight() -> None:
        promise, in_flight = ts.Promise.new()
        later = threading.Timer(0.2, promise.set_result, (None,))

        async def fails() -> None:
            later.start()
            raise OSError(errno.ENOSPC, "No space left on device")

        async def writes() -> None:
            await asyncio.gather(fails(), in_flight)

        loop = asyncio.new_event_loop()
        with pytest.raises(OSError, match="No space left"):
            loop.run_until_complete(writes())
        loop.close()
        later.join()

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    fail_a_write_with_one_in_flight()
    assert [str(report.exc_value) for report in unraisable] == ["Event loop is closed"]  # what is dropped below
    checkpoints.drop_closed_loop_callbacks()
    checkpoints.drop_closed_loop_callbacks()  # installed once
    fail_a_write_with_one_in_flight()
    assert len(unraisable) == 1

    class Unclosable:
        def __del__(self):
            raise RuntimeError("Event loop is closed")  # the same error from Python code: not orbax's report

    Unclosable()
    assert [str(report.exc_value) for report in unraisable] == ["Event loop is closed"] * 2
