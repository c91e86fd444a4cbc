"""``--plot`` stays readable with many series (issue 38, item 10): a colour per backend, a panel
per case (type, op, root), the legend outside every panel and clear of the title."""
from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from bench.output import Row, Side, write_plot  # noqa: E402
from bench.plot import BACKEND_COLOURS, plot_figure  # noqa: E402

TYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
         "bfloat16", "f8e4m3", "f8e5m2"]
OPS = ["sum", "prod", "max", "min", "avg"]


def _rows(backends, types, ops, roots=(-1,), sizes=(8, 1024, 1 << 20), cycles=1):
    out = {b: [] for b in backends}
    for k, b in enumerate(backends):
        for _ in range(cycles):
            for t in types:
                for o in ops:
                    for root in roots:
                        for s in sizes:
                            bw = s / 1e4 * (k + 1)
                            out[b].append(Row(b, s, s // 4, t, t, o, root,
                                              Side(10.0, bw, bw, 0), Side(11.0, bw, bw, 0), 5))
    return out


def _drawn(fig):
    from matplotlib.colors import to_hex
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    axes = [ax for ax in fig.axes if ax.get_visible()]
    lines = {(ax, ln.get_gid()): to_hex(ln.get_color()) for ax in axes for ln in ax.lines}
    return r, axes, lines


def _assert_legend_outside_and_title_clear(fig, renderer, axes):
    assert len(fig.legends) == 1 and not any(ax.get_legend() for ax in axes)
    legend = fig.legends[0].get_window_extent(renderer)
    title = fig._suptitle.get_window_extent(renderer)
    for ax in axes:
        box = ax.get_tightbbox(renderer)             # the panel with its title and labels
        assert not legend.overlaps(box), "the legend covers a panel"
        assert not title.overlaps(box), "the title runs into a panel"
    assert not legend.overlaps(title)
    assert fig.bbox.x0 <= legend.x0 and legend.x1 <= fig.bbox.x1 + 1     # inside the picture


def test_one_case_two_panels_a_colour_per_backend_legend_outside():
    fig = plot_figure(_rows(["ncclpy", "torch"], ["float"], ["sum"]), title="all_reduce_perf")
    renderer, axes, lines = _drawn(fig)
    assert len(axes) == 2                                       # bus bandwidth, time per call
    assert {ax.get_ylabel() for ax in axes} == {"bus bandwidth (GB/s)", "time per call (µs)"}
    for (ax, gid), colour in lines.items():
        assert colour == _hex(BACKEND_COLOURS[gid.split("/")[0]])
    assert len(lines) == 2 * 2 * 2                              # panels x backends x placements
    _assert_legend_outside_and_title_clear(fig, renderer, axes)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["ncclpy", "torch", "out of place", "in place"]


@pytest.mark.slow          # 60 panels drawn: about 10 s of CPU
def test_every_dtype_and_op_gets_its_panel_of_few_lines():
    """``-d all -o all`` with three backends: 60 panels (a row per type, a column per op), each
    holding only backends x placements lines, coloured by backend; the legend has five
    entries and sits outside them all.  Three sizes a line, as elsewhere here, but within a
    decade (1K..4K, not 8..1M): the panels, lines, colours and legend are the same, and the
    log axes' fewer ticks take about a third less time to draw in 60 panels."""
    fig = plot_figure(_rows(["ncclpy", "cupy", "torch"], TYPES, OPS,
                            sizes=(1024, 2048, 4096)), title="all_reduce_perf")
    renderer, axes, lines = _drawn(fig)
    assert len(axes) == 60
    assert [ax.get_title() for ax in axes[:6]] == ["int8 sum", "int8 prod", "int8 max",
                                                   "int8 min", "int8 avg", "uint8 sum"]
    for ax in axes:
        assert len(ax.lines) == 6
    for (ax, gid), colour in lines.items():
        assert colour == _hex(BACKEND_COLOURS[gid.split("/")[0]])
    assert len(fig.legends[0].get_texts()) == 5
    _assert_legend_outside_and_title_clear(fig, renderer, axes)


def test_skipped_cases_leave_an_empty_cell_and_cycles_average():
    rows = _rows(["torch"], ["int8", "float"], ["sum", "avg"], cycles=2)
    rows["torch"] = [r for r in rows["torch"] if (r.type, r.redop) != ("int8", "avg")]
    fig = plot_figure(rows, title="t")
    _, axes, _ = _drawn(fig)
    assert [ax.get_title() for ax in axes] == ["int8 sum", "float sum", "float avg"]
    assert len(fig.axes) == 4                                   # the skipped cell, hidden
    xs = axes[0].lines[0].get_xdata()
    assert list(xs) == [8, 1024, 1 << 20]                       # -N 2: one point per size


def test_roots_are_panels_too():
    fig = plot_figure(_rows(["torch"], ["float"], ["none"], roots=(0, 1)), title="t")
    _, axes, _ = _drawn(fig)
    assert [ax.get_title() for ax in axes] == ["float root 0", "float root 1"]


def test_one_rank_has_no_bandwidth_and_still_plots_its_times():
    """A single rank's all_reduce moves nothing across the bus (busbw 0 everywhere): the panel
    says so instead of failing on a log axis; the times are drawn."""
    rows = _rows(["torch"], ["float"], ["sum"])
    for r in rows["torch"]:
        r.oop.busbw = r.ip.busbw = 0.0
    fig = plot_figure(rows, title="t")
    _, axes, _ = _drawn(fig)
    assert [t.get_text() for t in axes[0].texts] == ["nothing > 0 to plot"]
    assert axes[1].get_yscale() == "log" and len(axes[1].lines) == 2


def test_the_file_is_written(tmp_path):
    path = tmp_path / "all.png"
    write_plot(str(path), _rows(["ncclpy", "torch"], ["float", "half"], ["sum", "max"]),
               title="all_reduce_perf")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    img = matplotlib.image.imread(str(path))
    assert img.shape[0] > 400 and img.shape[1] > 600 and img.std() > 0


def _hex(name):
    from matplotlib.colors import to_hex
    return to_hex(name)
