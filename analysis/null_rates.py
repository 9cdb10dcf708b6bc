"""How often the run-level test rejects when it should not: `python -m analysis.null_rates`.

Simulated runs shaped like the study's: in-domain accuracy a saturating
learning curve plus AR(1) noise, two OOD accuracies each a tanh of it (a
line for the linear residualiser, which a curve would bias) plus their own
AR(1) noise (independent given in-domain accuracy under the null,
so every partial correlation is truly 0; with `shared` a share of that
noise's variance is common, a real residual correlation). Each replicate is
one run and one test (`partial_corr`, autocorrelation=True, as the
run-level rows use), so the rates are binomial over independent replicates.
Prints a markdown table: per residualiser, evaluations and AR(1)
coefficient, the share of p below 0.05 (a missing p counts as no rejection)
and the share of runs left without p. docs/analysis.md quotes its output.
"""

import argparse
import itertools

import numpy as np

from analysis.residualise import RESIDUALISERS, SPLINE
from analysis.stats import partial_corr

EVALUATIONS = (11, 21, 41)
COEFFICIENTS = (0.0, 0.5, 0.85, 0.95)
# The one non-null case: the study's 21 evaluations, AR(1) 0.85, half the OOD noise shared.
POWER_CASE = (21, 0.85, 0.5)
LEVEL = 0.05


def ar1_noise(rng: np.random.Generator, shape: tuple[int, ...], steps: int, coefficient: float) -> np.ndarray:
    """[*shape, steps] independent stationary AR(1) series of unit variance."""
    noise = np.empty((*shape, steps))
    noise[..., 0] = rng.normal(size=shape)
    innovation = np.sqrt(1.0 - coefficient**2)
    for t in range(1, steps):
        noise[..., t] = coefficient * noise[..., t - 1] + innovation * rng.normal(size=shape)
    return noise


def simulate_runs(
    rng: np.random.Generator, replicates: int, steps: int, coefficient: float, *, curved: bool, shared: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """In-domain accuracy and two OOD accuracies, each [replicates, steps] (see module docstring);
    `curved=False` puts a straight line in place of the tanh."""
    progress = 1.0 - np.exp(-np.linspace(0.0, 1.0, steps) / 0.3)
    in_domain = 0.5 + 0.35 * progress + 0.015 * ar1_noise(rng, (replicates,), steps, coefficient)
    noise = ar1_noise(rng, (replicates, 3), steps, coefficient)
    ood = np.sqrt(1.0 - shared) * noise[:, :2] + np.sqrt(shared) * noise[:, 2:]
    centred = in_domain[:, None] - 0.65
    slopes = np.array([0.05, 0.07])[None, :, None]
    curve = 0.55 + slopes * (np.tanh(8.0 * centred) if curved else 8.0 * centred)
    accuracy = curve + 0.02 * ood
    return in_domain, accuracy[:, 0], accuracy[:, 1]


def rates(
    residualiser: str, steps: int, coefficient: float, *, replicates: int, seed: int, shared: float = 0.0
) -> tuple[float, float]:
    """Share of runs with p < LEVEL, and share without p, over `replicates` simulated runs."""
    in_domain, x, y = simulate_runs(
        np.random.default_rng(seed), replicates, steps, coefficient, curved=residualiser == SPLINE, shared=shared
    )
    p = np.array(
        [
            partial_corr(x[i], y[i], in_domain[i], residualiser=residualiser, autocorrelation=True).p
            for i in range(replicates)
        ]
    )
    return float(np.mean(p < LEVEL)), float(np.mean(np.isnan(p)))


def table(replicates: int, seed: int) -> str:
    lines = [
        "| residualiser | evaluations | AR(1) | p < 0.05 | no p |",
        "|---|---|---|---|---|",
    ]
    cases = [(*case, 0.0) for case in itertools.product(EVALUATIONS, COEFFICIENTS)] + [POWER_CASE]
    for residualiser in RESIDUALISERS:
        for index, (steps, coefficient, shared) in enumerate(cases):
            rejected, untested = rates(
                residualiser, steps, coefficient, replicates=replicates, seed=seed + index, shared=shared
            )
            label = f"{coefficient:g}" + (f", shared {shared:g} (power)" if shared else "")
            lines.append(f"| {residualiser} | {steps} | {label} | {rejected:.1%} | {untested:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m analysis.null_rates", description=__doc__.splitlines()[0])
    parser.add_argument("--replicates", type=int, default=1000, help="simulated runs per case (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first case; case i uses seed + i")
    args = parser.parse_args()
    print(table(args.replicates, args.seed))


if __name__ == "__main__":
    main()
