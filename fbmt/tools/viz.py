"""`fbmt.viz`: pictures of a program and of its simulated (and measured) step, for notebooks and files.

    sim = fbmt.simulate(program)
    fbmt.viz.timeline(sim, fbmt.profile(model, *inputs))   # Gantt: compute and communication, exposed waits
    fbmt.viz.memory(sim)                                   # the memory curve, its peak and what is alive there
    fbmt.viz.collectives(sim)                              # one row per collective (a table)
    fbmt.viz.graph(program)                                # the blocks, their data flow and their collectives

Each returns an object Jupyter shows (a matplotlib Figure, or an object with an HTML/SVG form) and
takes `path=` to save it (the extension picks the format). matplotlib draws the plots; Graphviz's
`dot` (through pydot) lays out the graph. They are imported only when a picture is asked for.
"""

from __future__ import annotations

import csv
import html
import io
import os
from dataclasses import dataclass
from typing import Any

from fbmt import flags
from fbmt.compiler import FWD, Program, meta
from fbmt.tools.sim import Simulation, size

_PHASE_COLOR = {"fwd": "#4C72B0", "bwd": "#55A868", "": "#8C8C8C"}
_KIND_COLOR = {"all_gather": "#DD8452", "reduce_scatter": "#8172B3", "all_to_all_reduce": "#937860"}
_OTHER_KINDS = ("#64B5CD", "#DA8BC3", "#8C8C8C", "#CCB974")  # kinds of the collectives' table added later
_EXPOSED = "#C44E52"


def _kind_color(kind: str) -> str:
    """A collective kind's colour: its own for the built-in kinds, one of a few more for the others."""
    return _KIND_COLOR.get(kind) or _OTHER_KINDS[sum(map(ord, kind)) % len(_OTHER_KINDS)]


def _plt() -> Any:
    import matplotlib

    if not flags.is_set(flags.MPLBACKEND) and "ipykernel" not in __import__("sys").modules:
        matplotlib.use("Agg")  # headless outside Jupyter
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | None) -> Any:
    if path is not None:
        fig.savefig(path, bbox_inches="tight", dpi=120)
    _plt().close(fig)  # pyplot forgets it: Jupyter shows the returned figure once, and memory is not held
    return fig


def timeline(sim: Simulation, profile: Any = None, *, path: str | None = None, title: str | None = None) -> Any:
    """The step as a Gantt chart: the simulated compute stream (one bar per node, by phase), the
    communication stream (one bar per collective, by kind) and each exposed wait (red, on the
    compute stream); with a `fbmt.profile` result, the measured compute and waits beneath."""
    plt = _plt()
    rows = ["predicted compute", "predicted communication"] + (["measured compute"] if profile is not None else [])
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.7 * len(rows)))
    ms = 1e3
    y = {name: len(rows) - 1 - i for i, name in enumerate(rows)}
    for phase in ("fwd", "bwd"):
        bars = [(s * ms, (e - s) * ms) for _, stream, p, s, e in sim.timeline if stream == "compute" and p == phase]
        ax.broken_barh(
            bars, (y["predicted compute"] - 0.35, 0.7), color=_PHASE_COLOR[phase], label=f"compute ({phase})"
        )
    for kind in dict.fromkeys(c.kind for c in sim.collectives):  # each kind that ran, in order of its first call
        bars = [(c.began * ms, (c.ended - c.began) * ms) for c in sim.collectives if c.kind == kind]
        if bars:
            color = _kind_color(kind)
            collection = ax.broken_barh(bars, (y["predicted communication"] - 0.35, 0.7), color=color, label=kind)
            collection.set_gid(f"communication:{kind}")
    stalls = [(c.waited * ms, c.exposed * ms) for c in sim.collectives if c.exposed > 0]
    if stalls:
        exposed = ax.broken_barh(stalls, (y["predicted compute"] - 0.35, 0.7), color=_EXPOSED, label="exposed wait")
        exposed.set_gid("exposed")
    if profile is not None:
        for phase in ("fwd", "bwd"):
            bars = [(t.start * ms, t.seconds * ms) for t in profile.nodes if t.kind != "wait" and t.phase == phase]
            ax.broken_barh(bars, (y["measured compute"] - 0.35, 0.7), color=_PHASE_COLOR[phase])
        waits = [(t.start * ms, t.seconds * ms) for t in profile.nodes if t.kind == "wait" and t.seconds > 0]
        if waits:
            ax.broken_barh(waits, (y["measured compute"] - 0.35, 0.7), color=_EXPOSED)
    ax.set_yticks([y[r] for r in rows], rows)
    ax.set_xlabel("ms from the step's start")
    ax.set_title(title or f"{sim.machine.name}, {sim.world_size} rank(s): step {sim.step_s * ms:.2f} ms predicted")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 3 else -0.25), ncol=6, frameon=False)
    return _save(fig, path)


def memory(sim: Simulation, *, path: str | None = None, top: int = 3, title: str | None = None) -> Any:
    """The bytes the step holds over time, stacked by kind (activations, gathered parameters,
    gradient buffers), with its peak and the largest values alive at the peak."""
    plt = _plt()
    curve = sim.memory
    fig, ax = plt.subplots(figsize=(12, 3.5))
    t = [x * 1e3 for x in curve.times]
    mib = 2**20
    ax.stackplot(
        t,
        [a / mib for a in curve.activations],
        [g / mib for g in curve.gathered],
        [r / mib for r in curve.gradients],
        labels=["activations", "gathered parameters", "gradient buffers"],
        colors=["#4C72B0", "#DD8452", "#8172B3"],
        step="post",
    )
    peak = ax.axhline(curve.peak / mib, color=_EXPOSED, linestyle="--", linewidth=1, label=f"peak {size(curve.peak)}")
    peak.set_gid("peak")
    at = curve.nodes.index(curve.peak_node)
    ax.plot([t[at]], [curve.peak / mib], "v", color=_EXPOSED)
    alive = "\n".join(f"%{n} ({kind}, {size(b)})" for n, kind, b in curve.alive_at_peak[:top])
    ax.annotate(
        f"peak at %{curve.peak_node}; the largest alive:\n{alive}",
        (0.99, 0.97),
        xycoords="axes fraction",
        ha="right",
        va="top",
        fontsize=8,
    )
    ax.set_xlabel("ms from the step's start")
    ax.set_ylabel("MiB")
    ax.set_title(title or f"memory of the step beyond its persistent state: peak {size(curve.peak)}")
    ax.legend(loc="upper left", fontsize=8)
    return _save(fig, path)


@dataclass
class Table:
    """Rows with a header; shown as HTML in Jupyter, as text elsewhere; `save` writes .csv or .html."""

    header: list[str]
    rows: list[list[str]]

    def __str__(self) -> str:
        widths = [max(len(str(r[i])) for r in [self.header, *self.rows]) for i in range(len(self.header))]
        return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [self.header, *self.rows])

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def save(self, path: str) -> None:
        """Write the table to `path`: HTML for .html, else CSV."""
        with open(path, "w", newline="") as f:
            if path.endswith(".html"):
                f.write(self._repr_html_())
            else:
                csv.writer(f).writerows([self.header, *self.rows])


def collectives(sim: Simulation) -> Table:
    """One row per collective: what it moves, when it is issued, runs and is waited for, and how long
    its wait stalled compute."""
    rows = [
        [
            c.phase,
            c.kind,
            c.block or "<root>",
            str(c.group),
            size(c.bytes),
            f"{c.issued * 1e3:.3f}",
            f"{c.began * 1e3:.3f}",
            f"{c.ended * 1e3:.3f}",
            f"{c.waited * 1e3:.3f}",
            f"{c.exposed * 1e3:.3f}",
        ]
        for c in sim.collectives
    ]
    header = [
        "phase",
        "kind",
        "block",
        "group",
        "bytes",
        "issued ms",
        "began ms",
        "ended ms",
        "waited ms",
        "exposed ms",
    ]
    return Table(header, rows)


@dataclass
class Picture:
    """A Graphviz drawing: SVG in Jupyter; `save` writes .svg, .png or .dot."""

    dot: Any  # a pydot.Dot

    def _repr_svg_(self) -> str:
        return self.dot.create_svg().decode()

    def save(self, path: str) -> None:
        """Write the drawing to `path` in the format its extension names (svg, png, pdf, dot)."""
        ext = os.path.splitext(path)[1].lstrip(".") or "svg"
        data = self.dot.to_string().encode() if ext == "dot" else self.dot.create(format=ext)
        with open(path, "wb") as f:
            f.write(data)


def graph(program: Program, *, path: str | None = None) -> Picture:
    """The program at the level of blocks: each block with its forward node count, its recompute
    policy and the bytes it gathers; an edge where a block's forward reads another's values; each
    collective of the forward and of the backward beside the block it serves."""
    try:
        import pydot
    except ImportError as e:
        raise ImportError(
            "fbmt.viz.graph draws with pydot and Graphviz: pip install pydot; apt install graphviz"
        ) from e
    from fbmt.compiler.collectives import collectives as records

    dot = pydot.Dot("program", graph_type="digraph", rankdir="LR", fontname="Helvetica", fontsize="10")
    counts: dict[str, int] = {}
    for n in program.graph.nodes:
        if meta.phase(n) == FWD and meta.block(n) is not None:
            counts[meta.block(n)] = counts.get(meta.block(n), 0) + 1
    for block in program.layout.blocks:
        label = f"{block or '<root>'}\\n{counts.get(block, 0)} nodes, remat={program.remat.get(block, 'none')}"
        dot.add_node(pydot.Node(_id(block), label=label, shape="box", style="rounded,filled", fillcolor="#DCE6F2"))
    edges = set()
    for n in program.graph.nodes:
        b = meta.block(n) if meta.phase(n) == FWD else None
        for a in n.all_input_nodes:
            src = meta.block(a) if meta.phase(a) == FWD else None
            if b is not None and src is not None and src != b:
                edges.add((src, b))
    for src, dst in sorted(edges):
        dot.add_edge(pydot.Edge(_id(src), _id(dst)))
    for c in records(program):
        name = f"{c.phase}_{c.kind}_{c.group}"
        color = _kind_color(c.kind)
        dot.add_node(
            pydot.Node(
                name,
                label=f"{c.phase} {c.kind}\\n{size(c.bytes)}",
                shape="note",
                style="filled",
                fillcolor=color,
                fontsize="8",
            )
        )
        dot.add_edge(pydot.Edge(name, _id(c.block), style="dashed", arrowhead="none"))
    picture = Picture(dot)
    if path is not None:
        picture.save(path)
    return picture


def _id(block: str) -> str:
    return '"' + (block or "<root>") + '"'


def figure_png(fig: Any) -> bytes:
    """A figure's PNG bytes (for tests and reports)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
