"""shards.gguf.metadata against the gguf package's own reader on the same files."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from shards.errors import ModelError
from shards.gguf.metadata import read_metadata


def write_every_type(path, endianess=gguf.GGUFEndian.LITTLE):
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_uint8("u8", 200)
    writer.add_int8("i8", -3)
    writer.add_uint16("u16", 60000)
    writer.add_int16("i16", -30000)
    writer.add_uint32("u32", 4_000_000_000)
    writer.add_int32("i32", -2_000_000_000)
    writer.add_float32("f32", 0.5)
    writer.add_uint64("u64", 2**63 + 1)
    writer.add_int64("i64", -(2**62))
    writer.add_float64("f64", 1e-300)
    writer.add_bool("yes", True)
    writer.add_string("text", "héllo ▁日本 🙂")
    writer.add_array("strings", ["a", "", "Ġb", "<0x0A>", "ünï"])
    writer.add_array("floats", [0.0, -1.5, -32000.0])
    writer.add_array("ints", [1, 2, 3])
    writer.add_array("bools", [True, False])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_array("empty", [])
    writer.add_tensor("t", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_reads_as_the_gguf_package_reads_it(tmp_path, endianess):
    path = write_every_type(tmp_path / "all.gguf", endianess)
    ours = read_metadata(path)
    theirs = {k: f for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    assert set(ours) == set(theirs)
    for key, field in theirs.items():
        if key != "nested":  # the package's contents() flattens nested arrays
            assert ours[key] == field.contents(), key
    assert ours["nested"] == [[1, 2], [3]]
    assert ours["text"] == "héllo ▁日本 🙂" and ours["yes"] is True


def test_a_file_cut_short_is_one_line(tmp_path):
    path = write_every_type(tmp_path / "all.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in (0, 3, 20, len(data) // 4, 200):
        cut.write_bytes(data[:size])
        with pytest.raises(ModelError, match=r"^not a readable GGUF file \(.+\): .*cut.gguf$"):
            read_metadata(cut)


def test_not_a_gguf_file(tmp_path):
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelError, match=r"^not a readable GGUF file \(no GGUF magic\): "):
        read_metadata(other)
    with pytest.raises(ModelError, match="^no such GGUF file: "):
        read_metadata(tmp_path / "missing.gguf")
