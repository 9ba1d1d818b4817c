"""`fbmt.Schedule`: the decisions on a program as data, to save, compare and replay.

    sched = model.program.schedule()            # or fbmt.Schedule.of(program)
    print(sched)                                # one line per collective, one per block
    sched.to_json("run.json")                   # written whole (temporary file, fsync, rename)
    print(fbmt.Schedule.load("a.json").diff(sched))
    model = fbmt.compile(model, schedule=fbmt.Schedule.load("run.json"))   # the identical program

NOTE: [Schedules]
What the passes decide, as opposed to what the model computes, is (a) what each block saves for
the backward or recomputes, and (b) where each collective's nodes stand: where it is issued, where
its result is waited for and where a gathered buffer is released. A `Schedule` holds both: per
block the recompute policy the remat pass applied (the one it chose, e.g. "mincut" for a trailing
block that saves, NOTE: [Trailing blocks]) and what the backward reads of it; per collective its
group, block, phase, bytes, its three points, its stream and its bucket. A point is stored as the
node's position in the program (what replay uses) and as the compute node it stands right before
(what people read: `before %addmm_4 (h.1 fwd)`).

Replaying compiles with each block's recorded policy, then puts every collective node back at its
recorded position, the compute between them in the order the passes left it. Node names are made
by tracing, so they are the same for the same model, inputs and options before the schedule;
replay checks that every recorded node exists and that the compute order is the recorded one, and
says which node differs when the program is not the one the schedule was taken from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from fbmt import files
from fbmt.compiler import meta, ops
from fbmt.compiler.collectives import collectives, is_collective
from fbmt.compiler.meta import BWD, FWD
from fbmt.compiler.ops.graph import size

if TYPE_CHECKING:  # only for annotations: the program imports this module to make its schedule
    from fbmt.compiler.program import Program

VERSION = 1


@dataclass(frozen=True)
class Point:
    """Where a node stands: its position in the program, and the compute node right after it."""

    position: int
    before: str  # the next compute node's name, or "the end"
    block: str | None  # that node's block ("" the root; None outside every block, or a backward node not recomputed)
    phase: str

    def __str__(self) -> str:
        if self.before == "the end":
            return "at the end"
        where = f"{self.block or '<root>'} " if self.block is not None else ""
        return f"before %{self.before} ({where}{self.phase})"


@dataclass(frozen=True)
class CollectiveRecord:
    kind: str  # "all_gather", "reduce_scatter", "all_to_all_reduce"
    group: int
    block: str
    phase: str
    bytes: int  # the whole buffer, as it travels
    start: str  # node names: the start and its wait (the release's is not needed to replay)
    wait: str
    issue: Point
    waited: Point
    release: Point | None  # a gathered buffer's end (None for a reduction)
    stream: str = "comm"
    bucket: int | None = None  # collectives fused into one share a bucket; None: its own

    @property
    def name(self) -> str:
        return f"{self.phase} {self.kind} of group {self.group} ({self.block or '<root>'})"


@dataclass(frozen=True)
class BlockRecord:
    block: str
    remat: str  # the policy applied to it: "none", "block", "selective" or "mincut"
    saved: tuple[str, ...]  # its forward values the backward reads
    saved_bytes: int
    recomputed: int  # how many of its forward nodes the backward runs again


@dataclass(frozen=True)
class Schedule:
    """The decisions on a program (NOTE: [Schedules]): per block what it saves or recomputes, per
    collective where it is issued, waited and released."""

    strategy: str  # the schedule pass's summary
    world_size: int
    blocks: tuple[BlockRecord, ...]
    collectives: tuple[CollectiveRecord, ...]  # in program order of their starts
    compute: str  # a digest of the compute nodes' order, for replay to check
    nodes: int  # how many nodes the program has
    training: bool = True  # taken from a forward+backward program (the others replay as "prefetch")

    # ---- making one ---------------------------------------------------------------------
    @classmethod
    def of(cls, program: Program) -> Schedule:
        """The decisions the passes made on `program`."""
        order = ops.node_order(program.graph)
        nodes = list(program.graph.nodes)
        records = []
        for c in sorted(collectives(program), key=lambda c: order[c.start]):
            records.append(
                CollectiveRecord(
                    kind=c.kind,
                    group=c.group,
                    block=c.block,
                    phase=c.phase,
                    bytes=c.bytes,
                    start=c.start.name,
                    wait=c.wait.name,
                    issue=_point(nodes, order[c.start]),
                    waited=_point(nodes, order[c.wait]),
                    release=_point(nodes, order[c.release]) if c.release is not None else None,
                    bucket=c.bucket,
                )
            )
        summary = next((r.summary for r in reversed(program.history) if r.name == "schedule"), "")
        return cls(
            strategy=summary,
            world_size=program.layout.world_size,
            blocks=tuple(_blocks(program)),
            collectives=tuple(records),
            compute=compute_digest(program.graph),
            nodes=len(nodes),
            training=program.needs_grad,
        )

    # ---- reading one --------------------------------------------------------------------
    @property
    def remat(self) -> dict[str, str]:
        """Each block's recompute policy, as `fbmt.compile(blocks={path: {"remat": ...}})` takes it."""
        return {b.block: b.remat for b in self.blocks}

    def __str__(self) -> str:
        lines = [f"# fbmt Schedule: {self.world_size} rank(s), {len(self.collectives)} collectives; {self.strategy}"]
        for b in self.blocks:
            lines.append(
                f"block {b.block or '<root>':<12} remat={b.remat:<9} saves {len(b.saved)} values "
                f"({size(b.saved_bytes)}), recomputes {b.recomputed}"
            )
        for c in self.collectives:
            release = f"; released {c.release}" if c.release is not None else ""
            bucket = f" in bucket {c.bucket}" if c.bucket is not None else ""
            lines.append(f"{c.name}, {size(c.bytes)}: issued {c.issue}{bucket}; waited {c.waited}{release}")
        return "\n".join(lines)

    __repr__ = __str__

    def diff(self, other: Schedule) -> str:
        """What changes from this schedule to `other`, one line per decision ("" when none does)."""
        lines = []
        if self.world_size != other.world_size:
            lines.append(f"world size: {self.world_size} -> {other.world_size}")
        mine, theirs = self.remat, other.remat
        for block in dict.fromkeys([*mine, *theirs]):
            a, b = mine.get(block, "-"), theirs.get(block, "-")
            if a != b:
                lines.append(f"block {block or '<root>'}: remat {a} -> {b}")
        by_key = {(c.phase, c.kind, c.group): c for c in other.collectives}
        seen = set()
        for c in self.collectives:
            key = (c.phase, c.kind, c.group)
            seen.add(key)
            d = by_key.get(key)
            if d is None:
                lines.append(f"{c.name}: only in the first")
                continue
            for what in ("issue", "waited", "release", "bucket", "stream"):
                x, y = getattr(c, what), getattr(d, what)
                if _describe(x) != _describe(y):
                    verb = {"issue": "issued", "release": "released"}.get(what, what)
                    lines.append(f"{c.name}: {verb} {_describe(x)} -> {_describe(y)}")
        lines += [f"{c.name}: only in the second" for c in other.collectives if (c.phase, c.kind, c.group) not in seen]
        return "\n".join(lines)

    # ---- files --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The schedule as plain data (what `to_json` writes), marked with its format's version."""
        return {"fbmt_schedule": VERSION, **dataclasses.asdict(self)}

    def to_json(self, path: str | None = None) -> str:
        """The schedule as JSON text; with `path`, also written there whole (`fbmt.files.write_json_atomic`)."""
        if path is not None:
            files.write_json_atomic(self.to_dict(), path)
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Schedule:
        """A schedule from what `to_dict` made; anything else is an error that says so."""
        if not isinstance(d, dict) or d.get("fbmt_schedule") != VERSION:
            found = d.get("fbmt_schedule") if isinstance(d, dict) else type(d).__name__
            raise ValueError(
                f"not an fbmt schedule of version {VERSION} (found {found!r}); save one with Schedule.to_json"
            )

        def point(p: dict | None) -> Point | None:
            return Point(**p) if p is not None else None

        return cls(
            strategy=d["strategy"],
            world_size=d["world_size"],
            blocks=tuple(BlockRecord(**{**b, "saved": tuple(b["saved"])}) for b in d["blocks"]),
            collectives=tuple(
                CollectiveRecord(
                    **{
                        **c,
                        "issue": point(c["issue"]),
                        "waited": point(c["waited"]),
                        "release": point(c["release"]),
                    }
                )
                for c in d["collectives"]
            ),
            compute=d["compute"],
            nodes=d["nodes"],
            training=d.get("training", True),
        )

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """A schedule from the text `to_json` returned."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str) -> Schedule:
        """A schedule written by `to_json(path)`."""
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path!r} is not JSON ({e}); is it a schedule saved with Schedule.to_json?") from None
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{path!r}: {e}") from None


# ---- helpers ----------------------------------------------------------------------------


def _point(nodes: list[fx.Node], position: int) -> Point:
    """The point at `position`: the next compute node, and the block of the first node after it that
    carries one (a gathered buffer's views carry none; the block's first op does)."""
    later = [n for n in nodes[position + 1 :] if n.op != "output" and not is_collective(n.target)]
    if not later:
        return Point(position, "the end", None, BWD)
    phase = meta.phase(later[0]) or FWD
    tagged = (meta.block(n) for n in later if meta.phase(n) == phase)
    block = meta.block(later[0]) if phase == BWD else next((b for b in tagged if b is not None), None)
    return Point(position, later[0].name, block, phase)


def _describe(x: Any) -> str:
    return "none" if x is None else str(x)


def compute_digest(g: fx.Graph) -> str:
    names = [n.name for n in g.nodes if not is_collective(n.target)]
    return hashlib.sha1("|".join(names).encode()).hexdigest()[:16]


def _blocks(program: Program) -> list[BlockRecord]:
    saved: dict[str | None, list[fx.Node]] = {}
    recomputed: dict[str | None, int] = {}
    for n in program.graph.nodes:
        block = meta.block(n)
        if meta.phase(n) == FWD and n.op == "call_function":
            if any(meta.phase(u) == BWD for u in n.users) and not is_collective(n.target):
                saved.setdefault(block, []).append(n)
        elif meta.recompute(n):
            recomputed[block] = recomputed.get(block, 0) + 1
    out = []
    for block in program.layout.blocks:
        values = saved.get(block, [])
        bases = {ops.view_base(v) for v in values}
        out.append(
            BlockRecord(
                block=block,
                remat=program.remat.get(block, "none"),
                saved=tuple(v.name for v in values),
                saved_bytes=sum(ops.nbytes(b.meta.get("val")) for b in bases if b.op != "placeholder"),
                recomputed=recomputed.get(block, 0),
            )
        )
    return out
