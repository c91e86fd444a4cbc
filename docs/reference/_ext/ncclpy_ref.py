"""Sphinx directives that generate parts of the ncclpy reference from the code itself.

* ``.. ncclpy-cli:: module:function [subcommand]`` -- the ``--help`` text of an argparse parser
  built by ``module:function()`` (the CLIs' own parsers, so flags cannot drift from the page).
* ``.. ncclpy-nccl-calls::`` -- which NCCL function(s) each communicator call issues, obtained
  by planning each call with ncclpy's pure planner (:class:`ncclpy.comm.resolver.Resolver`, no GPU)
  for an NCCL that has native Gather/Scatter/AlltoAll (2.28) and one that has not (2.27).
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import os

from docutils import nodes
from docutils.parsers.rst import Directive


class CliHelp(Directive):
    """The help text of an argparse parser, as a literal block."""

    required_arguments = 1
    optional_arguments = 1

    def run(self):
        mod, _, fn = self.arguments[0].partition(":")
        parser = getattr(importlib.import_module(mod), fn)()
        if len(self.arguments) > 1:
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            parser = sub.choices[self.arguments[1]]
        old = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "96"
        try:
            text = parser.format_help()
        finally:
            if old is None:
                os.environ.pop("COLUMNS", None)
            else:
                os.environ["COLUMNS"] = old
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def _plan_rows():
    from ncclpy import Buffer, premul_sum
    from ncclpy.plan.types import PlanContext
    from ncclpy.comm.resolver import Resolver

    ptrs = itertools.count(1)

    def buf(n):
        return Buffer(next(ptrs) << 20, n, "float32", 0)

    world = 4
    cases = [
        ("all_reduce", "all_reduce(x, op='sum')", lambda: (buf(8), None, ("sum",))),
        ("all_reduce", "all_reduce(x, op=premul_sum(s))",
         lambda: (buf(8), None, (premul_sum(0.5),))),
        ("reduce", "reduce(x, root=0)", lambda: (buf(8), None, (0, "sum"))),
        ("broadcast", "broadcast(x, root=0)", lambda: (buf(8), None, (0,))),
        ("all_gather", "all_gather(x, out)", lambda: (buf(8), buf(8 * world), ())),
        ("reduce_scatter", "reduce_scatter(x, out)", lambda: (buf(8 * world), buf(8), ("sum",))),
        ("all_to_all", "all_to_all(x, out)", lambda: (buf(8 * world), buf(8 * world),
                                                      (None, None))),
        ("all_to_all", "all_to_all(x, out, send_counts, recv_counts) (uneven)",
         lambda: (buf(10), buf(10), ([1, 2, 3, 4], [1, 2, 3, 4]))),
        ("gather", "gather(x, out, root=0)", lambda: (buf(8), buf(8 * world), (0,))),
        ("scatter", "scatter(x, out, root=0)", lambda: (buf(8 * world), buf(8), (0,))),
        ("send", "send(x, peer=1)", lambda: (buf(8), None, (1,))),
        ("recv", "recv(x, peer=1)", lambda: (buf(8), None, (1,))),
        ("send_recv", "send_recv(x, y, send_peer=1, recv_peer=3)",
         lambda: (buf(8), buf(8), (1, 3))),
        ("barrier", "barrier()", lambda: (buf(1), None, ())),
    ]
    rows = []
    for name, label, make in cases:
        cells = [label]
        for version in (22800, 22700):
            r = Resolver(PlanContext(0, world, 0, version))
            a, b, params = make()
            plan = r.plan(name, r.parse(name, a, b), params)
            fns = [f"nccl{s.fn}" if hasattr(s, "fn") else "cudaMemcpyAsync"
                   for s in plan.steps if hasattr(s, "fn") or type(s).__name__ == "Copy"]
            text = ", ".join(f"{fn} x{n}" if n > 1 else fn
                             for fn, n in ((k, len(list(g))) for k, g in itertools.groupby(fns)))
            if plan.premul is not None:
                text = "ncclRedOpCreatePreMulSum, " + text + ", ncclRedOpDestroy"
            if plan.group or len(plan.calls) > 1:
                text = f"ncclGroupStart, {text}, ncclGroupEnd"
            cells.append(text)
        rows.append(cells)
    return rows


class NcclCalls(Directive):
    """A table: communicator call -> NCCL calls on NCCL >= 2.28 and on 2.27 (world size 4)."""

    def run(self):
        header = ["call (world size 4)", "NCCL >= 2.28", "NCCL < 2.28"]
        rows = _plan_rows()
        table = nodes.table()
        group = nodes.tgroup(cols=3)
        table += group
        for w in (30, 35, 35):
            group += nodes.colspec(colwidth=w)
        thead = nodes.thead()
        group += thead
        tbody = nodes.tbody()
        group += tbody
        for target, cells in ((thead, header), *((tbody, r) for r in rows)):
            row = nodes.row()
            for c in cells:
                entry = nodes.entry()
                entry += nodes.paragraph("", "", nodes.literal(c, c))
                row += entry
            target += row
        return [table]


def setup(app):
    app.add_directive("ncclpy-cli", CliHelp)
    app.add_directive("ncclpy-nccl-calls", NcclCalls)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
