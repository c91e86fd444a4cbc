"""The bench's ``--plot``: bus bandwidth (and latency) against size, readable with many series.

One colour per series (a backend: the same colour for it in every panel and every run; with
``--algo``/``--proto`` a backend and combination, ``ncclpy ring/simple``: one line per
combination, coloured in the order they ran), solid out of place, dashed in place.  A run of
one case (one type, op and root) gets two panels, bus bandwidth and time per call; a run of
several (``-d all -o all``, ``-r all``) gets one bus bandwidth panel per case on shared axes,
each titled by its case, so that no panel holds more than series x 2 lines.  The legend, a
handful of entries (backends, placements), sits outside every panel, at the figure's right.
``-N`` cycles: the mean of a size's rows.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .rows import Row

__all__ = ["BACKEND_COLOURS", "plot_figure", "write_plot", "cases"]

#: a fixed colour per backend, so a backend reads the same in every plot
BACKEND_COLOURS = {"ncclpy": "tab:blue", "cupy": "tab:orange", "torch": "tab:green"}
#: the other series' colours in turn: tab10's other seven, then tab20's light shades
_SPARE = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray",
          "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2",
          "#dbdb8d", "#9edae5")
_PLACEMENTS = (("oop", "-", "out of place"), ("ip", "--", "in place"))
Case = Tuple[str, str, int]


def cases(rows_by_backend: Dict[str, List["Row"]]) -> List[Case]:
    """The (type, op, root) cases of a run, in the order they ran."""
    out: List[Case] = []
    for rows in rows_by_backend.values():
        for r in rows:
            if (r.type, r.redop, r.root) not in out:
                out.append((r.type, r.redop, r.root))
    return out


def _colour(backends: Sequence[str], name: str) -> str:
    if name in BACKEND_COLOURS:
        return BACKEND_COLOURS[name]
    others = [b for b in backends if b not in BACKEND_COLOURS]
    return _SPARE[others.index(name) % len(_SPARE)]


def _series(rows: Sequence["Row"], case: Case, attr: str, what: str
            ) -> Tuple[List[int], List[float]]:
    """Sizes (> 0) and the mean of ``what`` (busbw, time_us) of ``attr`` (oop, ip) per size;
    values <= 0 (nothing measured) are NaN, left out of the log axes."""
    by_size: Dict[int, List[float]] = {}
    for r in rows:
        if (r.type, r.redop, r.root) == case and r.size > 0:
            by_size.setdefault(r.size, []).append(getattr(getattr(r, attr), what))
    xs = sorted(by_size)
    ys = [sum(by_size[x]) / len(by_size[x]) for x in xs]
    return xs, [y if y > 0 else float("nan") for y in ys]


def _grid(all_cases: List[Case]) -> List[List[Optional[Case]]]:
    """Panels in rows and columns: a row per type and a column per (op, root) when the types
    ran mostly the same ones (``-d all -o all``, a few skipped), else the cases in order, about
    as many columns as rows (at most 6); None: an empty cell (a case skipped or none)."""
    types = list(dict.fromkeys(c[0] for c in all_cases))
    rest = list(dict.fromkeys(c[1:] for c in all_cases))
    if len(types) * len(rest) <= 2 * len(all_cases) and len(rest) <= 8:
        have = set(all_cases)
        return [[(t, *r) if (t, *r) in have else None for r in rest] for t in types]
    ncols = min(6, math.ceil(math.sqrt(len(all_cases))))
    cells: List[Optional[Case]] = list(all_cases)
    cells += [None] * (-len(cells) % ncols)
    return [cells[i:i + ncols] for i in range(0, len(cells), ncols)]


def _case_title(case: Case, show_op: bool, show_root: bool) -> str:
    parts = [case[0]]
    if show_op:
        parts.append(case[1])
    if show_root:
        parts.append(f"root {case[2]}")
    return " ".join(parts)


def plot_figure(rows_by_backend: Dict[str, List["Row"]], *, title: str) -> "Figure":
    """The figure ``--plot`` writes (see the module docstring); no pyplot state is touched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    backends = list(rows_by_backend)
    all_cases = cases(rows_by_backend)
    show_op = len({c[1] for c in all_cases}) > 1 or any(c[1] != "none" for c in all_cases)
    show_root = len({c[2] for c in all_cases}) > 1
    single = len(all_cases) <= 1
    if single:
        fig = Figure(figsize=(13, 4.8))
        axes = fig.subplots(1, 2)
        panels = [(axes[0], all_cases[0] if all_cases else None, "busbw"),
                  (axes[1], all_cases[0] if all_cases else None, "time_us")]
    else:
        order = _grid(all_cases)
        nrows, ncols = len(order), len(order[0])
        fig = Figure(figsize=(3.2 * ncols + 2.2, 2.6 * nrows + 1.0))
        grid = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)
        panels = []
        for row_axes, row_cases in zip(grid, order):
            for ax, case in zip(row_axes, row_cases):
                if case is None:
                    ax.set_visible(False)
                else:
                    panels.append((ax, case, "busbw"))
    FigureCanvasAgg(fig)
    drawn = set()                  # the quantities with a value > 0 somewhere (log axes)
    for ax, case, what in panels:
        if case is not None:
            for name in backends:
                for attr, style, _ in _PLACEMENTS:
                    xs, ys = _series(rows_by_backend[name], case, attr, what)
                    if xs:
                        ax.plot(xs, ys, style, marker="o", markersize=3,
                                color=_colour(backends, name), gid=f"{name}/{attr}")
                        if any(y == y for y in ys):
                            drawn.add(what)
    for ax, case, what in panels:
        if what in drawn:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
        else:                      # e.g. bus bandwidth of one rank: 0 everywhere
            ax.text(0.5, 0.5, "nothing > 0 to plot", ha="center", va="center",
                    transform=ax.transAxes, color="0.4")
            ax.set_xticks([])
            ax.set_yticks([])
        ax.grid(True, which="both" if single else "major", alpha=0.3)
        if len(panels) == 2 and len(all_cases) <= 1:
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel("bus bandwidth (GB/s)" if what == "busbw" else "time per call (µs)")
            if case is not None and (show_op or show_root or case[0]):
                ax.set_title(_case_title(case, show_op, show_root), fontsize=10)
        else:
            ax.set_title(_case_title(case, show_op, show_root), fontsize=9)
            ax.tick_params(labelsize=7)
    if len(all_cases) > 1:
        w, h = fig.get_size_inches()
        fig.supxlabel("size (bytes)", y=0.08 / h, va="bottom")
        fig.supylabel("bus bandwidth (GB/s)", x=0.08 / w, ha="left")
    handles = [Line2D([], [], color=_colour(backends, b), lw=2, label=b) for b in backends]
    handles += [Line2D([], [], color="0.3", ls=style, label=label)
                for _, style, label in _PLACEMENTS]
    _margins(fig, single)
    right = fig.subplotpars.right
    fig.legend(handles=handles, loc="upper left", fontsize=8, frameon=False,
               bbox_to_anchor=(right + 0.01, fig.subplotpars.top))
    fig.suptitle(title, y=1 - 0.12 / fig.get_size_inches()[1], va="top")
    return fig


def _margins(fig: "Figure", single: bool) -> None:
    """Fixed margins in inches (a computed layout takes a minute for 60 panels): the title
    above, the axis labels left and below, the legend's column on the right."""
    w, h = fig.get_size_inches()
    left, bottom = (0.9 if single else 0.85) / w, (0.6 if single else 0.8) / h
    fig.subplots_adjust(left=left, right=1 - 1.7 / w, bottom=bottom, top=1 - 0.75 / h,
                        wspace=0.25 if single else 0.08, hspace=0.25 if single else 0.3)


def write_plot(path: str, rows_by_backend: Dict[str, List["Row"]], *, title: str) -> None:
    """Write :func:`plot_figure` to ``path`` (the format from its extension)."""
    plot_figure(rows_by_backend, title=title).savefig(path, dpi=110)
