"""The status document: built by the daemon from its state, rendered as a table by
`peerd status` (``--json`` prints the document itself; docs/operations.md lists the fields)."""

from __future__ import annotations

import dataclasses
from typing import Any

from peerd.cluster.election import Election
from peerd.cluster.membership import Member, Membership
from peerd.wire.protocol import ClusterReport, LinkFigures, PeerFigures


@dataclasses.dataclass(frozen=True)
class SelfInfo:
    id: str
    name: str
    instance: str
    cluster: str
    address: str
    ports: dict[str, int]


@dataclasses.dataclass(frozen=True)
class Counters:
    ignored_records: int  # mDNS services whose record did not verify
    refused_handshakes: int  # CURVE clients the ZAP handler turned away
    malformed_messages: int  # messages dropped by the protocol checks


def build(
    me: SelfInfo,
    membership: Membership,
    election: Election,
    report: ClusterReport | None,
    counters: Counters,
    plan: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    figures = {f.id: f for f in report.peers} if report else {}
    links = report.links if report else ()
    peers = [_self_entry(me, figures.get(me.id), links)] + [
        _member_entry(m, figures.get(m.id), links)
        for m in sorted(membership.members.values(), key=lambda m: m.id)
    ]
    return {
        "self": me.id,
        "name": me.name,
        "instance": me.instance,
        "cluster": me.cluster,
        "role": str(election.role),
        "leader": election.leader,
        "epoch": election.epoch,
        "peers": peers,
        "plan": plan,
        "model": model,
        "measured_epoch": report.epoch if report else None,
        "ports": me.ports,
        "security": dataclasses.asdict(counters),
        "duplicate_of_self": membership.self_duplicate,
    }


def _self_entry(me: SelfInfo, figures: PeerFigures | None, links) -> dict[str, Any]:
    entry = {"id": me.id, "name": me.name, "address": me.address, "state": "alive",
             "self": True, "duplicate": False}
    return {**entry, **_figures(figures), "links": _links_from(me.id, links)}


def _member_entry(member: Member, figures: PeerFigures | None, links) -> dict[str, Any]:
    entry = {
        "id": member.id,
        "name": member.record.name,
        "address": member.address,
        "state": str(member.state),
        "self": False,
        "duplicate": member.duplicate,
        "public_key": member.record.public_key,
    }
    return {**entry, **_figures(figures), "links": _links_from(member.id, links)}


def _figures(figures: PeerFigures | None) -> dict[str, Any]:
    if figures is None:
        return {"flops": None, "prompt_flops": None, "memory_total": None, "memory_available": None,
                "memory_used": None, "load": None, "battery": None, "model": None, "units": [],
                "unit_s": {}, "stage_overhead_s": None}
    battery = dataclasses.asdict(figures.battery) if figures.battery else None
    times = figures.unit_times
    return {
        "flops": figures.flops,
        "prompt_flops": figures.prompt_flops,
        "memory_total": figures.memory_total,
        "memory_available": figures.memory_available,
        "memory_used": figures.memory_used,
        "load": figures.load,
        "battery": battery,
        "model": figures.model,
        "units": list(figures.units),
        "unit_s": {str(u): t for u, t in times.by_unit().items()} if times else {},
        "stage_overhead_s": times.overhead_s if times else None,
    }


def _links_from(source: str, links: tuple[LinkFigures, ...]) -> list[dict[str, Any]]:
    return [
        {"target": link.target, "latency_s": link.latency_s, "bandwidth_Bps": link.bandwidth_Bps}
        for link in links
        if link.source == source
    ]


# -- rendering ------------------------------------------------------------------------------


def render(status: dict[str, Any]) -> str:
    names = {p["id"]: p["name"] for p in status["peers"]}
    leader = status["leader"]
    lines = [
        f"cluster {status['cluster']}   self {status['name']} ({status['self']})   "
        f"role {status['role']}",
        f"leader  {names.get(leader, leader) if leader else 'none yet'}   "
        f"epoch {status['epoch']}",
        "",
        _table(
            ["NAME", "ID", "ADDRESS", "STATE", "GFLOP/S", "MEM FREE", "LOAD", "BATTERY", "UNITS"],
            [_peer_row(p) for p in status["peers"]],
        ),
    ]
    link_rows = [
        [names.get(p["id"], p["id"]), names.get(link["target"], link["target"]),
         f"{link['latency_s'] * 1000:.2f} ms", f"{link['bandwidth_Bps'] / 1e6:.1f} MB/s"]
        for p in status["peers"]
        for link in p["links"]
    ]
    if link_rows:
        lines += ["", _table(["FROM", "TO", "LATENCY", "BANDWIDTH"], link_rows)]
    lines += ["", *_model_and_plan(status["model"], status["plan"], names)]
    security = status["security"]
    if any(security.values()) or status["duplicate_of_self"]:
        lines.append(
            f"refused {security['ignored_records']} foreign records, "
            f"{security['refused_handshakes']} handshakes, "
            f"{security['malformed_messages']} malformed messages"
        )
    if status["duplicate_of_self"]:
        lines.append(f"WARNING another daemon runs with this identity: "
                     f"{status['duplicate_of_self']}")
    return "\n".join(lines)


def _model_and_plan(
    model: dict[str, Any] | None, plan: dict[str, Any] | None, names: dict[str, str]
) -> list[str]:
    lines = []
    if model is not None:
        size = (f", {model['units']} units ({model['architecture']}), quant {model['quant']}"
                if model["units"] else "")
        lines.append(f"model   {model['name']} on {names.get(model['peer'], model['peer'])}: "
                     f"{model['state']}{size}")
    if plan is None:
        return [*lines, "plan    none yet"]
    if not plan["stages"]:
        return [*lines, f"plan    none: {plan['problem']}"]
    predicted = plan["predicted"]
    lines.append(
        f"plan    {plan['id']} of epoch {plan['epoch']} ({plan['objective']}, {plan['solver']}): "
        f"predicted {predicted['throughput_tps']:.1f} tokens/s, "
        f"{predicted['latency_s'] * 1000:.2f} ms per token"
    )
    lines.append(_measured_line(plan["measured"]))
    lines += [
        f"        units {s['units'][0]}-{s['units'][-1]} on {_stage_peers(s, names)}"
        for s in plan["stages"]
    ]
    return lines


def _stage_peers(stage: dict[str, Any], names: dict[str, str]) -> str:
    """A stage's peer, or a group's peers with their shares ("a 50% + b 50%")."""
    if not stage.get("shares"):
        return str(names.get(stage["peer"], stage["peer"]))
    return " + ".join(f"{names.get(s['peer'], s['peer'])} {s['fraction']:.0%}"
                      for s in stage["shares"])


def _measured_line(measured: dict[str, Any] | None) -> str:
    """The answers' figures under the prediction's, aligned with it."""
    if measured is None or not measured["tokens"]:
        return "        measured  - (no answer on this plan yet)"
    throughput, latency = measured["throughput_tps"], measured["latency_s"]
    return (f"        measured  {'-' if throughput is None else f'{throughput:.1f}'} tokens/s, "
            f"{'-' if latency is None else f'{latency * 1000:.2f}'} ms per token "
            f"(over {measured['tokens']} tokens)")


def _peer_row(peer: dict[str, Any]) -> list[str]:
    battery = peer["battery"]
    state = peer["state"] + (" (self)" if peer["self"] else "")
    if peer["flops"] is None:
        power = "-"
    elif battery is None:
        power = "mains"
    else:
        power = f"{battery['percent']:.0f}%{' plugged' if battery['plugged'] else ''}"
    return [
        peer["name"],
        peer["id"],
        peer["address"],
        state + (" DUPLICATE" if peer["duplicate"] else ""),
        "-" if peer["flops"] is None else f"{peer['flops'] / 1e9:.1f}",
        "-" if peer["memory_available"] is None else f"{peer['memory_available'] / 2**30:.2f} GiB",
        "-" if peer["load"] is None else f"{peer['load'] * 100:.0f}%",
        power,
        ",".join(map(str, peer["units"])) or "-",
    ]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    return "\n".join(
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    )
