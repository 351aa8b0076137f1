"""A home-scale model end to end with the real CLI: Qwen2.5-7B's widths, bf16 on disk.

Writes (or reuses) a random Qwen2-format checkpoint with Qwen2.5-7B's widths (vocab 152064,
hidden 3584, intermediate 18944, 28 heads, 4 KV heads, q/k/v biases) but 2 layers, bf16 on
disk, weights normal with std 0.02 (bench.llama_checkpoint), then, one heavy process at a
time, each a subprocess:

1. `peerd shard --quant none`: seconds, MB of float32 weights per second, the units' sizes
   (`peerd shard` loads every unit it writes in ONNX Runtime and fails if one does not load);
2. transformers' greedy ids (float32 from the bf16 checkpoint, eager attention, in its own
   process, which exits before peerd runs) and `peerd generate --parts 3`'s: identical lists;
   at a first difference, the top-2 margin of transformers' logits there;
3. `peerd shard --quant int4` and `peerd generate --quant int4 --parts 1`;
4. three daemons in network namespaces (tests/netns.py), the model peer started with
   `--model CKPT --quant int4`, every peer with a `--memory-budget` under which no two of
   them can hold the model (three stages); `peerd chat --prompt-ids ... --json` asked of a
   peer that does not hold the model: its ids must equal step 3's.

Prints each step's seconds and peak RSS (each process's VmHWM, sampled) and a
PASS/FAIL table; exits 1 on a FAIL. Needs root (namespaces), about 8 GB of memory at the
peak (transformers' float32 copy, then `peerd generate`'s) and 15 GB of disk; 20-40 minutes
on a loaded two-core machine. Not part of the tests.

    .venv/bin/python -m bench.home_scale [--work DIR] [--max-tokens 16] [--layers 2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.llama_checkpoint import LlamaShape, add_shape_arguments, reusable_llama, shape_from

ROOT = Path(__file__).resolve().parent.parent
QWEN25_7B_WIDTHS = LlamaShape(layers=2, hidden=3584, intermediate=18944, heads=28, kv_heads=4,
                              vocab=152064, qwen2=True)
PROMPT = [9707, 11, 1879, 13, 151000]
MB = 1e6
SHARDED_S, DEPLOYED_S, ANSWER_S = 900, 900, 600


@dataclass
class Ran:
    stdout: str
    seconds: float
    peak_rss: int  # bytes


class Report:
    def __init__(self) -> None:
        self.checks: list[tuple[str, bool, str]] = []

    def step(self, what: str, ran: Ran) -> None:
        print(f"  {what}: {ran.seconds:.1f} s, peak RSS {ran.peak_rss / MB:.0f} MB", flush=True)

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append((name, passed, detail))
        print(f"  {'PASS' if passed else 'FAIL'}: {name}{f' ({detail})' if detail else ''}",
              flush=True)
        return passed

    def table(self) -> bool:
        print("\nresult")
        for name, passed, detail in self.checks:
            print(f"  {'PASS' if passed else 'FAIL'}  {name}{f': {detail}' if detail else ''}")
        return all(passed for _, passed, _ in self.checks)


def main() -> None:
    args = _parser().parse_args()
    if args.transformers:
        print(json.dumps(_transformers_greedy(Path(args.transformers), args.prompt_ids,
                                              args.max_tokens)))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # remove the namespaces
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    report = Report()
    shape = shape_from(args, qwen2=True)
    started = time.perf_counter()
    model_dir = reusable_llama(work, shape, lambda line: print(line, flush=True), "bfloat16")
    print(f"checkpoint: {model_dir} ({_bytes(_disk_bytes(model_dir))} on disk; "
          f"{time.perf_counter() - started:.0f} s to write or find)", flush=True)
    with tempfile.TemporaryDirectory(prefix="run-", dir=work) as run_dir:
        state = Path(run_dir) / "state"  # a fresh shard cache: every shard is timed
        env = {**os.environ, "PEERD_STATE_DIR": str(state)}
        float32_bytes = _float32_step(report, model_dir, args, env)
        int4 = _int4_step(report, model_dir, args, env, float32_bytes)
        if int4 is not None:
            _cluster_step(report, model_dir, args, state, Path(run_dir), *int4)
    sys.exit(0 if report.table() else 1)


def _float32_step(report: Report, model_dir: Path, args, env: dict) -> int:
    """Shard as float32, then transformers' greedy ids against `peerd generate --parts 3`'s;
    the model's float32 weight bytes."""
    print("\n1. peerd shard --quant none", flush=True)
    summary = _shard(report, model_dir, "none", env)
    float32_bytes = summary["stats"]["total_weight_bytes"] if summary else 0
    if summary is None:
        return 0
    print("\n2. transformers (float32, eager) greedy vs peerd generate --parts 3", flush=True)
    ids = ",".join(map(str, args.prompt_ids))
    reference = _run([sys.executable, "-m", "bench.home_scale", "--transformers", str(model_dir),
                      "--prompt-ids", ids, "--max-tokens", str(args.max_tokens)], env)
    report.step("transformers", reference)
    expected = json.loads(reference.stdout)
    generated = _generate(report, model_dir, ids, args.max_tokens, env, "none", 3)
    print(f"  transformers: {expected['token_ids']}\n  peerd:        {generated}")
    report.check("peerd generate --parts 3 == transformers' greedy ids",
                 generated == expected["token_ids"],
                 _first_difference(generated, expected))
    return float32_bytes


def _int4_step(report: Report, model_dir: Path, args, env: dict,
               float32_bytes: int) -> tuple[dict, list[int]] | None:
    """Shard as int4 and generate in one part: the summary and the token ids."""
    print("\n3. peerd shard --quant int4, peerd generate --quant int4 --parts 1", flush=True)
    summary = _shard(report, model_dir, "int4", env, float32_bytes)
    if summary is None:
        return None
    ids = ",".join(map(str, args.prompt_ids))
    generated = _generate(report, model_dir, ids, args.max_tokens, env, "int4", 1)
    print(f"  int4 --parts 1: {generated}")
    return summary, generated


def _cluster_step(report: Report, model_dir: Path, args, state: Path, run_dir: Path,
                  summary: dict, expected: list[int]) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import netns

    from peerd.commands.local_cluster import BETA, budget_for
    from shards.manifest import Manifest

    print("\n4. three daemons in network namespaces, int4", flush=True)
    manifest = Manifest.load(Path(summary["directory"]))
    budget = budget_for(manifest, 3)
    print(f"  --memory-budget {int(budget) / MB:.0f} MB per peer, of which it offers "
          f"{BETA * int(budget) / MB:.0f} MB; the model needs {_need(manifest) / MB:.0f} MB with "
          f"K/V at its context", flush=True)
    dirs = netns.make_state_dirs(run_dir / "peers", 3)
    (dirs[0] / "shards").symlink_to(state / "shards", target_is_directory=True)
    extra = {i: ["--memory-budget", budget] for i in range(3)}
    extra[0] += ["--model", str(model_dir), "--quant", "int4"]
    started = time.perf_counter()
    with netns.cluster(dirs, extra) as (_, peers), netns.logs_on_failure(peers):
        netns.wait_for(lambda: netns.sharded_model(peers[0]), SHARDED_S, "the model sharded",
                       interval=1)
        print(f"  model peer ready (its units found in the shard cache): "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        plan = netns.wait_for(lambda: netns.deployed_plan(peers), DEPLOYED_S,
                              "a deployed plan", interval=1)
        netns.wait_for(lambda: _head(peers), DEPLOYED_S, "the head to accept chats")
        print(f"  plan deployed: {time.perf_counter() - started:.1f} s", flush=True)
        names = {p.id: f"peer{p.index}" for p in peers}
        for stage in plan["stages"]:
            units = ", ".join(manifest.units[u].name for u in stage["units"])
            print(f"    stage on {names[stage['peer']]}: {units}")
        report.check("the plan has three stages", len(plan["stages"]) == 3,
                     f"{len(plan['stages'])} stages")
        asked = peers[1]
        chat = _run([*netns.PEERD, "chat", "--state-dir", str(asked.state_dir), "--prompt-ids",
                     ",".join(map(str, args.prompt_ids)), "--max-tokens", str(args.max_tokens),
                     "--json"], dict(os.environ))
        report.step(f"peerd chat asked of peer{asked.index}", chat)
        answer = json.loads(chat.stdout)["token_ids"]
        print(f"  chat: {answer}")
        for peer in peers:
            print(f"  peer{peer.index} daemon peak RSS {_peak_rss(peer.process.pid) / MB:.0f}"
                  f" MB")
        report.check("the cluster's chat == peerd generate --quant int4 --parts 1",
                     answer == expected, _first_difference(answer, {"token_ids": expected}))


def _shard(report: Report, model_dir: Path, quant: str, env: dict,
           float32_bytes: int | None = None) -> dict | None:
    """Run `peerd shard`, print its units and pace; its summary, or None when it failed."""
    try:
        ran = _run([sys.executable, "-m", "peerd", "shard", str(model_dir), "--quant", quant,
                    "--json"], env)
    except subprocess.CalledProcessError as exc:
        report.check(f"peerd shard --quant {quant}: every unit written and loaded", False,
                     f"exit code {exc.returncode}, its reason above")
        return None
    report.step(f"peerd shard --quant {quant}", ran)
    summary = json.loads(ran.stdout)
    stats = summary["stats"]
    float32_bytes = float32_bytes or stats["total_weight_bytes"]
    print(f"  {len(summary['units'])} units, {_bytes(stats['total_weight_bytes'])} of weights "
          f"({stats['total_weight_bytes'] / float32_bytes:.3f}x float32) in "
          f"{stats['seconds']:.1f} s of sharding: {float32_bytes / MB / stats['seconds']:.1f} "
          f"MB of float32 weights per second ({float32_bytes / MB / ran.seconds:.1f} over the "
          f"command's {ran.seconds:.1f} s)")
    for unit in summary["units"]:
        print(f"    unit {unit['index']} {unit['name']:<10} weights "
              f"{_bytes(unit['weight_bytes']):>10}, K/V {unit['kv_bytes_per_token']} B/token")
    report.check(f"peerd shard --quant {quant}: every unit written and loaded", True,
                 f"{len(summary['units'])} units")
    return summary


def _generate(report: Report, model_dir: Path, ids: str, max_tokens: int, env: dict,
              quant: str, parts: int) -> list[int]:
    ran = _run([sys.executable, "-m", "peerd", "generate", str(model_dir), "--prompt-ids", ids,
                "--max-tokens", str(max_tokens), "--quant", quant, "--parts", str(parts),
                "--json"], env)
    report.step(f"peerd generate --quant {quant} --parts {parts}", ran)
    return json.loads(ran.stdout)["token_ids"]


def _transformers_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> dict:
    """transformers' greedy ids (float32, eager) and each step's top-2 logit margin."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    margins = []
    for logits in out.logits:
        top = torch.topk(logits[0], 2).values
        margins.append(float(top[0] - top[1]))
    return {"token_ids": out.sequences[0, len(prompt):].tolist(), "margins": margins}


def _first_difference(got: list[int], expected: dict) -> str:
    want = expected["token_ids"]
    if got == want:
        return f"{len(got)} tokens identical"
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
              min(len(got), len(want)))
    margin = expected.get("margins", [])[at:at + 1]
    return (f"first difference at new token {at}"
            + (f"; transformers' top-2 logit margin there {margin[0]:.2e}" if margin else ""))


def _run(command: list[str], env: dict) -> Ran:
    """Run to the end with stderr passed through; its stdout, seconds and peak RSS (its
    VmHWM, read every 0.1 s while it runs: wait4's ru_maxrss would count this process's
    own peak, which a child inherits)."""
    with tempfile.TemporaryFile("w+") as out:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, env=env, cwd=ROOT)
        peak = 0
        while process.poll() is None:
            peak = max(peak, _peak_rss(process.pid))
            time.sleep(0.1)
        seconds = time.perf_counter() - started
        out.seek(0)
        stdout = out.read()
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command, stdout, "")
    return Ran(stdout, seconds, peak)


def _head(peers) -> bool:
    return any(((p.status() or {}).get("dataplane") or {}).get("head") for p in peers)


def _need(manifest) -> int:
    from peerd.control.planning import context_for

    context = context_for(manifest)
    return sum(u.weight_bytes + context * u.kv_bytes_per_token for u in manifest.units)


def _peak_rss(pid: int) -> int:
    """A running process's VmHWM (0 once it is gone). A daemon's is its own: `ip netns exec`
    executes it in its own process."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _disk_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir())


def _bytes(count: float) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / MB:.1f} MB"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "peerd-home-scale"),
                   help="where the checkpoint is kept between runs (each run's units and "
                   "state are removed at its end)")
    p.add_argument("--prompt-ids", type=lambda text: [int(i) for i in text.split(",")],
                   default=PROMPT, help="the prompt's token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=16)
    add_shape_arguments(p, QWEN25_7B_WIDTHS)
    p.add_argument("--transformers", metavar="MODEL", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    main()
