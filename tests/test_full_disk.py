"""A full disk, for real: results and checkpoints written to a 4 MiB tmpfs until it fills.

The file system is mounted in a user and mount namespace (`unshare -rm`, no root needed where the kernel
allows unprivileged user namespaces, as it does here and on common CI runners); without `unshare` this
file fails rather than skips. A write that finds the disk full must raise one NoSpaceError naming the path
being written, and leave the previous metrics.npz and the earlier checkpoints as they were; the
interrupted checkpoint is never listed, and its leftovers go once the next job starts saving.
"""

import json
import pathlib
import shutil
import subprocess
import sys

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
