"""`peerd shard`, run as the real command in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from disks import tmpfs
from sharding import sharded, state_dir

from peerd.commands.cli import main
from peerd.statedir import EX_TEMPFAIL
from shards import export
from shards.manifest import Quant


def _peerd(*args: str, state: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PEERD_STATE_DIR": state or str(state_dir())}
    return subprocess.run(
        [sys.executable, "-m", "peerd", *args], capture_output=True, text=True, env=env,
        timeout=300,
    )


@pytest.mark.slow
def test_shard_exports_once_with_progress_then_reuses(hf_checkpoint, tmp_path):
    model_dir = hf_checkpoint("llama", layers=1)
    out = tmp_path / "units"
    first = _peerd("shard", str(model_dir), "--out", str(out), "--json")
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout)
    assert [u["name"] for u in summary["units"]] == ["embed", "layer0.attn", "layer0.mlp", "head"]
    assert summary["stats"]["exported"] is True and summary["directory"] == str(out)
    assert summary["stats"]["peak_rss_bytes"] > summary["stats"]["largest_unit_weight_bytes"]
    progress = first.stderr.splitlines()
    assert progress[0].startswith("shard: [1/4] embed exported in")
    assert progress[-1].startswith("shard: [4/4] head exported in")
    assert (out / "manifest.json").is_file()

    again = _peerd("shard", str(model_dir), "--out", str(out), "--json")
    assert again.returncode == 0 and again.stderr == ""
    assert json.loads(again.stdout)["stats"]["exported"] is False


def test_default_output_is_the_state_directory_shard_cache(hf_checkpoint):
    result = sharded(hf_checkpoint("llama"))
    done = _peerd("shard", str(hf_checkpoint("llama")))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"already sharded: 6 units in {result.directory} (quant none)\n")
    assert result.directory.parent == state_dir() / "shards"


def test_quant_picks_the_units_and_the_summary_names_it(hf_checkpoint):
    int4 = sharded(hf_checkpoint("llama"), Quant.INT4)
    done = _peerd("shard", str(hf_checkpoint("llama")), "--quant", "int4", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["directory"] == str(int4.directory) and not summary["stats"]["exported"]
    assert summary["options"] == {"quant": "int4", "granularity": "half"}
    assert summary["stats"]["total_weight_bytes"] == sum(
        u.weight_bytes for u in int4.manifest.units)


def test_unsupported_or_missing_models_get_one_line_errors(hf_checkpoint, tmp_path):
    falcon = tmp_path / "falcon"
    shutil.copytree(hf_checkpoint("llama"), falcon)
    config = json.loads((falcon / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (falcon / "config.json").write_text(json.dumps(config))
    done = _peerd("shard", str(falcon), state=str(tmp_path / "state"))
    assert done.returncode == 1
    assert done.stderr == "peerd: unsupported architecture: FalconForCausalLM\n"
    done = _peerd("shard", str(tmp_path / "nowhere"), state=str(tmp_path / "state"))
    assert done.returncode == 1 and done.stderr.startswith("peerd: not a model directory")


def test_a_written_unit_that_does_not_load_fails_the_command_in_one_line(
    hf_checkpoint, tmp_path, monkeypatch, capsys,
):
    """The check loads every unit as written: here the head's data file comes out short."""
    write_unit = export.write_unit

    def short_head(staged, directory, relative):
        written = write_unit(staged, directory, relative)
        if relative.endswith("-head.onnx"):
            data = directory / written.files[1].name
            os.truncate(data, data.stat().st_size // 2)
        return written

    monkeypatch.setattr(export, "write_unit", short_head)
    out = tmp_path / "units"
    assert main(["shard", str(hf_checkpoint("llama", layers=1)), "--out", str(out)]) == 1
    *progress, error = capsys.readouterr().err.splitlines()
    assert [line.split(" exported")[0] for line in progress] == [
        "shard: [1/4] embed", "shard: [2/4] layer0.attn", "shard: [3/4] layer0.mlp"]
    assert error.startswith("peerd: unit head: written file 003-head.onnx does not load in "
                            "ONNX Runtime: ") and "out of bounds" in error, error
    assert list(tmp_path.iterdir()) == [], "nothing half-made is left"


@pytest.mark.slow
@pytest.mark.parametrize("size", ["3m", "9m", "11m"])
def test_a_disk_that_fills_during_the_export_exits_tempfail_naming_it(hf_checkpoint, tmp_path,
                                                                     size):
    """Room for some units, not all: at 9 and 11 MB the weights of a unit do not fit where
    torch.onnx writes them, whose numpy write fails with an OSError without an errno. The
    command says the disk is full, in one line, with the exit code a daemon retries on,
    and leaves nothing behind."""
    model_dir = hf_checkpoint("llama", hidden=256, vocab_size=4096)
    with tmpfs(tmp_path / "state", size) as state:
        shard = _peerd("shard", str(model_dir), state=str(state))
        assert shard.returncode == EX_TEMPFAIL, shard.stderr
        last = shard.stderr.strip().splitlines()[-1]
        assert last == f"peerd: no space left in {state / 'shards'} (sharding {model_dir.name})"
        assert not any((state / "shards").iterdir()), "the partial units are gone"
