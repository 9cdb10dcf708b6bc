"""`python -m analysis RESULTS_DIR --out OUT_DIR`: tables, figures and CSVs from a results root
(what each holds: analysis/outputs.py).

Trained runs that stopped before their last step (`schema.finished`, as
`python -m analysis.runs` says) are named, one warning each, and left out
unless --include-unfinished; runs `oodjax.evaluate` wrote (one evaluation
each, no correlation across steps) go into the accuracies only. Flat runs
(`RunRecord.flat`: in-domain accuracy that barely moves) are analysed but
named, one warning each, and counted, as are runs with a near-constant OOD
series and runs whose r was capped at |r| = MAX_ABS_R. The output closes with
the assumptions the results rest on (`assumptions`), as tables/tables.tex
opens, and the findings that do not survive the correction for in-domain
accuracy's measurement error.

Everything is written into a fresh directory first and moved into OUT_DIR
only once the whole analysis has succeeded, so a failing analysis leaves
OUT_DIR exactly as it was: no half-written set of tables and figures that
looks like a result.
"""

import argparse
import contextlib
import os
import pathlib
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Iterator

from analysis import schema
from analysis.aggregate import MAX_ABS_R
from analysis.meta import REML, TAU2_ESTIMATORS
from analysis.outputs import FIGURE_DIR, TABLE_DIR, Selection, assumptions, select_runs, write_analysis
from analysis.padjust import PADJUST_METHODS
from analysis.residualise import RESIDUALISERS, SPLINE
from analysis.runs import ResultsError, flat_warning, near_constant_warning, no_readable_runs_message, scan_runs
from analysis.stats import METHODS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m analysis",
        description=(
            "Partial correlations of OOD accuracies given in-domain accuracy, per run across "
            "its evaluation steps, combined over runs per model and training set."
        ),
    )
    parser.add_argument(
        "results_dir", type=pathlib.Path, help="results root: <run>/metrics.npz files, searched recursively"
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        required=True,
        metavar="OUT_DIR",
        help="where tables/, figures/ and the CSV are written",
    )
    parser.add_argument(
        "--residualiser",
        choices=RESIDUALISERS,
        default=SPLINE,
        help="fit of each accuracy on in-domain accuracy whose residuals are "
        "correlated: least squares, or a smoothing spline chosen by GCV; the "
        "other is computed too, and results that change under it are marked "
        "(default: %(default)s, see docs/analysis.md)",
    )
    parser.add_argument(
        "--tau2-estimator",
        choices=TAU2_ESTIMATORS,
        default=REML,
        help="between-model variance of the meta-analysis across models: "
        "restricted maximum likelihood, Paule-Mandel or DerSimonian-Laird "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="pearson",
        help="spearman ranks every accuracy first (default: %(default)s)",
    )
    parser.add_argument(
        "--padjust",
        choices=PADJUST_METHODS,
        default="holm",
        help="multiple-comparison adjustment across the pairs of a run or a "
        "model and training set (default: %(default)s)",
    )
    parser.add_argument("--probit", action="store_true", help="probit-transform accuracies before residualising")
    parser.add_argument(
        "--curves-ylim",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="the y-range of every accuracy-curve panel, so that figures of "
        "different models compare at a glance (default: one range that fits "
        "every panel of the figure)",
    )
    parser.add_argument(
        "--include-unfinished",
        action="store_true",
        help="analyse trained runs that stopped before their last step too (by default each is "
        "named in a warning and left out)",
    )
    parser.add_argument(
        "--differences",
        action="store_true",
        help="correlate first differences between successive evaluation steps",
    )
    return parser.parse_args(argv)


class OutputError(ValueError):
    """An --out path the analysis cannot write into; says which path and why."""


def main(argv: list[str] | None = None) -> int:
    """`python -m analysis` (also the `oodjax-analyse` command); returns the exit code."""
    args = parse_args(argv)
    try:
        check_out_dir(args.out)
        runs, skipped = scan_runs(args.results_dir)
        for skip in skipped:
            print(f"warning: {skip.message}", file=sys.stderr)
        if not runs:
            raise ResultsError(no_readable_runs_message(args.results_dir, skipped))
        selection = select_runs(runs, include_unfinished=args.include_unfinished)
        fate = "analysed (--include-unfinished)" if args.include_unfinished else "left out (--include-unfinished)"
        for run in selection.unfinished:
            print(f"warning: {run.path}: unfinished, {run.progress}; {fate}", file=sys.stderr)
        flat = [run for run in selection.analysed if run.flat]
        for run in flat:
            print(flat_warning(run), file=sys.stderr)
        near_constant = [run for run in selection.analysed if run.near_constant]
        for run in near_constant:
            print(near_constant_warning(run), file=sys.stderr)
        if not selection.analysed:
            raise ResultsError(_nothing_to_analyse(args.results_dir, selection))
        with staged_output(args.out) as staging:
            found = write_analysis(selection, args, staging)
            written = [args.out / path.relative_to(staging) for path in found.paths]
    except (ResultsError, OutputError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    notes = [f"{len(skipped)} {schema.METRICS_FILENAME} skipped" if skipped else ""]
    if selection.unfinished and not args.include_unfinished:
        notes.append(f"{len(selection.unfinished)} unfinished left out")
    if selection.evaluated:
        notes.append(f"{len(selection.evaluated)} evaluation-only in the accuracies only")
    if flat:
        notes.append(f"{len(flat)} flat (in-domain accuracy barely moves)")
    if near_constant:
        notes.append(f"{len(near_constant)} with a near-constant OOD series")
    for line in found.capped:
        print(line, file=sys.stderr)
    if found.capped:
        notes.append(f"{len(found.capped)} with an r capped at |r| = {MAX_ABS_R}")
    said = ", ".join(filter(None, notes))
    if not found.testable:
        print(
            "warning: nothing can be tested across runs: no pair of any model and training set has two runs "
            "with different r; tables and figures show r without significance",
            file=sys.stderr,
        )
    warned = skipped or selection.unfinished or flat or near_constant or found.capped or not found.testable
    see = ", see the warnings" if warned else ""
    left_out = f" ({said}{see})" if said else ""
    print(f"analysed {len(selection.analysed)} runs under {args.results_dir}{left_out}; wrote {len(written)} files:")
    for path in written:
        print(f"  {path}")
    print(textwrap.fill("Assumptions: " + assumptions(selection.analysed), width=100))
    if found.not_surviving:
        print("Findings that do not survive the correction for in-domain accuracy's measurement error:")
        for line in found.not_surviving:
            print(textwrap.fill(line, width=100, initial_indent="  ", subsequent_indent="    "))
    else:
        print("Every heterogeneity and pooled finding survives the correction for in-domain accuracy's noise.")
    return 0


def _nothing_to_analyse(root: pathlib.Path, selection: Selection) -> str:
    """The error when no trained run is left to correlate."""
    found = [f"{len(selection.unfinished)} unfinished (--include-unfinished analyses them)"] * bool(
        selection.unfinished
    )
    found += [f"{len(selection.evaluated)} evaluation-only (one evaluation each)"] * bool(selection.evaluated)
    return f"no finished trained run under {root} to correlate across steps: {', '.join(found)}"


def check_out_dir(out: pathlib.Path) -> None:
    """Fail before any work when `out`, or the place of its tables or figures, is a file."""
    existing = _nearest_existing(out)
    if not existing.is_dir():
        where = f"--out {out}" if existing == out else f"--out {out}: {existing}"
        raise OutputError(f"{where} is a file, not a directory")
    for name in (TABLE_DIR, FIGURE_DIR):
        if (out / name).exists() and not (out / name).is_dir():
            raise OutputError(f"--out {out}: {out / name} is a file, where the {name} go")


@contextlib.contextmanager
def staged_output(out: pathlib.Path) -> Iterator[pathlib.Path]:
    """A new empty directory to write into, on the file system of `out`: when the block
    succeeds its files move into `out` (created if need be; other files there stay), and
    whatever happens it is removed, so a failure leaves `out` as it was."""
    existing = _nearest_existing(out)
    try:
        container = pathlib.Path(tempfile.mkdtemp(prefix=".analysis-", suffix=".partial", dir=existing))
    except OSError as error:
        raise OutputError(f"--out {out}: cannot write under {existing} ({error})") from error
    # mkdtemp's directory is private (0700); the one inside it gets the umask's permissions,
    # as `out` would have had if written directly.
    staging = container / "out"
    try:
        try:
            staging.mkdir()
            yield staging
        except OSError as error:
            raise OutputError(f"writing the analysis failed ({error}); {out} is left as it was") from error
        _publish(staging, out)
    finally:
        shutil.rmtree(container, ignore_errors=True)


def _publish(staging: pathlib.Path, out: pathlib.Path) -> None:
    """Move the staged files into `out`: one rename when `out` is new, else file by file,
    each replacing the file of its name; a directory in the way is an error before any move."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
        return
    moves = [(path, out / path.relative_to(staging)) for path in sorted(staging.rglob("*")) if path.is_file()]
    blocked = [str(target) for _, target in moves if target.is_dir()]
    if blocked:
        raise OutputError(f"--out {out}: directories stand where files go: {blocked}")
    for source, target in moves:
        target.parent.mkdir(exist_ok=True)
        os.replace(source, target)


def _nearest_existing(path: pathlib.Path) -> pathlib.Path:
    """`path` or its closest ancestor that exists (a relative path ends at ".")."""
    return next(candidate for candidate in (path, *path.parents) if candidate.exists())
