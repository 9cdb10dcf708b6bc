"""The one-line warning of config time about runs evaluated too few times for their partial correlations."""

from configs import base
from oodjax.config_checks import few_evaluations_warning
from oodjax.config_read import MIN_FIXED_EVALUATIONS, read


def config(**fields):
    """The base config of a hub checkpoint with `fields` ("train.steps": 500, ...) set."""
    chosen = base.get_config()
    chosen.model.path = "facebook/opt-125m"
    for name, value in fields.items():
        section, key = name.split(".")
        chosen[section][key] = value
    return chosen


def test_runs_evaluated_fewer_than_ten_times_are_named_in_one_line():
    """train.epochs makes 32-shot runs 4 steps long (2 x 32 / 16): every step evaluated, 5 evaluations, named
    with their shots; eval.points 6 gives 7 evaluations (step 0 and 6) to every run; a 4-step run 5."""
    epochs = few_evaluations_warning(read(config(**{"train.epochs": 2.0, "eval.points": 20})))
    assert "\n" not in epochs and "4 steps (32 shots): 5 evaluations" in epochs
    assert "128 shots" not in epochs  # 16 steps: 17 evaluations
    points = few_evaluations_warning(read(config(**{"eval.points": 6})))
    assert "500 steps (32/64/128 shots): 7 evaluations" in points
    tiny = few_evaluations_warning(read(config(**{"train.steps": 4, "eval.points": 20})))
    assert "4 steps (32/64/128 shots): 5 evaluations" in tiny and str(MIN_FIXED_EVALUATIONS) in tiny


def test_the_studys_cadence_passes_without_a_word():
    assert few_evaluations_warning(read(config(**{"eval.points": 20}))) == ""
    assert few_evaluations_warning(read(config())) == ""
