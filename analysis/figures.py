"""Figures for a paper (matplotlib, Agg): correlation heatmaps, accuracy curves, OOD vs
in-domain, and the models side by side (heatmaps by family and size, mean r against size).

Each figure is written as PDF (vector, fonts embedded as TrueType so
journals accept it) and PNG (for a quick look). Colours are safe for the
common colour-vision deficiencies (Okabe-Ito lines, a red-blue diverging map
for correlations), and every figure carries a note of what it rests on
(correlation method, residualiser, runs and steps), so that it cannot be
read apart from how it was made.
"""

import itertools
import pathlib
import textwrap
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.image  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import scipy.stats  # noqa: E402

from analysis.aggregate import lower_triangle  # noqa: E402
from analysis.naming import ModelInfo  # noqa: E402
from analysis.residualise import fit  # noqa: E402
from analysis.runs import RunRecord  # noqa: E402
from analysis.stats import probit_transform  # noqa: E402
from analysis.tables import significance_mark  # noqa: E402

# Okabe & Ito's palette, safe for the common colour-vision deficiencies, in an
# order whose first colours stay apart in greyscale too; its yellow, faint on
# white, comes last.
OKABE_ITO = (
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442"
)
PAPER_STYLE = {
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "legend.fontsize": 7,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.prop_cycle": matplotlib.cycler(color=OKABE_ITO),
    "pdf.fonttype": 42,
}
PNG_DPI = 150
# Diverging and symmetric about 0, readable with red-green colour blindness.
DIVERGING_MAP = "RdBu_r"
PANEL_COLUMNS = 4
CHANCE = 0.5  # accuracy of guessing on the balanced binary task
_BILLIONS = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}B")


def save(fig: plt.Figure, stem: pathlib.Path) -> list[pathlib.Path]:
    """Write `stem`.pdf and `stem`.png and close the figure.

    The suffixes are appended, never substituted: stems hold model names with
    dots ("heatmap_opt2.7_mnli"), which `with_suffix` would cut.
    """
    paths = [stem.with_name(f"{stem.name}.pdf"), stem.with_name(f"{stem.name}.png")]
    with plt.rc_context(PAPER_STYLE):
        fig.savefig(paths[0])
        fig.set_layout_engine("none")  # keep the layout just computed: solving it is slow
        fig.savefig(paths[1], dpi=PNG_DPI)
    plt.close(fig)
    return paths


def correlation_heatmap(
    pairs: pd.DataFrame, testsets: list[str], *, title: str, note: str
) -> plt.Figure:
    """Lower triangle of combined r (rows testsets[1:], columns testsets[:-1]).

    Diverging map centred at 0 with limits -1 and 1; each cell shows r and its
    significance marks (adjusted p); undefined cells are grey. `note` (what
    the numbers rest on) is printed under the title.
    """
    values, p_adj = lower_triangle(pairs, testsets)
    size = len(values)
    with plt.rc_context(PAPER_STYLE):
        side = 0.9 + 0.5 * size
        fig, ax = plt.subplots(figsize=(side + 0.9, side + 0.3), layout="constrained")
        image = _draw_triangle(ax, values, p_adj, testsets, annotate=True)
        _colourbar(fig, image, ax)
        ax.set_title(_heading(fig, title, note))
    return fig


def comparison_heatmaps(
    groups: Sequence[tuple[str, pd.DataFrame, list[str]]],
    models: Mapping[str, ModelInfo],
    *,
    title: str,
    note: str,
) -> plt.Figure:
    """The models side by side for one training set: one row per family, its sizes in
    increasing order left to right, each panel the model's lower triangle of combined r.

    `groups` holds (model, pairs, testsets) per model, in the order rows
    and columns should follow. Panels carry colours and significance marks
    but no numbers, which would be unreadable at this size; the per-model
    heatmaps have them.
    """
    families = list(dict.fromkeys(models[model].family for model, _, _ in groups))
    rows = [[g for g in groups if models[g[0]].family == family] for family in families]
    columns = max(len(row) for row in rows)
    with plt.rc_context(PAPER_STYLE):
        fig, axes = plt.subplots(
            len(rows), columns, figsize=(1.9 * columns + 0.9, 1.9 * len(rows) + 0.6),
            squeeze=False, layout="constrained",
        )
        image = None
        for row, row_axes in zip(rows, axes):
            for ax in row_axes[len(row):]:
                ax.set_visible(False)
            for ax, (model, pairs, testsets) in zip(row_axes, row):
                values, p_adj = lower_triangle(pairs, testsets)
                image = _draw_triangle(ax, values, p_adj, testsets, annotate=False)
                ax.set_title(f"{models[model].description} ({model})", fontsize=7)
                ax.tick_params(labelsize=5.5)
        fig.suptitle(_heading(fig, title, note))
        _colourbar(fig, image, axes.ravel().tolist())
    return fig


def correlation_by_size(
    summary: pd.DataFrame, per_run: pd.DataFrame, *, title: str, note: str
) -> plt.Figure | None:
    """Mean partial correlation over testset pairs against model size, one line per family,
    one panel per training set; dots are single runs, showing the spread across runs.

    `summary` is `summarise_by_model`'s table, `per_run` is `run_means`'s.
    Models of unknown size cannot be placed and are left out (the figure
    says how many); None when no model has a known size.
    """
    known = summary[summary["size_billions"].notna()]
    if known.empty:
        return None
    train_sets = list(dict.fromkeys(summary["train_set"]))
    colours = dict(zip(dict.fromkeys(known["family"]), itertools.cycle(OKABE_ITO)))
    with plt.rc_context(PAPER_STYLE):
        fig, axes = plt.subplots(1, len(train_sets), figsize=(3.0 * len(train_sets) + 0.6, 2.9),
                                 sharey=True, squeeze=False, layout="constrained")
        for ax, train_set in zip(axes[0], train_sets):
            rows = known[known["train_set"] == train_set]
            for family, lines in rows.groupby("family", sort=False):
                lines = lines.sort_values("size_billions")
                ax.plot(lines["size_billions"], lines["mean_r"], color=colours[family],
                        marker="o", ms=4, lw=1.2, label=family)
                runs = per_run.merge(lines[["model", "train_set", "size_billions"]],
                                     on=["model", "train_set"])
                ax.scatter(runs["size_billions"], runs["mean_r"], color=colours[family],
                           s=8, alpha=0.45, lw=0)
            ax.axhline(0.0, color="0.6", lw=0.6)
            ax.set_xscale("log")
            ax.set_xlim(known["size_billions"].min() / 1.4, known["size_billions"].max() * 1.4)
            # 1-2-3-5 ticks: the study's sizes sit close together on a log axis
            # (2.7B and 3B, 30B and 32B), so ticks at the sizes would overlap.
            ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
            ax.xaxis.set_major_formatter(_BILLIONS)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_title(f"trained on {train_set}")
            ax.set_xlabel("parameters")
        axes[0, 0].set_ylabel("mean partial $r$ over pairs")
        left_out = summary["size_billions"].isna().sum()
        unplaced = f"; {left_out} model(s) of unknown size not shown" if left_out else ""
        fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center",
                   ncols=len(colours) + 1, frameon=False,
                   title="lines: all runs combined; dots: single runs")
        fig.suptitle(_heading(fig, title, note + unplaced))
    return fig


def accuracy_curves(
    runs: list[RunRecord], *, title: str, note: str, ylim: tuple[float, float] | None = None
) -> plt.Figure:
    """Accuracy over steps, one panel per testset, one line per shot count.

    Lines are the mean over seeds; bands span the lowest to highest seed; a
    dashed line marks chance (CHANCE). `ylim` gives every panel the same
    y-range, so that figures of different models compare at a glance; None
    fits each panel to its data. A testset without any accuracy keeps its
    (empty) panel, so that the gap shows.
    """
    testsets = list(dict.fromkeys(t for run in runs for t in run.accuracy.columns))
    colours = _shot_colours(runs)
    with plt.rc_context(PAPER_STYLE):
        fig, axes = _panel_grid(len(testsets))
        for ax, testset in zip(axes, testsets):
            ax.axhline(CHANCE, color="0.5", lw=0.7, ls="--", label="chance")
            for shot, colour in colours.items():
                seeds = [
                    r.accuracy[testset] for r in runs if r.shots == shot and testset in r.accuracy
                ]
                if not seeds:
                    continue
                curves = pd.concat(seeds, axis=1)
                steps = curves.index.to_numpy()
                ax.plot(steps, curves.mean(axis=1), color=colour, lw=1.2, label=f"{shot} shots")
                ax.fill_between(steps, curves.min(axis=1), curves.max(axis=1),
                                color=colour, alpha=0.2, lw=0)
            if ylim is not None:
                ax.set_ylim(ylim)
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=4, integer=True))
            in_domain = any(testset == run.in_domain for run in runs)
            ax.set_title(f"{testset} (in-domain)" if in_domain else testset)
        _label_lowest(axes, "step")
        fig.supylabel("accuracy")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=len(handles),
                   frameon=False, title="mean over seeds; band: min to max")
        fig.suptitle(_heading(fig, title, note))
    return fig


def ood_vs_in_domain(
    runs: list[RunRecord], *, residualiser: str, probit: bool, title: str, note: str
) -> plt.Figure:
    """OOD accuracy against in-domain accuracy, one panel per OOD testset.

    Points are evaluation steps, coloured by shot count; each run's
    residualiser fit is drawn over its range (fitted on the probit scale when
    `probit`, mapped back to accuracies). For Pearson correlations of levels
    the residuals are the vertical distances to these curves; with ranks or
    first differences the picture still shows levels.
    """
    testsets = list(dict.fromkeys(t for run in runs for t in run.ood_testsets))
    colours = _shot_colours(runs)
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
        _label_lowest(axes, f"{runs[0].in_domain} accuracy (in-domain)")
        fig.supylabel("OOD accuracy")
        handles = [plt.Line2D([], [], color=c, marker="o", ms=3, lw=1) for c in colours.values()]
        fig.legend(handles, [f"{s} shots" for s in colours], loc="outside lower center",
                   ncols=len(handles), frameon=False,
                   title=f"one curve per run: {residualiser} fit"
                   + (" on the probit scale" if probit else ""))
        fig.suptitle(_heading(fig, title, note))
    return fig


def _draw_fit(ax, points: np.ndarray, *, residualiser: str, probit: bool, colour) -> None:
    """Draw the residualiser's curve through one run's points, if it can be fitted."""
    if len(points) < 2:  # a testset without accuracies at these steps: nothing to fit
        return
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


def _draw_triangle(
    ax: plt.Axes, values: np.ndarray, p_adj: np.ndarray, testsets: list[str], *, annotate: bool
) -> matplotlib.image.AxesImage:
    """One lower triangle of r on `ax`: undefined cells grey ("n/a" when annotated); with
    `annotate` each cell shows r and its marks, without it only significant cells a mark."""
    size = len(values)
    image = ax.imshow(values, cmap=DIVERGING_MAP, vmin=-1.0, vmax=1.0)
    for i, j in zip(*np.tril_indices(size)):
        if np.isnan(values[i, j]):
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, color="0.85"))
            if annotate:
                ax.text(j, i, "n/a", ha="center", va="center", color="0.4", fontsize=6)
            continue
        mark = "" if np.isnan(p_adj[i, j]) else significance_mark(p_adj[i, j])
        text = f"{values[i, j]:.2f}\n{mark}".strip() if annotate else mark
        ax.text(j, i, text, ha="center", va="center", fontsize=6.5 if annotate else 5,
                color="white" if abs(values[i, j]) > 0.6 else "black", linespacing=0.9)
    ax.set_xticks(range(size), testsets[:-1], rotation=45, ha="right")
    ax.set_yticks(range(size), testsets[1:])
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    return image


def _colourbar(fig: plt.Figure, image: matplotlib.image.AxesImage, ax) -> None:
    colourbar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, ticks=[-1, -0.5, 0, 0.5, 1])
    colourbar.set_label("partial correlation $r$")
    colourbar.outline.set_visible(False)


def _shot_colours(runs: list[RunRecord]) -> dict[int, str]:
    """One Okabe-Ito colour per shot count, the same in every figure of a group."""
    return dict(zip(sorted({run.shots for run in runs}), itertools.cycle(OKABE_ITO)))


def _heading(fig: plt.Figure, title: str, note: str) -> str:
    """Title and note, each wrapped to the figure's width: a note longer than a small
    figure is wide would be cut off at its edges."""
    characters = int(fig.get_figwidth() * 72 / (0.6 * PAPER_STYLE["axes.titlesize"]))
    return "\n".join(textwrap.fill(line, max(characters, 20)) for line in (title, note))


def _label_lowest(axes: list[plt.Axes], label: str) -> None:
    """Label the x-axis of the lowest panel of each column (a figure-wide label would collide
    with a legend below the panels, which constrained layout does not stack)."""
    columns = min(PANEL_COLUMNS, len(axes))
    for ax in axes[-columns:]:
        ax.set_xlabel(label)


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
