"""`python -m analysis RESULTS_DIR --out OUT_DIR`: tables, figures and a CSV from a results root."""

import argparse
import pathlib
import sys

import pandas as pd

from analysis import figures, tables
from analysis.aggregate import all_run_pairs, combine_runs, summarise_by_model
from analysis.naming import slug
from analysis.padjust import PADJUST_METHODS
from analysis.residualise import RESIDUALISERS
from analysis.runs import ResultsError, Run, find_runs
from analysis.stats import METHODS

CSV_NAME = "partial_correlations.csv"
# One row per pair, for every run (level "run") and every model and training
# set combining its runs (level "group"); columns not used at a level are empty.
CSV_COLUMNS = (
    "level", "model", "train_set", "seed", "shots", "run", "x", "y", "n", "n_runs",
    "r", "ci_low", "ci_high", "p", "p_adj", "dof", "n_positive", "n_negative", "reason",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m analysis",
        description=(
            "Partial correlations of OOD accuracies given in-domain accuracy, per run across "
            "its evaluation steps, combined over runs per model and training set."
        ),
    )
    parser.add_argument("results_dir", type=pathlib.Path,
                        help="results root: <run>/metrics.npz files, searched recursively")
    parser.add_argument("--out", type=pathlib.Path, required=True, metavar="OUT_DIR",
                        help="where tables/, figures/ and the CSV are written")
    parser.add_argument("--residualiser", choices=RESIDUALISERS, default="linear",
                        help="fit of each accuracy on in-domain accuracy whose residuals are "
                        "correlated: least squares, or a smoothing spline chosen by GCV "
                        "(default: %(default)s)")
    parser.add_argument("--method", choices=METHODS, default="pearson",
                        help="spearman ranks every accuracy first (default: %(default)s)")
    parser.add_argument("--padjust", choices=PADJUST_METHODS, default="holm",
                        help="multiple-comparison adjustment across the pairs of a run or a "
                        "model and training set (default: %(default)s)")
    parser.add_argument(
        "--probit", action="store_true", help="probit-transform accuracies before residualising"
    )
    parser.add_argument(
        "--differences",
        action="store_true",
        help="correlate first differences between successive evaluation steps",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        runs = find_runs(args.results_dir)
    except ResultsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    written = write_analysis(runs, args)
    print(f"analysed {len(runs)} runs under {args.results_dir}; wrote {len(written)} files:")
    for path in written:
        print(f"  {path}")
    return 0


def write_analysis(runs: list[Run], args: argparse.Namespace) -> list[pathlib.Path]:
    """Compute everything, write it under args.out, and return the paths written."""
    options = {
        "method": args.method,
        "residualiser": args.residualiser,
        "padjust": args.padjust,
        "probit": args.probit,
        "differences": args.differences,
    }
    per_run = all_run_pairs(runs, **options)
    per_group = combine_runs(per_run, padjust=args.padjust)
    table_dir, figure_dir = args.out / "tables", args.out / "figures"
    table_dir.mkdir(parents=True, exist_ok=True)
    figure_dir.mkdir(parents=True, exist_ok=True)

    written = [_write_csv(per_run, per_group, args.out / CSV_NAME)]
    description = _describe(options)
    padjust = tables.latex_escape(args.padjust)
    table_files = []
    for (model, train_set), group_runs in _groups(runs).items():
        name = slug(model, train_set)
        pairs = per_group[(per_group["model"] == model) & (per_group["train_set"] == train_set)]
        testsets = list(dict.fromkeys(t for run in group_runs for t in run.ood_testsets))
        caption = (
            f"Partial correlations of OOD accuracies given {tables.latex_escape(train_set)} "
            f"accuracy, {tables.latex_escape(model)} trained on {tables.latex_escape(train_set)}: "
            f"mean over {len(group_runs)} runs on the Fisher $z$ scale; {description}. "
            f"{tables.SIGNIFICANCE_NOTE} ({padjust}), t test across runs."
        )
        table_files.append(table_dir / f"matrix_{name}.tex")
        table_files[-1].write_text(
            tables.matrix_table(pairs, testsets, caption=caption, label=f"tab:pcorr-{name}")
        )
        title = f"{model}, trained on {train_set} ({len(group_runs)} runs)"
        written += _write_figures(group_runs, pairs, testsets, figure_dir, name, title, args)

    table_files.append(table_dir / "summary.tex")
    table_files[-1].write_text(
        tables.summary_table(
            summarise_by_model(per_group),
            caption=(
                "Mean partial correlation over OOD testset pairs (Fisher $z$ scale) by model "
                f"family, size and training set; {description}. Sig.\\ $+/-$: pairs with "
                f"positive / negative $r$ and adjusted $p<0.05$ ({padjust})."
            ),
            label="tab:pcorr-summary",
        )
    )
    document = table_dir / "tables.tex"
    document.write_text(tables.standalone_document([p.name for p in table_files]))
    return written + table_files + [document]


def _write_csv(per_run: pd.DataFrame, per_group: pd.DataFrame, path: pathlib.Path) -> pathlib.Path:
    tidy = pd.concat(
        [per_run.assign(level="run"), per_group.assign(level="group")], ignore_index=True
    )
    counts = ["seed", "shots", "n", "n_runs", "n_positive", "n_negative"]
    tidy = tidy.astype({column: "Int64" for column in counts})[list(CSV_COLUMNS)]
    tidy.to_csv(path, index=False)
    return path


def _write_figures(
    group_runs: list[Run],
    pairs: pd.DataFrame,
    testsets: list[str],
    directory: pathlib.Path,
    name: str,
    title: str,
    args: argparse.Namespace,
) -> list[pathlib.Path]:
    heatmap = figures.correlation_heatmap(pairs, testsets, title=title)
    curves = figures.accuracy_curves(group_runs, title=title)
    scatter = figures.ood_vs_in_domain(
        group_runs, residualiser=args.residualiser, probit=args.probit, title=title
    )
    return [
        *figures.save(heatmap, directory / f"heatmap_{name}"),
        *figures.save(curves, directory / f"curves_{name}"),
        *figures.save(scatter, directory / f"ood_vs_in_domain_{name}"),
    ]


def _groups(runs: list[Run]) -> dict[tuple[str, str], list[Run]]:
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.model, run.train_set), []).append(run)
    return groups


def _describe(options: dict) -> str:
    parts = [f"{options['method']} correlation", f"{options['residualiser']} residualiser"]
    if options["probit"]:
        parts.append("probit-transformed accuracies")
    if options["differences"]:
        parts.append("first differences between steps")
    return ", ".join(parts)
