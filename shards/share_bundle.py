"""The share units of a group stage, written as a bundle a model peer serves to the group.

    python -m shards.share_bundle MODEL SHARD_DIR OUT --weights 1,1 --first 0 --last 9

exports the share units (shards.share_units) of the layers of units FIRST..LAST of the
model sharded in SHARD_DIR, split by the weights, into OUT, with `OUT/bundle.json`: every
share unit's files (named as written, with sha256 and size), the pre-norms (float32 lists:
exact), their eps and whether the residual starts from the normed state. The daemon runs it
in a child process (it needs torch) and reads the document back (`read_bundle`); progress
goes to stderr, one line at a time. A failed export leaves nothing in OUT; one that found
its filesystem full says so in one line naming the directory and exits with EX_TEMPFAIL, so
the daemon exports again once there is room.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from shards.manifest import Manifest

BUNDLE = "bundle.json"
_LAYER_HALF = re.compile(r"layer(\d+)\.(attn|mlp)")


def layers_of(manifest: Manifest, first: int, last: int) -> list[int]:
    """The layers whose halves units first..last hold."""
    found = {int(m.group(1)) for u in manifest.units[first : last + 1]
             if (m := _LAYER_HALF.fullmatch(u.name))}
    return sorted(found)


def write_bundle(model: Path, shard_dir: Path, out: Path, weights: list[float], first: int,
                 last: int) -> dict[str, Any]:
    from shards.config import load_config
    from shards.share_units import shares_for  # torch

    manifest = Manifest.load(shard_dir)
    layers = layers_of(manifest, first, last)
    print(f"exporting share units of layers {layers[0]}-{layers[-1]} for weights {weights}"
          if layers else "no layer halves to share", file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    units = shares_for(model, manifest, weights, out, layers)
    document = {
        "units": [{"layer": u.layer, "half": u.half, "share": u.share,
                   "files": [dataclasses.asdict(f) for f in u.files],
                   "inputs": list(u.inputs), "outputs": list(u.outputs)}
                  for u in units.units.values()],
        "norms": {f"{layer}.{half}": {"weight": norm.weight.tolist(),
                                      "bias": None if norm.bias is None else norm.bias.tolist()}
                  for (layer, half), norm in units.norms.items()},
        "eps": load_config(model).norm_eps,
        "residual_post_norm": units.residual_post_norm,
    }
    (out / BUNDLE).write_text(json.dumps(document))
    print(f"exported {len(units.units)} share units", file=sys.stderr, flush=True)
    return document


def read_bundle(out: Path) -> dict[str, Any] | None:
    """The bundle written into `out`, or None where there is none (yet)."""
    path = out / BUNDLE
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shards.share_bundle")
    parser.add_argument("model", type=Path)
    parser.add_argument("shard_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--last", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        weights = [float(w) for w in args.weights.split(",")]
        write_bundle(args.model, args.shard_dir, args.out, weights, args.first, args.last)
    except Exception as exc:  # one line for the daemon's log and the members' reports
        from peerd import statedir

        shutil.rmtree(args.out, ignore_errors=True)
        if statedir.is_no_space(exc):
            no_space = statedir.NoSpace(args.out.parent, f"exporting share units of units "
                                                         f"{args.first}-{args.last}")
            print(f"share export failed: {no_space}", file=sys.stderr)
            return statedir.EX_TEMPFAIL
        print(f"share export failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
