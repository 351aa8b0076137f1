"""Segmentation: trace a model's step function with torch.fx and cut it into units.

The step is `(input_ids, position_ids, past K/V...) -> (logits, present K/V...)`.

- Candidates, LinguaLinked Eq. (1): in the data-flow graph whose vertices are the values the
  step computes, a value with in-degree 1 (computed by an operation, not a graph input or a
  weight) and out-degree > 1 (read by several operations).
- Cut points: walking the operations in order, a value on the hidden path (descendants of
  input_ids) that is, right after it is computed, the only hidden-path value later
  operations still read: before and after communicate through that one tensor (plus the
  residual tensors below).
- Boundaries: the cut points where the module scope changes (embedding, layer half or
  layer, head). They end the units. In a pre-norm transformer they are the residual stream
  after the embedding and after every block; each of these is an Eq. (1) candidate (it feeds
  both the next block and its skip connection) except, where the final norm is a single
  operation, the value entering the head.

Values that depend on the request's positions but not on its tokens or cache (rotary
cos/sin, the causal mask, ALiBi) are hoisted and computed once in unit 0; every unit that
reads them gets them as a residual dependency. Values that depend on no input at all
(weights, buffers, constants) are copied into each unit that reads them. torch.fx's
`split_module` would turn weight reads into unit inputs, so units are extracted here with
`Graph.node_copy`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from shards.manifest import GRANULARITIES, REQUEST

REQUEST_INPUTS = ("input_ids", "position_ids")
LOGITS = "logits"


class SegmentationError(ValueError):
    """The traced graph cannot be cut into a chain of units."""


@dataclass
class UnitGraph:
    """One unit: a standalone fx graph whose targets are qualified names in the model."""

    index: int
    name: str
    graph: fx.Graph
    inputs: tuple[str, ...]  # request inputs and values of earlier units, in placeholder order
    state: tuple[tuple[str, str], ...]  # (past input, present output), after `inputs`
    outputs: tuple[str, ...]  # values other units (or the request) read, before the presents
    targets: tuple[str, ...]  # modules and tensors of the model the unit reads

    def module(self, model: torch.nn.Module) -> fx.GraphModule:
        """The unit as a module holding references to `model`'s current weights."""
        return fx.GraphModule(model, self.graph, class_name=f"Unit{self.index}")

    @property
    def input_names(self) -> list[str]:
        return [*self.inputs, *(past for past, _ in self.state)]

    @property
    def output_names(self) -> list[str]:
        return [*self.outputs, *(present for _, present in self.state)]

    @property
    def names(self) -> tuple[list[str], list[str]]:
        return self.input_names, self.output_names


@dataclass
class Segmentation:
    units: list[UnitGraph]
    producers: dict[str, int]  # value name -> unit that computes it (REQUEST for inputs)
    consumers: dict[str, tuple[int, ...]]  # value name -> units that read it (REQUEST: sampler)
    candidates: list[str] = field(default_factory=list)  # Eq. (1) candidates, by fx node name
    cut_points: list[str] = field(default_factory=list)  # values that separate the hidden path
    boundaries: list[str] = field(default_factory=list)  # the cut points that end a unit


def trace(model: torch.nn.Module) -> fx.GraphModule:
    """The step function as an fx graph (torch.nn layers such as Linear stay single nodes)."""
    return fx.GraphModule(model, fx.Tracer().trace(model))


def segment(model: torch.nn.Module, granularity: str = "half") -> Segmentation:
    """Cut `model` (built on any device, "meta" included) into a chain of units."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, not {granularity!r}")
    graph = trace(model).graph
    return _Segmenter(graph, granularity).run()


class _Segmenter:
    def __init__(self, graph: fx.Graph, granularity: str) -> None:
        self.graph = graph
        self.granularity = granularity
        nodes = list(graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output = next(n for n in nodes if n.op == "output")
        self.free = _free_nodes(nodes)
        tokens = _descendants(self.placeholders[:1])
        positions = _descendants(self.placeholders[1:2])
        pasts = _descendants(self.placeholders[2:])
        compute = [n for n in nodes if n.op not in ("placeholder", "output") and n not in self.free]
        # positions-only values first (they feed every layer), then the rest in program order
        self.prep = [n for n in compute if n in positions and n not in tokens and n not in pasts]
        prep = set(self.prep)
        self.order = self.prep + [n for n in compute if n not in prep]
        self.hidden_path = tokens

    def run(self) -> Segmentation:
        cuts = self._cut_points()
        boundaries = self._boundaries(cuts)
        unit_of = self._assign(boundaries)
        unit_names = self._unit_names(unit_of, len(boundaries) + 1)
        names = self._value_names(unit_of, boundaries, unit_names)
        units = [
            self._build_unit(index, name, unit_of, names) for index, name in enumerate(unit_names)
        ]
        producers, consumers = self._dependencies(unit_of, names)
        return Segmentation(
            units=units,
            producers=producers,
            consumers=consumers,
            candidates=[n.name for n in self.order if _is_candidate(n)],
            cut_points=[n.name for n in cuts],
            boundaries=[n.name for n in boundaries],
        )

    # -- where to cut ----------------------------------------------------------------------
    def _cut_points(self) -> list[fx.Node]:
        """Hidden-path values that are, right after they are computed, the only hidden-path
        value later operations still read."""
        position = {n: i for i, n in enumerate(self.order)}
        last_use = {
            n: max((position.get(u, -1) for u in n.users), default=-1) for n in self.order
        }
        live: set[fx.Node] = set()
        cuts = []
        for i, node in enumerate(self.order):
            if node in self.hidden_path and last_use[node] > i:
                live.add(node)
            live = {n for n in live if last_use[n] > i}
            if live == {node}:
                cuts.append(node)
        return cuts

    def _boundaries(self, cuts: list[fx.Node]) -> list[fx.Node]:
        """The cut points where the unit scope (embed, layer half or layer, head) changes."""
        position = {n: i for i, n in enumerate(self.order)}
        return [
            cut
            for cut in cuts
            if position[cut] + 1 < len(self.order)
            and self._scope(self.order[position[cut] + 1]) != self._scope(cut)
        ]

    def _scope(self, node: fx.Node) -> str:
        """The unit a node belongs to by module: embed, layer{i}.attn/.mlp (or layer{i}), head."""
        path = _module_path(node).split(".")
        if path[0] == "layers" and len(path) >= 2:
            layer = f"layer{path[1]}"
            if self.granularity == "half" and len(path) >= 3:
                return f"{layer}.{path[2]}"
            return layer
        if path[0] == "head":
            return "head"
        return "embed"

    def _unit_names(self, unit_of: dict[fx.Node, int], count: int) -> list[str]:
        """Each unit's scope; every operation of a unit (but the hoisted prep) must share it."""
        scopes: list[set[str]] = [set() for _ in range(count)]
        prep = set(self.prep)
        for node in self.order:
            scopes[unit_of[node]].add("embed" if node in prep else self._scope(node))
        if any(len(s) != 1 for s in scopes) or len({min(s) for s in scopes}) != count:
            raise SegmentationError(f"cannot cut the graph into one unit per module: {scopes}")
        return [min(s) for s in scopes]

    def _assign(self, boundaries: list[fx.Node]) -> dict[fx.Node, int]:
        unit_of, unit = {}, 0
        ends = set(boundaries)
        for node in self.order:
            unit_of[node] = unit
            if node in ends:
                unit += 1
        return unit_of

    # -- naming and dependencies -----------------------------------------------------------
    def _value_names(
        self, unit_of: dict[fx.Node, int], boundaries: list[fx.Node], unit_names: list[str]
    ) -> dict[fx.Node, str]:
        """Names of the values that cross units: request inputs, state, hidden, residuals."""
        names: dict[fx.Node, str] = {p: p.name for p in self.placeholders}
        for index, node in enumerate(boundaries):
            names[node] = f"{unit_names[index]}.hidden"
        residuals: dict[str, list[fx.Node]] = {}
        for node in self.order:
            if node not in names and _crosses(node, unit_of):
                residuals.setdefault(_module_path(node).split(".")[0] or "model", []).append(node)
        for module, nodes in residuals.items():
            for node in nodes:
                names[node] = module if len(nodes) == 1 else f"{module}.{node.name}"
        for position, value in enumerate(self._returned()):
            names.setdefault(value, LOGITS if position == 0 else self._present_name(position))
        return names

    def _present_name(self, position: int) -> str:
        return self.placeholders[1 + position].name.replace("past", "present", 1)

    def _returned(self) -> list[fx.Node]:
        returned = self.output.args[0]
        return list(returned) if isinstance(returned, tuple | list) else [returned]

    def _dependencies(self, unit_of: dict[fx.Node, int], names: dict) -> tuple[dict, dict]:
        producers = {names[p]: REQUEST for p in self.placeholders[:2]}
        consumers: dict[str, tuple[int, ...]] = {}
        for node in self.order:
            readers = _reader_units(node, unit_of) - {unit_of[node]}
            if node is self._returned()[0]:
                readers.add(REQUEST)
            if readers and node in names:
                producers[names[node]] = unit_of[node]
                consumers[names[node]] = tuple(sorted(readers))
        for placeholder in self.placeholders[:2]:
            consumers[placeholder.name] = tuple(sorted(_reader_units(placeholder, unit_of)))
        return producers, consumers

    # -- unit graphs -----------------------------------------------------------------------
    def _build_unit(
        self, index: int, name: str, unit_of: dict[fx.Node, int], names: dict[fx.Node, str]
    ) -> UnitGraph:
        nodes = [n for n in self.order if unit_of[n] == index]
        member = set(nodes)
        external = _unique(a for n in nodes for a in n.all_input_nodes if a not in member)
        pasts = [a for a in external if a in self.placeholders[2:]]
        inputs = [a for a in external if a not in self.free and a not in pasts]
        returned = self._returned()
        presents = [returned[1 + self.placeholders.index(p) - 2] for p in pasts]
        outputs = [n for n in nodes if _reader_units(n, unit_of) - {index}]
        if returned[0] in member:
            outputs.append(returned[0])

        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for value in inputs + pasts:
            env[value] = graph.placeholder(_identifier(names[value]))
        for free in _closure(external, self.free):
            env[free] = graph.node_copy(free, env.__getitem__)
        for node in nodes:
            env[node] = graph.node_copy(node, env.__getitem__)
        graph.output(tuple(env[n] for n in outputs + presents))
        graph.lint()
        return UnitGraph(
            index=index,
            name=name,
            graph=graph,
            inputs=tuple(names[v] for v in inputs),
            state=tuple((names[p], names[q]) for p, q in zip(pasts, presents, strict=True)),
            outputs=tuple(names[n] for n in outputs),
            targets=tuple(
                _unique(n.target for n in graph.nodes if n.op in ("get_attr", "call_module"))
            ),
        )


def _is_candidate(node: fx.Node) -> bool:
    """LinguaLinked Eq. (1): computed by one operation (in-degree 1), read by several."""
    return node.op in ("call_function", "call_method", "call_module") and len(node.users) > 1


def _crosses(node: fx.Node, unit_of: dict[fx.Node, int]) -> bool:
    return bool(_reader_units(node, unit_of) - {unit_of[node]})


def _reader_units(node: fx.Node, unit_of: dict[fx.Node, int]) -> set[int]:
    return {unit_of[u] for u in node.users if u in unit_of}


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _free_nodes(nodes: list[fx.Node]) -> set[fx.Node]:
    """Nodes that depend on no graph input: weights, buffers and constants derived from them."""
    free: set[fx.Node] = set()
    for node in nodes:
        computed = node.op not in ("placeholder", "output")
        if node.op == "get_attr" or (computed and all(a in free for a in node.all_input_nodes)):
            free.add(node)
    return free


def _descendants(roots: Iterable[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.users)
    return seen


def _closure(needed: Iterable[fx.Node], free: set[fx.Node]) -> list[fx.Node]:
    """The free nodes `needed` reads, transitively, in graph order."""
    seen: set[fx.Node] = set()
    stack = [n for n in needed if n in free]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(a for a in node.all_input_nodes if a in free)
    return sorted(seen, key=_graph_position)


def _graph_position(node: fx.Node) -> int:
    return next(i for i, n in enumerate(node.graph.nodes) if n is node)


def _unique(items: Iterable) -> list:
    return list(dict.fromkeys(items))


def _identifier(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)
