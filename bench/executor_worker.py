"""One StageExecutor with every unit of a sharded model, in a process of its own.

`Worker` starts `python -m bench.executor_worker UNITS VARIANT` and asks it for greedy
answers; the process imports no more than the executor needs (no torch), so its resident
memory is the executor's plus Python's, numpy's and ONNX Runtime's. Used by
bench.executor_memory (options side by side) and bench.quant (one-process RSS).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from shards.executor import ExecutorOptions, StageExecutor
from shards.manifest import Manifest

VARIANTS = {
    "defaults": ExecutorOptions(),
    "no-arena": ExecutorOptions(memory_arena=False),
    "no-prepack": ExecutorOptions(prepacking=False),
}


class Worker:
    """A StageExecutor with every unit of `units`, in a process of its own, answering greedily
    on request: its RSS is the executor's alone (plus Python and ONNX Runtime)."""

    def __init__(self, units: Path, variant: str = "defaults") -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.executor_worker", str(units), variant],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.loaded = self._reply()

    def answer(self, prompt_tokens: int, tokens: int) -> dict[str, Any]:
        """One answer: prefill seconds, decode tokens/s, and memory while its K/V is held."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{prompt_tokens} {tokens}\n")
        self.process.stdin.flush()
        return self._reply()

    def _reply(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the executor worker exited ({self.process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(units: Path, variant: str) -> None:
    """The worker's side: load, report, then answer each request line."""
    manifest = Manifest.load(units)
    stage = StageExecutor(manifest, units, 0, len(manifest.units) - 1, VARIANTS[variant])
    _send({"weight_bytes": stage.weight_bytes, **_memory()})
    for line in sys.stdin:
        prompt_tokens, tokens = map(int, line.split())
        _send(_answer(stage, prompt_tokens, tokens))


def _answer(stage: StageExecutor, prompt_tokens: int, tokens: int) -> dict[str, Any]:
    prompt = np.arange(prompt_tokens) * 7919 % (stage.manifest.model.vocab_size - 3) + 3
    started = time.perf_counter()
    logits = stage.step("s", {"input_ids": prompt[None],
                              "position_ids": np.arange(prompt_tokens)[None]},
                        rows=1)["logits"]  # the head on the drawn row, as a peer runs it
    prefilled = time.perf_counter()
    for position in range(prompt_tokens, prompt_tokens + tokens):
        token = int(logits[0, -1].argmax())
        logits = stage.step("s", {"input_ids": np.array([[token]]),
                                  "position_ids": np.array([[position]])})["logits"]
    done = time.perf_counter()
    held = {"kv_bytes": stage.kv_bytes(), **_memory()}
    stage.drop("s")
    return {"prefill_s": prefilled - started, "decode_tps": tokens / (done - prefilled), **held}


def _memory() -> dict[str, int]:
    """This process's resident bytes, and the file-backed part of them (mapped weights)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024
    return {"rss": fields["VmRSS"], "rss_file": fields["RssFile"]}


def _send(document: dict[str, Any]) -> None:
    print(json.dumps(document), flush=True)


if __name__ == "__main__":
    _serve(Path(sys.argv[1]), sys.argv[2])
