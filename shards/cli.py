"""`peerd shard`: the command handler, and the shard cache `peerd generate` shares.

This is the one module of `shards` that touches `peerd` (its errors and state directory),
lazily and only inside command handlers: the library code below it takes every directory
as an argument.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

from shards.cache import ShardError, ShardOptions, ShardResult, shard
from shards.errors import ModelError
from shards.manifest import Manifest, ManifestError

SHARDS_SUBDIR = "shards"


def cmd_shard(args: argparse.Namespace) -> int:
    result = shard_or_reuse(Path(args.model_dir), args.out, ShardOptions(quant=args.quant))
    if args.json:
        print(json.dumps(summary(result), indent=1))
    else:
        _print_table(result)
    return 0


def shard_or_reuse(model_dir: Path, out: str | None, options: ShardOptions) -> ShardResult:
    """Shard into `out`, or into the state directory's shard cache; reuse identical output."""
    from peerd import statedir
    from peerd.errors import PeerdError

    target = Path(out) if out else statedir.ensure(statedir.resolve()) / SHARDS_SUBDIR
    try:
        return shard(
            model_dir,
            target if out else None,
            shard_root=None if out else target,
            options=options,
            progress=lambda line: print(f"shard: {line}", file=sys.stderr, flush=True),
        )
    except (ModelError, ShardError, ManifestError) as exc:
        raise PeerdError(str(exc)) from None
    except Exception as exc:
        if statedir.is_no_space(exc):
            raise statedir.NoSpace(target, f"sharding {model_dir.name}") from None
        raise


def summary(result: ShardResult) -> dict:
    """What `peerd shard --json` prints: the manifest's costs per unit and how it went."""
    manifest = result.manifest
    return {
        "directory": str(result.directory),
        "key": manifest.key,
        "model": manifest.model.architecture,
        "options": {"quant": manifest.options.quant.value,
                    "granularity": manifest.options.granularity},
        "units": [_unit_summary(manifest, u.index) for u in manifest.units],
        "stats": {
            "exported": result.exported,
            "seconds": round(result.seconds, 3),
            "peak_rss_bytes": peak_rss_bytes(),
            "largest_unit_weight_bytes": max(u.weight_bytes for u in manifest.units),
            "total_weight_bytes": sum(u.weight_bytes for u in manifest.units),
            "weight_mb_per_s": round(_weight_mb_per_s(result), 1) if result.exported else None,
        },
    }


def _weight_mb_per_s(result: ShardResult) -> float:
    """How fast the units were made: MB of their weights (as written) per second."""
    total = sum(u.weight_bytes for u in result.manifest.units)
    return total / 1e6 / max(result.seconds, 1e-9)


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux's VmHWM starts afresh at exec, unlike
    getrusage's ru_maxrss, which a child inherits from the process that started it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _unit_summary(manifest: Manifest, index: int) -> dict:
    unit = manifest.units[index]
    return {
        "index": unit.index,
        "name": unit.name,
        "files": [f.name for f in unit.files],
        "weight_bytes": unit.weight_bytes,
        "kv_bytes_per_token": unit.kv_bytes_per_token,
        "flops_per_token": {"prefill": unit.flops_per_token.prefill,
                            "decode": unit.flops_per_token.decode},
        "sends": {o.name: list(o.consumers) for o in unit.outputs},
    }


def _print_table(result: ShardResult) -> None:
    manifest = result.manifest
    pace = (f", {result.seconds:.0f} s at {_weight_mb_per_s(result):.0f} MB of weights per "
            "second" if result.exported else "")
    verb = "sharded" if result.exported else "already sharded"
    print(f"{verb}: {len(manifest.units)} units in {result.directory} "
          f"(quant {manifest.options.quant.value}{pace})")
    header = ("unit", "name", "weights", "kv B/token", "decode MFLOP", "sends")
    print("{:>4}  {:<16} {:>10} {:>10} {:>12}  {}".format(*header))
    for unit in manifest.units:
        sends = ", ".join(f"{o.name}->{list(o.consumers)}" for o in unit.outputs)
        print(
            f"{unit.index:>4}  {unit.name:<16} {_size(unit.weight_bytes):>10} "
            f"{unit.kv_bytes_per_token:>10} {unit.flops_per_token.decode / 1e6:>12.2f}  {sends}"
        )


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"
