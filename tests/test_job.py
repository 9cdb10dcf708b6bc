"""The config read once (oodjax.config_read): what it derives, that nothing past it takes a ConfigDict, and that no
module of oodjax imports itself back (the job reads settings, not the run loop)."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from configs import demo
from oodjax import usage_errors
from oodjax.config_read import read
from oodjax.data import load_testset
from oodjax.engine import cadence, run_data
from oodjax.usage_errors import ConfigError
from tests.engine_configs import checkpoint_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_library_imports_no_config_package():
    """`configs` is the application's: the library's entry points import without it."""
    code = "import sys, oodjax.main, oodjax.evaluate, oodjax.config_checks; sys.exit('configs' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr or "oodjax imported the configs package"


def test_the_engine_models_and_data_never_read_a_config_dict():
    """Only the command line, the checks and the resolution (oodjax/*.py) touch ml_collections."""
    readers = []
    for package in ("engine", "models", "data"):
        for path in sorted((ROOT / "oodjax" / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [getattr(node, "module", None) or ""] + [alias.name for alias in node.names]
                    if any(name.startswith(("ml_collections", "configs")) for name in names):
                        readers.append(path.relative_to(ROOT).as_posix())
    assert readers == []


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    """Each module of ``package`` (dotted name) and the modules of it that it imports, read with ``ast``: every
    import statement, in functions and under TYPE_CHECKING too; ``from a import b`` names the module a.b where
    there is one (a package's submodule, imported without running into its ``__init__``'s imports), else a."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                module = (
                    ".".join(base[: len(base) - node.level + 1] + [node.module or ""]) if node.level else node.module
                )
                module = module.strip(".")
                graph[name] |= {
                    f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module for alias in node.names
                }
        graph[name] &= modules.keys() - {name}
    return graph


def import_circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports in ``graph`` (its modules in order, the first repeated at the end), else []."""
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return []
        path.append(module)
        for imported in sorted(graph[module]):
            if circle := visit(imported):
                return circle
        done.add(path.pop())
        return []

    return next((circle for module in sorted(graph) if (circle := visit(module))), [])


def test_no_module_of_oodjax_imports_itself_back():
    """Settings live apart from what runs them (``cadence.Cadence`` beside the run loop, not in it), so the
    job, the launch tools and the evaluation read them without importing the loop, and nothing goes round."""
    assert import_circle(import_graph(ROOT / "oodjax")) == []
    assert import_circle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_read_derives_names_tokenizer_and_nones_once():
    config = demo.get_config()
    assert read(config).model.name == "opt-tiny-random"  # model.name, when given
    config.model.name = ""
    job = read(config)
    assert job.model.name == "opt-random" and job.runs.model == job.model.name
    assert job.model.path is None and job.model.source == "opt-random"
    assert job.model.tokenizer == config.tokenizer
    assert job.data.data_dir == config.data.data_dir and job.data.pool_split is None and job.data.cache_dir is None
    assert job.export.hub_repo is None and job.model.compute_dtype is None
    assert job.trackers.wandb is None
    config.model.hf_config, config.model.path, config.tokenizer = {}, "/ckpt/OPT-2.7b/", ""
    config.wandb.enabled = True
    job = read(config)
    assert job.model.name == "OPT-2.7b" and job.model.tokenizer == "/ckpt/OPT-2.7b/"
    assert job.model.source == "/ckpt/OPT-2.7b/"
    assert job.trackers.wandb.group == "OPT-2.7b_mnli" and job.trackers.wandb.entity is None
    assert [run.name for run in job.runs.runs()] == ["OPT-2.7b_mnli_seed0_shots32", "OPT-2.7b_mnli_seed42_shots32"]
    assert job.record["model"]["path"] == "/ckpt/OPT-2.7b/"  # what results store: the config as given


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("mesh.fsdp", -1, r"mesh sizes \(data, fsdp, tensor\) = \(-1, -1, 1\): each must be >= 1, at most one -1"),
        ("runs.shots", (8, 0), r"runs.shots must be positive, got \[8, 0\]"),
        ("eval.every", -1, r"eval.every must be >= 0 \(0: eval.points\), got -1"),
        ("eval.points", -1, r"eval.points must be >= 0 \(0: eval.every\), got -1"),
        ("train.steps", 0, "train.steps must be >= 1, got 0"),
        ("train.warmup_steps", 600, r"train.warmup_steps must be in \[0, train.steps=500\], got 600"),
        ("train.warmup_ratio", 1.5, r"train.warmup_ratio must be in \[0, 1\] \(0: no warm-up\), got 1.5"),
        ("train.epochs", -1.0, r"train.epochs must be >= 0 \(0: train.steps\), got -1.0"),
        ("model.attention", "flash", r"model.attention must be one of \('auto', 'xla', .*\), got 'flash'"),
    ],
)
def test_each_piece_checks_its_own_fields(field, value, message):
    config = checkpoint_config()
    section, _, key = field.rpartition(".")
    config[section][key] = value
    with pytest.raises(ConfigError, match=message):
        read(config)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model.hf_config": {"model_type": "opt"}}, r"set exactly one of model.path .* and model.hf_config"),
        ({"model.path": "", "model.hf_config": {"vocab_size": 8}}, r"model.hf_config needs a model_type"),
        ({"model.path": "", "model.hf_config": {"model_type": "opt"}}, r"tokenizer is empty: a random model"),
        ({"model.remat": "everything"}, r"model.remat: remat policy 'everything' is not one of"),
        ({"export.every_checkpoint": True}, r"export.every_checkpoint and export.hub_repo need export.peft=True"),
        ({"export.peft": True, "export.hub_repo": "a b"}, r"export.hub_repo 'a b' is not a hub repo id"),
        ({"data.testsets": ("hans",)}, r"data.train_set 'mnli' must also be in data.testsets"),
        ({"eval.in_context": True, "model.adapters": ("a",)}, r"eval.in_context=True .* model.adapters must be empty"),
        ({"train.learning_rate": 0.0}, r"train.learning_rate must be positive, got 0.0"),
        ({"wandb.enabled": True, "wandb.mode": "cloud"}, r"wandb.mode must be empty .* got 'cloud'"),
        ({"train.grad_accum": 3}, r"train.batch_size 16 must be a multiple of train.grad_accum 3"),
        ({"eval.batch_size": 0}, r"eval.batch_size must be >= 1, got 0"),
        ({"data.buckets": (0, 64)}, r"data.buckets must be positive lengths, got \[0, 64\]"),
        ({"eval.row_lengths": (-1,)}, r"eval.row_lengths must be positive lengths, got \[-1\]"),
    ],
)
def test_read_refuses_every_value_the_full_checks_refuse(capsys, changes, message):
    """A rule on values lives in its piece (or the Job, across pieces), so the estimate, the preflight, the fetch
    and the sweep, which only read, refuse what the run refuses: one line naming the field, exit status 2."""
    config = checkpoint_config()
    for field, value in changes.items():
        section, _, key = field.rpartition(".")
        (config[section] if section else config)[key] = value
    with pytest.raises(SystemExit) as raised, usage_errors.reported("prog"):
        read(config)
    err = capsys.readouterr().err
    assert raised.value.code == usage_errors.EXIT_STATUS and err.count("\n") == 1, err
    assert re.match(rf"prog: error: {message}", err), err


def test_the_cadence_is_the_loop_s_and_the_estimator_s():
    rules = cadence.Cadence(total_steps=60, eval_every=25, checkpoint_every=40, log_every=10)
    assert rules.evaluated_steps() == [0, 25, 50, 60]
    assert [step for step in range(1, 61) if rules.checkpoint_due(step)] == [40, 60]


def test_eval_points_spread_over_the_run_s_own_steps():
    """Step 0 and floor(k x 10 / 4), k = 1..4; every step when there are as many points as steps."""
    assert cadence.Cadence(total_steps=10, eval_points=4).evaluated_steps() == [0, 2, 5, 7, 10]
    assert cadence.Cadence(total_steps=3, eval_points=3).evaluated_steps() == [0, 1, 2, 3]
    assert cadence.Cadence(total_steps=3, eval_points=20).evaluated_steps() == [0, 1, 2, 3]  # a run of fewer steps
    assert cadence.Cadence(total_steps=7, eval_every=5).evaluated_steps() == [0, 5, 7]  # eval.points 0: eval.every
    assert cadence.Cadence(total_steps=0, eval_points=20).evaluated_steps() == [0]  # oodjax.evaluate's runs


def lengths(job):
    """Each shot count's run length, read from the job's run groups."""
    return {run.shots: group.total_steps for group in job.groups for run in group.runs}


def group_of(job, shots):
    """The run group of the runs of ``shots``."""
    (group,) = {group for group in job.groups for run in group.runs if run.shots == shots}
    return group


def test_epochs_give_each_run_its_own_length_schedule_and_evaluations():
    config = checkpoint_config()
    config.train.batch_size, config.train.epochs, config.train.warmup_ratio, config.eval.points = 32, 40, 0.1, 20
    job = read(config)
    assert [lengths(job)[shots] for shots in (32, 64, 128)] == [40, 80, 160]
    run_job = group_of(job, 64)
    assert run_job.optimizer.total_steps == run_job.cadence.total_steps == run_job.total_steps == 80
    assert run_job.optimizer.warmup_steps == 8  # ceil(0.1 x 80)
    assert run_job.cadence.evaluated_steps() == list(range(0, 81, 4))
    config.train.epochs, config.train.batch_size, config.runs.shots, config.eval.points = 0.1, 3, (30, 31), 1
    assert [lengths(read(config))[shots] for shots in (30, 31)] == [1, 2]  # 0.1 as written: 0.1 x 30 / 3 = 1
    config.train.epochs, config.train.warmup_ratio, config.eval.every = 0, 0, 25
    assert lengths(read(config)) == {30: 500, 31: 500}  # train.steps, as before epochs
    config.train.epochs, config.train.batch_size, config.runs.shots = 1, 32, (32, 64)
    config.train.warmup_steps, config.eval.every, config.eval.points = 50, 0, 1
    with pytest.raises(ConfigError, match=r"got 50 \(runs of 32 shots train ceil\(train.epochs x shots / "):
        read(config)  # warm-up of 50 steps in a run of 1


def test_by_default_warm_up_and_evaluations_follow_each_run_s_length():
    """The defaults, train.warmup_ratio 0.1 and eval.points 20: 50 warm-up steps and an evaluation every 25 steps
    of train.steps=500; with train.epochs=40 at batch 16, runs of 80, 160 and 320 steps warm up over ceil(T / 10)
    of them and are evaluated at step 0 and floor(k T / 20), k = 1..20."""
    config = checkpoint_config()
    (job,) = read(config).groups
    assert job.optimizer.warmup_steps == 50 and job.cadence.evaluated_steps() == list(range(0, 501, 25))
    config.train.epochs = 40
    job = read(config)
    for shots, steps in ((32, 80), (64, 160), (128, 320)):
        run_job = group_of(job, shots)
        assert run_job.optimizer.total_steps == steps
        assert run_job.optimizer.warmup_steps == -(-steps // 10)
        assert run_job.cadence.evaluated_steps() == [k * steps // 20 for k in range(21)]


def test_run_groups_are_the_plan_each_built_for_its_length():
    """train.epochs=40 at batch 16: the runs of 32, 64 and 128 shots (two seeds each, listed out of order) form
    three groups of 40 x shots / 16 = 80, 160 and 320 steps, shortest first; each group's optimizer and cadence
    are built for its length: warm-up ceil(T / 10) (train.warmup_ratio 0.1), evaluations at floor(k T / 20),
    k = 0..20 (eval.points 20), the learning rate at its peak when warm-up ends and 0 at step T."""
    config = checkpoint_config()
    config.runs.seeds, config.runs.shots, config.train.epochs = (0, 1), (128, 32, 64), 40
    job = read(config)
    assert [(group.total_steps, [(run.seed, run.shots) for run in group.runs]) for group in job.groups] == [
        (80, [(0, 32), (1, 32)]),
        (160, [(0, 64), (1, 64)]),
        (320, [(0, 128), (1, 128)]),
    ]
    for group in job.groups:
        steps = group.total_steps
        assert group.optimizer.total_steps == group.cadence.total_steps == steps
        assert group.optimizer.warmup_steps == steps // 10  # 8, 16, 32: ceil of a whole number
        assert group.cadence.evaluated_steps() == [k * steps // 20 for k in range(21)]
        schedule = group.optimizer.learning_rate_schedule
        assert float(schedule(steps // 10)) == pytest.approx(config.train.learning_rate)
        assert float(schedule(steps)) == 0.0


def test_a_fixed_warm_up_or_evaluation_interval_wins_over_the_ratio_and_the_points():
    config = checkpoint_config()
    config.train.warmup_steps, config.eval.every = 30, 100
    (job,) = read(config).groups  # no train.epochs: fixed values of any share are the user's to choose
    assert job.optimizer.warmup_steps == 30 and job.cadence.evaluated_steps() == list(range(0, 501, 100))
    config.train.epochs, config.train.warmup_steps, config.eval.every = 40, 0, 8
    run_job = group_of(read(config), 32)
    assert run_job.optimizer.warmup_steps == 8 and run_job.cadence.evaluated_steps() == list(range(0, 81, 8))
    config.train.warmup_ratio, config.eval.every, config.eval.points = 0, 0, 20
    assert group_of(read(config), 32).optimizer.warmup_steps == 0  # both 0: no warm-up
    config.eval.points = 0
    with pytest.raises(ConfigError, match=r"eval.points and eval.every are both 0: set eval.points"):
        read(config)


@pytest.mark.parametrize(
    "field, fits, too_much, message",
    [
        # a quarter of the 80 steps of 32 shots at batch 16: 20 fits, 21 does not; the 50 is 62%
        ("train.warmup_steps", 20, 21, r"train.warmup_steps=21 would take 26% of a run of 80 steps, more than 25%"),
        ("train.warmup_steps", 20, 50, r"train.warmup_steps=50 would take 62% of a run of 80 steps, more than 25%"),
        # 80 steps every 9: 0, 9, ..., 72 and 80, ten evaluations; every 10: 0, 10, ..., 80, nine
        ("eval.every", 9, 10, r"eval.every=10 would leave a run of 80 steps 9 evaluations, step 0's among them, "),
        ("eval.every", 9, 25, r"eval.every=25 would leave a run of 80 steps 5 evaluations, step 0's among them, "),
    ],
)
def test_with_epochs_a_fixed_warm_up_or_interval_that_does_not_fit_a_run_is_refused(field, fits, too_much, message):
    """With train.epochs=40 at batch 16 the runs of 32 shots train 80 steps: a fixed warm-up of more than a quarter
    of them, or an interval leaving fewer than 10 evaluations, names the field, the run and the way out."""
    config = checkpoint_config()
    config.train.epochs = 40
    section, _, key = field.rpartition(".")
    config[section][key] = fits
    read(config)
    config[section][key] = too_much
    with pytest.raises(ConfigError, match=message + r".*\(runs of 32 shots train .* = 80 steps\)$"):
        read(config)
    config.train.epochs = 0  # train.steps=500: the user's fixed choice, not checked
    read(config)


def test_eval_cap_leaves_the_in_domain_testset_whole_unless_cap_in_domain(hf_data_dir):
    """The partial correlations control for in-domain accuracy: a subset of it biases them (docs/analysis.md)."""
    config = checkpoint_config()
    config.data.data_dir, config.data.testsets, config.data.eval_cap = str(hf_data_dir), ("mnli", "hans"), 16
    whole = len(load_testset("mnli", data_dir=str(hf_data_dir)))  # validation_matched, neutral dropped
    assert whole > 6000
    sizes = {name: len(testset) for name, testset in run_data.capped_testsets(read(config).data).items()}
    assert sizes == {"mnli": whole, "hans": 16}
    config.data.cap_in_domain = True
    sizes = {name: len(testset) for name, testset in run_data.capped_testsets(read(config).data).items()}
    assert sizes == {"mnli": 16, "hans": 16}
    config.data.train_set, config.data.testsets = "snli", ("mnli", "hans", "snli")  # then mnli is OOD, capped
    config.data.cap_in_domain = False
    sizes = {name: len(testset) for name, testset in run_data.capped_testsets(read(config).data).items()}
    assert sizes == {"mnli": 16, "hans": 16, "snli": len(load_testset("snli", data_dir=str(hf_data_dir)))}
