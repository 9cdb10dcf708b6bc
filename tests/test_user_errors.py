"""A user's mistake, through the entry points themselves: one line on stderr naming it, exit status 2, no
traceback, and found before the model loads (each case stops in well under the time a load and a compile
take: the model is the demo's, the data `../shared/data`'s). Also that what the checks read still passes
when nothing is wrong."""

import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy
from absl import flags
from flax import nnx

from analysis import schema
from oodjax import config_checks, config_cli
from oodjax.models import from_config
from oodjax.models.lora import LoRAConfig, apply_lora, export_peft
from oodjax.storage import write_npz_atomic
from tests.engine_configs import SHRUNK_DEMO_ARGS, TINY_OPT

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = "opt-tiny-random_mnli_seed0_shots32"  # the demo's run of seed 0 and 32 shots
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}


def entry_point(module, tmp_path, *overrides):
    """`python -m <module>` on the shrunk demo (one run), writing under tmp_path/out, with ``overrides``."""
    command = [sys.executable, "-m", module, *SHRUNK_DEMO_ARGS, "--config.runs.seeds=0"]
    command += [f"--config.output_dir={tmp_path / 'out'}", *overrides]
    return subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT), **OFFLINE},
    )


def assert_one_line(result, program, pattern, *, logged_before=False):
    """Status 2, no traceback, and one error line matching ``pattern``, alone on stderr (``logged_before``: after
    the job's own log of its config, for mistakes found once the runs are locked)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[-1].startswith(f"{program}: error: "), result.stderr[-3000:]
    assert sum("error" in line.lower() for line in lines) == 1, result.stderr[-3000:]
    if not logged_before:
        assert len(lines) == 1, result.stderr[-3000:]
    assert not re.search(r" INFO (compiling|training) ", result.stderr)  # stopped before the model loaded
    assert re.search(pattern, lines[-1]), lines[-1]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A PEFT adapter of rank 8 on the demo's model, as export.peft writes one."""
    model = from_config(TINY_OPT, dtype="float32")
    cfg = LoRAConfig(rank=8, alpha=32.0, dropout=0.0)
    apply_lora(model, cfg, rngs=nnx.Rngs(0))
    folder = tmp_path_factory.mktemp("adapters") / "good"
    return export_peft(nnx.state(model, nnx.LoRAParam), cfg, folder, base_model_name_or_path="opt-tiny-random")


def bad_adapter(kind, good, root):
    """An adapter folder that is wrong in one way (``kind``), under ``root``."""
    folder = root / kind
    if kind == "missing":
        return folder
    folder.mkdir()
    if kind == "empty":
        return folder
    if kind == "run_folder":  # a run's own folder: its adapter is in adapter/
        (folder / schema.METRICS_FILENAME).write_bytes(b"")
        (folder / "adapter").mkdir()
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (folder / "adapter" / name).write_bytes((good / name).read_bytes())
        return folder
    settings = json.loads((good / "adapter_config.json").read_text())
    tensors = safetensors.numpy.load_file(str(good / "adapter_model.safetensors"))
    text, data = json.dumps(settings), (good / "adapter_model.safetensors").read_bytes()
    if kind == "bad_json":
        text = text[: len(text) // 2]
    elif kind == "truncated":
        data = data[: len(data) // 2]
    elif kind == "other_rank":  # the config says 4, the tensors are of rank 8
        text = json.dumps(dict(settings, r=4))
    elif kind == "other_hidden_size":  # an adapter of a model 32 wide, not 64
        narrow = {k: v[:, :32] if ".lora_A." in k else v[:32] for k, v in tensors.items()}
        safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in narrow.items()}, str(folder / "w"))
        data = (folder / "w").read_bytes()
        (folder / "w").unlink()
    (folder / "adapter_config.json").write_text(text)
    (folder / "adapter_model.safetensors").write_bytes(data)
    return folder


ADAPTER_ERRORS = {
    "missing": r"adapter folder \S+/missing does not exist$",
    "empty": r"adapter folder \S+/empty has no adapter_config.json \(not a PEFT adapter\)$",
    "run_folder": r"adapter folder (\S+)/run_folder has no adapter_config.json \(not a PEFT adapter\); \1/run_folder/"
    r"adapter is one$",
    "bad_json": r"bad_json/adapter_config.json: not valid JSON \(Expecting value: line 1 column \d+",
    "truncated": r"truncated/adapter_model.safetensors: not a readable safetensors file",
    "other_rank": r"other_rank: adapter_config.json says r=4, but 16 tensors have another rank \(\S+ has rank 8\)$",
    "other_hidden_size": r"model.adapters: \S+other_hidden_size: model.decoder.layers.self_attn.k_proj.lora.lora_a has "
    r"shape \(2, 32, 8\) in the file, \(2, 64, 8\) in the model",
}


@pytest.mark.parametrize("kind", ADAPTER_ERRORS)
def test_a_bad_adapter_folder_is_one_line_before_the_model_loads(kind, adapter, tmp_path):
    folder = bad_adapter(kind, adapter, tmp_path)
    result = entry_point("oodjax.evaluate", tmp_path, f"--config.model.adapters={folder}")
    assert_one_line(result, "python -m oodjax.evaluate", ADAPTER_ERRORS[kind])


def test_a_good_adapter_passes_the_checks(adapter, tmp_path):
    """The checks above refuse only what is wrong: the adapter they were made from passes them."""
    flag_values = flags.FlagValues()
    config_cli.define_config_flag(flag_values)
    argv = ["evaluate", *SHRUNK_DEMO_ARGS, f"--config.output_dir={tmp_path}", f"--config.model.adapters={adapter}"]
    config_checks.check_config(config_cli.parse_command_line(argv, flag_values), evaluation=True)


def write_checkpoint(folder, *, weights):
    """The demo's model as a checkpoint folder: its config.json, and a model.safetensors cut to ``weights`` of
    its bytes (None: no weights file)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_OPT))
    if weights is not None:
        tensors = {"model.decoder.embed_tokens.weight": np.zeros((64, 64), np.float32)}
        safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"))
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: int(len(data) * weights)])
    return folder


def declared_csv(tmp_path):
    """A declared CSV testset whose label column holds a 2, a value its declaration does not list."""
    (tmp_path / "mine.csv").write_text("p,h,y\na,b,0\nc,d,2\n")
    declaration = {
        "mine": {
            "source": str(tmp_path / "mine.csv"),
            "premise": "p",
            "hypothesis": "h",
            "label": "y",
            "entailment": [0],
            "not_entailment": [1],
        }
    }
    (tmp_path / "sets.json").write_text(json.dumps(declaration))
    return [f"--config.data.extra_testsets_file={tmp_path / 'sets.json'}", "--config.data.testsets=mnli,mine"]


TRAINING_ERRORS = {
    "negative_learning_rate": (
        lambda tmp_path: ["--config.train.learning_rate=-0.001"],
        r"train.learning_rate must be positive, got -0.001$",
    ),
    "unknown_attention": (
        lambda tmp_path: ["--config.model.attention=flash"],
        r"model.attention must be one of \('auto', 'xla', 'cudnn', 'pallas_gpu', 'splash'\), got 'flash'$",
    ),
    "shots_over_the_pool": (
        lambda tmp_path: ["--config.runs.shots=8000"],
        r"runs.shots: few-shot n=8000 needs 4000 examples of label 0 but the pool \(6703 rows\) has only 3463 "
        r"\(data.train_set 'mnli', split 'validation_mismatched'\)$",
    ),
    "fixed_eval_every_with_epochs": (  # 2 epochs of 32 shots at batch 8: 8 steps, evaluated at 0, 2, 4, 6, 8
        lambda tmp_path: ["--config.train.epochs=2"],
        r"eval.every=2 would leave a run of 8 steps 5 evaluations, step 0's among them, fewer than 10: set "
        r"eval.every=0 for eval.points, .* \(runs of 32 shots train .* = 8 steps\)$",
    ),
    "template_without_hypothesis": (
        lambda tmp_path: ["--config.data.template={premise} Yes or No?"],
        r"data.template: prompt template must contain \{premise\} and \{hypothesis\} once each",
    ),
    "undeclared_csv_label": (
        declared_csv,
        r"mine split 'mine.csv': label values \[2\] are not in the label map \[0, 1\] .*first at \S+/mine.csv line 3",
    ),
    "missing_weights": (
        lambda tmp_path: [
            f"--config.model.path={write_checkpoint(tmp_path / 'ckpt', weights=None)}",
            "--config.model.hf_config={}",
        ],
        r"ckpt has no weights: expected model.safetensors.index.json",
    ),
    "truncated_weights": (
        lambda tmp_path: [
            f"--config.model.path={write_checkpoint(tmp_path / 'ckpt', weights=0.5)}",
            "--config.model.hf_config={}",
        ],
        r"'model.decoder.embed_tokens.weight' in \S+/ckpt/model.safetensors ends at byte \d+, but the file has \d+ "
        r"bytes: the file is truncated$",
    ),
}


@pytest.mark.parametrize("case", TRAINING_ERRORS)
def test_a_mistake_in_a_training_config_is_one_line_before_the_model_loads(case, tmp_path):
    overrides, pattern = TRAINING_ERRORS[case]
    result = entry_point("oodjax.main", tmp_path, *overrides(tmp_path))
    assert_one_line(result, "python -m oodjax.main", pattern)


def stored_run(tmp_path, *, metrics):
    """tmp_path/out holding the demo's run of seed 0, finished, its metrics.npz ``metrics`` (bytes), or one
    recording a learning rate of 0.5 (None)."""
    run_dir = tmp_path / "out" / RUN
    run_dir.mkdir(parents=True)
    if metrics is not None:
        (run_dir / schema.METRICS_FILENAME).write_bytes(metrics)
        return
    flag_values = flags.FlagValues()
    config_cli.define_config_flag(flag_values)
    config = config_cli.parse_command_line(["main", *SHRUNK_DEMO_ARGS, "--config.runs.seeds=0"], flag_values)
    record = json.loads(config.to_json())
    record["train"]["learning_rate"] = 0.5
    arrays = {schema.STEP: np.array([0, 2, 4]), schema.CONFIG: np.array(json.dumps(record))}
    write_npz_atomic(run_dir / schema.METRICS_FILENAME, arrays)


def test_resuming_with_another_config_is_one_line(tmp_path):
    stored_run(tmp_path, metrics=None)
    result = entry_point("oodjax.main", tmp_path)
    pattern = (
        rf"{tmp_path}/out holds runs started with another config \(stored -> now: {RUN}: train.learning_rate 0.5 -> "
        r"0.001\); resume with the same config or use a new output_dir$"
    )
    assert_one_line(result, "python -m oodjax.main", pattern, logged_before=True)


def test_resuming_from_an_unreadable_metrics_npz_is_one_line(tmp_path):
    stored_run(tmp_path, metrics=b"PK\x03\x04 not a whole zip")
    result = entry_point("oodjax.main", tmp_path)
    pattern = rf"{tmp_path}/out/{RUN}/metrics.npz is unreadable \(.*\); {RUN} cannot be resumed or skipped without it"
    assert_one_line(result, "python -m oodjax.main", pattern, logged_before=True)
