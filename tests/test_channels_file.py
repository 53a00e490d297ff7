"""``ChannelsFile.write`` goes through a temporary file of its own (``mkstemp``) and ``os.replace``:
a file, folder or link that happens to hold the old fixed name ``<name>.tmp`` is neither written
through nor in the way, and two writers never share a temporary file."""

from __future__ import annotations

import os

from foursight.channels_file import ChannelsFile

CF = ChannelsFile(channels={"model.layers.0.mlp.down_proj": [3, 1]}, input_amax={"model.layers.0.mlp.down_proj": 2.5})


def test_write_neither_follows_nor_trips_over_a_fixed_temporary_name(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    (tmp_path / "a.json.tmp").symlink_to(victim)  # the old writer wrote through this link, then moved it over the result
    (tmp_path / "b.json.tmp").mkdir()  # the old writer failed on this (IsADirectoryError)
    for name in ("a.json", "b.json"):
        out = CF.write(tmp_path / name)
        assert not out.is_symlink() and ChannelsFile.read(out).channels == {"model.layers.0.mlp.down_proj": [1, 3]}
    assert victim.read_text() == "not yours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "a.json.tmp", "b.json", "b.json.tmp", "victim.txt"]  # nothing left over
    assert oct(os.stat(tmp_path / "a.json").st_mode & 0o777) == oct(0o644)
