"""Figures for a paper (matplotlib, Agg): correlation heatmaps, accuracy curves, OOD vs in-domain.

Each figure is written as PDF (vector, fonts embedded as TrueType so
journals accept it) and PNG (for a quick look).
"""

import pathlib

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import scipy.stats  # noqa: E402

from analysis.aggregate import lower_triangle  # noqa: E402
from analysis.residualise import fit  # noqa: E402
from analysis.runs import Run  # noqa: E402
from analysis.stats import probit_transform  # noqa: E402
from analysis.tables import significance_mark  # noqa: E402

PAPER_STYLE = {
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "legend.fontsize": 7,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "pdf.fonttype": 42,
}
PNG_DPI = 150
DIVERGING_MAP = "RdBu_r"
PANEL_COLUMNS = 4


def save(fig: plt.Figure, stem: pathlib.Path) -> list[pathlib.Path]:
    """Write `stem`.pdf and `stem`.png and close the figure."""
    paths = [stem.with_suffix(".pdf"), stem.with_suffix(".png")]
    with plt.rc_context(PAPER_STYLE):
        fig.savefig(paths[0])
        fig.set_layout_engine("none")  # keep the layout just computed: solving it is slow
        fig.savefig(paths[1], dpi=PNG_DPI)
    plt.close(fig)
    return paths


def correlation_heatmap(pairs: pd.DataFrame, testsets: list[str], *, title: str) -> plt.Figure:
    """Lower triangle of combined r (rows testsets[1:], columns testsets[:-1]).

    Diverging map centred at 0 with limits -1 and 1; each cell shows r and its
    significance marks (adjusted p); undefined cells are grey.
    """
    values, p_adj = lower_triangle(pairs, testsets)
    size = len(values)
    with plt.rc_context(PAPER_STYLE):
        side = 0.9 + 0.5 * size
        fig, ax = plt.subplots(figsize=(side + 0.7, side), layout="constrained")
        image = ax.imshow(values, cmap=DIVERGING_MAP, vmin=-1.0, vmax=1.0)
        for i, j in zip(*np.tril_indices(size)):
            if np.isnan(values[i, j]):
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, color="0.85"))
                ax.text(j, i, "n/a", ha="center", va="center", color="0.4", fontsize=6)
                continue
            mark = "" if np.isnan(p_adj[i, j]) else significance_mark(p_adj[i, j])
            ax.text(j, i, f"{values[i, j]:.2f}\n{mark}".strip(), ha="center", va="center",
                    color="white" if abs(values[i, j]) > 0.6 else "black", fontsize=6.5,
                    linespacing=0.9)
        ax.set_xticks(range(size), testsets[:-1], rotation=45, ha="right")
        ax.set_yticks(range(size), testsets[1:])
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title(title)
        colourbar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04,
                                 ticks=[-1, -0.5, 0, 0.5, 1])
        colourbar.set_label("partial correlation $r$")
        colourbar.outline.set_visible(False)
    return fig


def accuracy_curves(runs: list[Run], *, title: str) -> plt.Figure:
    """Accuracy over steps, one panel per testset, one line per shot count.

    Lines are the mean over seeds; bands span the lowest to highest seed.
    """
    testsets = list(dict.fromkeys(t for run in runs for t in run.accuracy.columns))
    shots = sorted({run.shots for run in runs})
    colours = dict(zip(shots, plt.get_cmap("viridis")(np.linspace(0.0, 0.85, len(shots)))))
    with plt.rc_context(PAPER_STYLE):
        fig, axes = _panel_grid(len(testsets))
        for ax, testset in zip(axes, testsets):
            for shot in shots:
                seeds = [
                    r.accuracy[testset] for r in runs if r.shots == shot and testset in r.accuracy
                ]
                if not seeds:
                    continue
                curves = pd.concat(seeds, axis=1)
                steps = curves.index.to_numpy()
                ax.plot(steps, curves.mean(axis=1), color=colours[shot], lw=1.2,
                        label=f"{shot} shots")
                ax.fill_between(steps, curves.min(axis=1), curves.max(axis=1),
                                color=colours[shot], alpha=0.2, lw=0)
            in_domain = any(testset == run.in_domain for run in runs)
            ax.set_title(f"{testset} (in-domain)" if in_domain else testset)
        fig.supxlabel("step")
        fig.supylabel("accuracy")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right upper", frameon=False,
                   title="mean over seeds\nband: min to max")
        fig.suptitle(title)
    return fig


def ood_vs_in_domain(
    runs: list[Run], *, residualiser: str, probit: bool, title: str
) -> plt.Figure:
    """OOD accuracy against in-domain accuracy, one panel per OOD testset.

    Points are evaluation steps, coloured by shot count; each run's
    residualiser fit is drawn over its range (fitted on the probit scale when
    `probit`, mapped back to accuracies). For Pearson correlations of levels
    the residuals are the vertical distances to these curves; with ranks or
    first differences the picture still shows levels.
    """
    testsets = list(dict.fromkeys(t for run in runs for t in run.ood_testsets))
    shots = sorted({run.shots for run in runs})
    colours = dict(zip(shots, plt.get_cmap("viridis")(np.linspace(0.0, 0.85, len(shots)))))
    with plt.rc_context(PAPER_STYLE):
        fig, axes = _panel_grid(len(testsets))
        for ax, testset in zip(axes, testsets):
            for run in runs:
                if testset not in run.accuracy:
                    continue
                points = run.accuracy[[run.in_domain, testset]].dropna().to_numpy()
                colour = colours[run.shots]
                ax.scatter(points[:, 0], points[:, 1], s=6, color=colour, alpha=0.6, lw=0)
                _draw_fit(ax, points, residualiser=residualiser, probit=probit, colour=colour)
            ax.set_title(testset)
        fig.supxlabel(f"{runs[0].in_domain} accuracy (in-domain)")
        fig.supylabel("OOD accuracy")
        handles = [plt.Line2D([], [], color=colours[s], marker="o", ms=3, lw=1) for s in shots]
        fig.legend(handles, [f"{s} shots" for s in shots], loc="outside right upper",
                   frameon=False, title=f"one curve per run:\n{residualiser} fit"
                   + ("\non the probit scale" if probit else ""))
        fig.suptitle(title)
    return fig


def _draw_fit(ax, points: np.ndarray, *, residualiser: str, probit: bool, colour) -> None:
    """Draw the residualiser's curve through one run's points, if it can be fitted."""
    if probit:
        covar = probit_transform(points[:, 0], "in-domain")
        target = probit_transform(points[:, 1], "ood")
    else:
        covar, target = points[:, 0], points[:, 1]
    try:
        fitted = fit(covar, target, residualiser)
    except ValueError:  # too few distinct in-domain values for this residualiser
        return
    grid = np.linspace(covar.min(), covar.max(), 100)
    curve = fitted.predict(grid)
    if probit:
        grid, curve = scipy.stats.norm.cdf(grid), scipy.stats.norm.cdf(curve)
    ax.plot(grid, curve, color=colour, lw=0.8, alpha=0.8)


def _panel_grid(count: int) -> tuple[plt.Figure, list[plt.Axes]]:
    columns = min(PANEL_COLUMNS, count)
    rows = int(np.ceil(count / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(1.75 * columns, 1.6 * rows + 0.6),
                             squeeze=False, layout="constrained")
    axes = axes.ravel().tolist()
    for ax in axes[:count]:
        ax.locator_params(nbins=4)
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]
