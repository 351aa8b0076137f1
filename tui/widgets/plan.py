"""The plan as a picture: the ring of stages, each peer's unit range drawn to scale over the
model's units (a group stage's peers under it, with their shares), the residual links (from
the daemon's `plan` event), and the planner's predicted throughput beside the measured one.
The bars are as long as the pane's width allows (BAR_WIDTH at most); a line still too long
ends in an ellipsis, never wraps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.widgets import Static

from tui.figures import name_of, rate, span

BAR_WIDTH = 40
MIN_BAR_WIDTH = 4


@dataclass(frozen=True)
class Measured:
    now: float | None = None  # tokens/s through this peer's stage lately
    last_answer: float | None = None  # decode tokens/s of the last answer asked here


def draw_plan(status: dict[str, Any], known: dict[str, str],
              plan_event: dict[str, Any] | None, measured: Measured,
              width: int | None = None) -> Text:
    """The picture; `width`: the cells each line may take (None: as many as it needs)."""
    plan, model = status.get("plan"), status.get("model") or {}
    if plan is None:
        return Text("no plan yet" + (f": model {model['state']}" if model else ""), "dim")
    text = Text()
    text.append(f"plan {plan['id']}", "bold").append(
        f" · epoch {plan['epoch']} · {plan['objective']} ({plan['solver']}) · "
        f"{plan['model']}"
    )
    if not plan["stages"]:
        return text.append("\nno stages: ", "bold red").append(plan["problem"] or "")
    total = model.get("units") or plan["stages"][-1]["units"][-1] + 1
    text.append(f", {total} units\n")
    layout = _StageLayout.of(plan["stages"], known, width)
    for index in range(len(plan["stages"])):
        text.append_text(_stage_line(index, plan["stages"], total, known, layout))
    if plan_event is not None and (plan_event["epoch"], plan_event["plan_id"]) == (
        plan["epoch"], plan["id"]
    ):
        text.append_text(_residuals(plan_event["residuals"], known))
    else:
        text.append("residual links: listed by the next plan event\n", "dim")
    predicted = plan["predicted"] or {}
    text.append("predicted ").append(rate(predicted.get("throughput_tps")), "bold")
    text.append(" · measured ").append(rate(measured.now), "bold").append(" now")
    if measured.last_answer is not None:
        text.append(f" · last answer {rate(measured.last_answer)}")
    exit_status = (status.get("dataplane") or {}).get("exit")
    if exit_status is not None:
        text.append("\n").append(exit_line(exit_status))
    return text


def exit_line(exit_status: dict[str, Any]) -> str:
    """The head's early exit and what it did for the answers so far."""
    tokens = exit_status["tokens"]
    if exit_status["speculative"]:
        drafted, accepted = exit_status["drafted"], exit_status["accepted"]
        share = f"{accepted / drafted:.0%}" if drafted else "-"
        return (f"speculative: {exit_status['speculative']} drafts from layer "
                f"{exit_status['layer']} · {accepted} of {drafted} drafts accepted ({share})")
    exited, checked = exit_status["exited"], exit_status["checked"]
    rate_shown = f"{exited / tokens:.0%}" if tokens else "-"
    agreed = f"{exit_status['agreed'] / checked:.0%}" if checked else "-"
    return (f"early exit after layer {exit_status['layer']} at {exit_status['threshold']} · "
            f"{exited} of {tokens} tokens exited ({rate_shown}) · full model agreed {agreed}")


def bar(first: int, last: int, total: int, width: int = BAR_WIDTH) -> tuple[int, int]:
    """The (start, end) columns of units first..last out of `total`, to scale; at least one
    column wide."""
    start = round(first * width / total)
    end = max(round((last + 1) * width / total), start + 1)
    return start, min(end, width)


@dataclass(frozen=True)
class _StageLayout:
    """The cells of a stage line's parts: the peer's name, the bar, the units' label, and
    the whole line's (None: as many as it needs)."""

    name: int
    bar: int
    label: int
    width: int | None

    @classmethod
    def of(cls, stages: list[dict[str, Any]], known: dict[str, str],
           width: int | None) -> _StageLayout:
        name = max(len(name_of(s["peer"], known)) for s in stages)
        label = max(len(_units_label(s["units"])) for s in stages)
        rest = 3 + name + 2 + 2 + label  # the ring and the gaps around the bar
        bar_cells = BAR_WIDTH if width is None else min(BAR_WIDTH, width - rest)
        return cls(name, max(MIN_BAR_WIDTH, bar_cells), label, width)


def _units_label(units: list[int]) -> str:
    return f"{span(units[0], units[-1])} ({len(units)})"


def _stage_line(index: int, stages: list[dict[str, Any]], total: int,
                known: dict[str, str], layout: _StageLayout) -> Text:
    units, count = stages[index]["units"], len(stages)
    start, end = bar(units[0], units[-1], total, layout.bar)
    ring = "⟳ " if count == 1 else "╭▶" if index == 0 else "╰─" if index == count - 1 else "│ "
    line = Text(f"{ring} {name_of(stages[index]['peer'], known):<{layout.name}}  ")
    line.append("░" * start, "dim").append("█" * (end - start), f"color({index % 6 + 2})")
    line.append("░" * (layout.bar - end), "dim")
    line.append(f"  {_units_label(units):>{layout.label}}")
    back = f"  ⟲ token to {name_of(stages[0]['peer'], known)}"
    fits = layout.width is None or line.cell_len + len(back) <= layout.width
    if index == count - 1 and count > 1 and fits:
        line.append(back, "dim")
    line.append("\n")
    if stages[index].get("shares"):
        line.append_text(_group_line(stages[index]["shares"], known))
    return line


def _group_line(shares: list[dict[str, Any]], known: dict[str, str]) -> Text:
    """A group stage's peers, the lead first, each with its share of every layer."""
    line = Text("   group: ", "dim")
    for index, share in enumerate(shares):
        line.append(" · " if index else "").append(name_of(share["peer"], known), "bold")
        line.append(f" {share['fraction']:.0%}")
    return line.append("\n")


def _residuals(links: list[dict[str, Any]], known: dict[str, str]) -> Text:
    if not links:
        return Text("residual links: none (every stage feeds only the next)\n")
    text = Text("residual links:")
    for link in links:
        text.append(f"  {name_of(link['from'], known)} ⇢ {name_of(link['to'], known)}", "bold")
        text.append(f" ({', '.join(link['tensors'])})")
    return text.append("\n")


def cut(text: Text, width: int | None) -> Text:
    """`text` with each line longer than `width` cells ending in an ellipsis at that width."""
    if width is None:
        return text
    lines = text.split("\n")
    for line in lines:
        line.truncate(width, overflow="ellipsis")
    return Text("\n").join(lines)


class PlanView(Static):
    """The plan picture; `show` redraws it at the pane's width, again when that changes."""

    _shown: tuple[dict[str, Any], dict[str, str], dict[str, Any] | None, Measured] | None = None

    def show(self, status: dict[str, Any], known: dict[str, str],
             plan_event: dict[str, Any] | None, measured: Measured) -> None:
        self._shown = (status, known, plan_event, measured)
        width = self.content_size.width or None
        self.update(cut(draw_plan(status, known, plan_event, measured, width), width))

    def on_resize(self) -> None:
        if self._shown is not None:
            self.show(*self._shown)
