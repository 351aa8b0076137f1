"""Exactness of tensor-parallel shares: every stage run as N in-process shares, every
exchange through the wire codec, gives transformers' logits and greedy tokens."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from sharding import reference, sharded, share_units
from wire_strategies import frames

from peerd.commands.generate import build_pipeline, generate
from peerd.inference.shares import HEAD, Exchange, ShareStage
from peerd.wire import protocol
from peerd.wire.protocol import SharePhase
from shards.executor import StageExecutor
from shards.sampling import SamplingParams
from shards.share_split import ShareError
from shards.share_units import shares_for

PROMPT = (1, 17, 42, 99, 7, 250, 3, 64)
NEW_TOKENS = 10
MARGIN = 1e-3
# family, checkpoint overrides, share weights, stages
CASES = [
    ("llama", {"heads": 4, "kv_heads": 2}, (1.0, 1.0), 1),
    ("llama", {"heads": 4, "kv_heads": 2}, (3.0, 1.0), 2),
    ("llama", {"heads": 6, "kv_heads": 3, "hidden": 48, "attention_bias": True}, (1.0,) * 3, 1),
    ("gpt2", {"heads": 6, "hidden": 48}, (1.0, 1.0), 3),
    ("gpt2", {"heads": 6, "hidden": 48}, (1.0,) * 3, 1),
    ("bloom", {"heads": 6, "hidden": 48}, (1.0, 1.0), 1),
    ("bloom", {"heads": 6, "hidden": 48}, (1.0,) * 3, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "overrides", "weights", "parts"), CASES)
def test_shares_reproduce_transformers(hf_checkpoint, family, overrides, weights, parts):
    model_dir = hf_checkpoint(family, **overrides)
    result = sharded(model_dir)
    tokens, logits = reference(model_dir, PROMPT, NEW_TOKENS)
    pipeline = build_pipeline(result.manifest, result.directory, parts,
                              shares=share_units(model_dir, weights))
    run = generate(pipeline, result.manifest, list(PROMPT), NEW_TOKENS, SamplingParams(),
                   stop_at_eos=False)
    np.testing.assert_allclose(np.stack(run.logits), logits, rtol=0, atol=1e-4)
    for got, want, row in zip(run.token_ids, tokens, logits, strict=True):
        top2 = np.sort(row)[-2:]
        assert got == want or top2[1] - top2[0] <= MARGIN
    assert all(w.executor.wire_bytes > 0 for w in pipeline.workers)
    assert all(w.executor.sequence_count == 0 for w in pipeline.workers)


@pytest.mark.slow
def test_share_0_alone_runs_the_head_on_the_rows_whose_tokens_are_drawn(hf_checkpoint):
    model_dir = hf_checkpoint("llama", heads=4, kv_heads=2)
    result = sharded(model_dir)
    last = len(result.manifest.units) - 1
    stage = ShareStage(result.manifest, result.directory, 0, last,
                       share_units(model_dir, (1.0, 1.0)))
    inputs = {"input_ids": np.array([PROMPT], np.int64),
              "position_ids": np.arange(len(PROMPT))[None]}
    full = StageExecutor(result.manifest, result.directory, 0, last).step("x", inputs)["logits"]
    got = stage.step("x", inputs, rows=2)["logits"]
    assert got.shape == (1, 2, full.shape[2])
    np.testing.assert_allclose(got, full[:, -2:], atol=1e-4, rtol=0)
    assert [HEAD in share.model_units for share in stage.shares] == [True, False]


@pytest.mark.slow
def test_shares_compute_what_needs_no_message_before_they_wait(hf_checkpoint):
    """Tiled overlap, seen in two shares' schedules of an 8-token prompt (rows 0-3 on share 0,
    4-7 on share 1), at layer 0's attention: share 0 has its own rows' K/V when it first
    waits for share 1's rows, and share 1 sends share 0 the partial of share 0's rows before
    it computes its own."""
    stage, seen = _two_shares_recorded(hf_checkpoint)
    attention = 1  # layer 0's attention unit
    first_wait = next(held for share, exchange, held, _ in seen
                      if share == 0 and exchange.tag.unit == attention and exchange.expects)
    first_send = next(held for share, exchange, held, _ in seen
                      if share == 1 and exchange.tag.unit == attention
                      and exchange.tag.phase == SharePhase.REDUCE and exchange.sends)
    assert (first_wait, first_send) == (4, 4)
    assert stage.length("x") == len(PROMPT)


@pytest.mark.slow
def test_in_the_mlp_a_share_hands_the_earlier_shares_their_partials_first(hf_checkpoint):
    """Share 1 runs share 0's rows of layer 0's MLP first and sends their partial before it
    computes its own rows' tile, so share 0, ahead of it, does not wait for it."""
    _, seen = _two_shares_recorded(hf_checkpoint)
    mlp = 2  # layer 0's MLP unit
    tiles_before_send = next(tiles for share, exchange, _, tiles in seen
                             if share == 1 and exchange.tag.unit == mlp
                             and exchange.tag.phase == SharePhase.REDUCE and exchange.sends)
    assert tiles_before_send[mlp] == 1


def _two_shares_recorded(hf_checkpoint):
    """Two equal shares of a small Llama after one step of PROMPT, and every exchange of
    their schedules as `_recorded` notes it."""
    model_dir = hf_checkpoint("llama", heads=4, kv_heads=2)
    result = sharded(model_dir)
    last = len(result.manifest.units) - 1
    stage = ShareStage(result.manifest, result.directory, 0, last,
                       share_units(model_dir, (1.0, 1.0)))
    seen: list[tuple[int, Exchange, int, Counter[int]]] = []
    for share in stage.shares:
        share.schedule = _recorded(share, seen)
    stage.step("x", {"input_ids": np.array([PROMPT], np.int64),
                     "position_ids": np.arange(len(PROMPT))[None]})
    return stage, seen


def _recorded(share, seen):
    """`share.schedule`, noting each exchange with the K/V positions the share then holds
    and the tiles it has computed so far, by unit."""
    schedule, tile = share.schedule, share._tile
    tiles: Counter[int] = Counter()

    def counted(unit, *args):
        tiles[unit.index] += 1
        return tile(unit, *args)

    def recording(seq_id, step, inputs, rows=None):
        inner = schedule(seq_id, step, inputs, rows)
        got = None
        try:
            while True:
                exchange = inner.send(got)
                seen.append((share.index, exchange, share.length(seq_id), Counter(tiles)))
                got = yield exchange
        except StopIteration as done:
            return done.value

    share._tile = counted
    return recording


def test_more_shares_than_kv_heads_is_refused(hf_checkpoint, tmp_path):
    model_dir = hf_checkpoint("llama", kv_heads=1)
    with pytest.raises(ShareError, match="2 shares exceed the 1 KV-head groups"):
        shares_for(model_dir, sharded(model_dir).manifest, [1, 1], tmp_path)


def _share_message(**changes):
    values = {"plan": "local", "seq_id": "s", "step": 0, "unit": 1, "phase": "gather",
              "share": 1, "row_start": 2, "row_stop": 4,
              "tensors": {"rows": np.ones((1, 2, 8), np.float32)}}
    return protocol.ShareData(**(values | changes))


def test_share_data_round_trips_through_the_codec():
    message = _share_message(phase=protocol.SharePhase.REDUCE)
    decoded = protocol.decode(protocol.encode(message))
    assert isinstance(decoded, protocol.ShareData)
    assert decoded.phase == "reduce" and decoded.row_stop == 4
    np.testing.assert_array_equal(decoded.tensors["rows"], message.tensors["rows"])


@pytest.mark.parametrize(("changes", "error"), [
    ({"phase": "scatter"}, "share: unknown phase 'scatter'"),
    ({"row_stop": 5}, r"share: tensor rows of shape \[1, 2, 8\] is not \[batch, 3, width\]"),
    ({"tensors": {"rows": np.ones((2, 8), np.float32)}}, r"is not \[batch, 2, width\]"),
    ({"row_start": 5}, "share: bad row range"),
])
def test_share_data_refuses_bad_shapes_and_phases_on_decode(changes, error):
    values = {"plan": "local", "seq_id": "s", "step": 0, "unit": 1, "phase": "gather",
              "share": 1, "row_start": 2, "row_stop": 4} | changes
    tensors = values.pop("tensors", {"rows": np.ones((1, 2, 8), np.float32)})
    with pytest.raises(protocol.ProtocolError, match=error):
        protocol.decode(frames("share", values, tensors))
