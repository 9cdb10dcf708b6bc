"""A run's checkpoints: a really damaged one is named and the next older one used; files follow the umask."""

import logging
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oodjax.engine import checkpoints

TARGET = {"a": jax.ShapeDtypeStruct((256,), jnp.float32)}


def _save(run_dir, steps):
    """Checkpoints at `steps`, each holding the step number in its arrays and its loop state."""
    checkpointer = checkpoints.RunCheckpointer(run_dir, name="run")
    for step in steps:
        checkpointer.save(step, {"a": jnp.full(256, float(step))}, {"step": step, "loss_sum": 0.5 * step})
    checkpointer.close()


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_truncated_checkpoint_is_named_and_the_next_older_one_restored(tmp_path, caplog):
    previous = os.umask(0o022)
    try:
        _save(tmp_path, [1, 2])
    finally:
        os.umask(previous)
    directory = checkpoints.checkpoint_dir(tmp_path)
    for path in directory.rglob("*"):  # group-readable under the usual umask
        assert stat.S_IMODE(path.stat().st_mode) == (0o755 if path.is_dir() else 0o644), path
    assert checkpoints.checkpoint_steps(tmp_path) == [2, 1]

    _truncate(directory / "2" / "loop" / "metadata")  # the JSON record, cut in half
    with caplog.at_level(logging.WARNING):
        restored = checkpoints.restore_newest(tmp_path, TARGET)
    assert restored.step == 1 and restored.damaged == (2,) and restored.loop_state == {"step": 1, "loss_sum": 0.5}
    np.testing.assert_array_equal(restored.state["a"], np.full(256, 1.0))
    assert f"checkpoint {directory / '2'} fails to restore" in caplog.text and "JSONDecodeError" in caplog.text
    assert f"{tmp_path}: resuming from the checkpoint at step 1" in caplog.text

    aside = checkpoints.set_aside(tmp_path, 2)
    assert aside.name.startswith("2.damaged-") and checkpoints.checkpoint_steps(tmp_path) == [1]
    for path in (directory / "1" / "runs").rglob("*"):  # now the arrays of the only one left
        if path.is_file():
            _truncate(path)
    with pytest.raises(
        checkpoints.CheckpointsUnusableError,
        match=rf"every checkpoint of {tmp_path} fails to "
        rf"restore: {directory / '1'} \(.*\)\. Move {directory} away",
    ):
        checkpoints.restore_newest(tmp_path, TARGET)


def test_a_run_without_checkpoints_reads_as_none_and_nothing_is_created(tmp_path):
    assert checkpoints.checkpoint_steps(tmp_path / "run") == []
    assert checkpoints.restore_newest(tmp_path / "run", TARGET) is None
    assert not (tmp_path / "run").exists()
