"""The drafter export cache (dflash_trt/builders/export_cache.py): a second export of the same checkpoints is a copy
of the first's graphs, anything the graphs depend on is another entry, a half-written entry is never served, and a
cache that cannot be written changes nothing but the time."""

from __future__ import annotations

import os
import stat

import pytest
from helpers import make_tiny_pair

from dflash_trt.builders import export_cache
from dflash_trt.builders.hashing import tree_sha256
from dflash_trt.builders.triton_repo import sources_from_checkpoints


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(root))
    return root


def counting_exports(monkeypatch):
    """The real exporter, counted."""
    from dflash_trt.builders import onnx_drafter

    calls = []
    real = onnx_drafter.export_from_checkpoints

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(onnx_drafter, "export_from_checkpoints", counted)
    return calls


def test_the_same_pair_is_exported_once_and_copied_after(tmp_path, cache, monkeypatch):
    make_tiny_pair(tmp_path / "pair", vocab_size=64)
    calls = counting_exports(monkeypatch)
    sources_from_checkpoints(tmp_path / "pair/target", tmp_path / "pair/drafter", tmp_path / "a")
    sources_from_checkpoints(tmp_path / "pair/target", tmp_path / "pair/drafter", tmp_path / "b")
    assert len(calls) == 1
    assert tree_sha256(tmp_path / "a") == tree_sha256(tmp_path / "b")
    assert not list((tmp_path / "b").rglob(export_cache.COMPLETE))  # the entry's marker stays in the cache

    # another drafter (other weights) is another entry
    make_tiny_pair(tmp_path / "other", vocab_size=64, drafter_seed=1)
    sources_from_checkpoints(tmp_path / "other/target", tmp_path / "other/drafter", tmp_path / "c")
    assert len(calls) == 2 and tree_sha256(tmp_path / "c") != tree_sha256(tmp_path / "a")


def test_the_key_follows_every_input():
    base = export_cache.export_key("t", "d", fp16=False)
    assert base == export_cache.export_key("t", "d", fp16=False)
    others = {export_cache.export_key("t2", "d", False), export_cache.export_key("t", "d2", False)}
    others.add(export_cache.export_key("t", "d", fp16=True))
    assert base not in others and len(others) == 3


def test_a_half_written_entry_is_never_served(tmp_path, cache):
    key = "k" * 32
    entry = cache / "onnx" / key
    entry.mkdir(parents=True)
    (entry / "drafter.onnx").write_bytes(b"half")  # no .complete: a writer that died
    made = []
    served = export_cache.cached_export(key, tmp_path / "out", lambda out: (out.mkdir(), made.append(out)), log=print)
    assert not served and made == [tmp_path / "out"]


def test_off_and_an_unwritable_cache_change_nothing_but_the_time(tmp_path, monkeypatch, capsys):
    def export(out):
        out.mkdir()
        (out / "drafter.onnx").write_bytes(b"graph")

    monkeypatch.setenv("DFLASH_TRT_CACHE", "off")
    assert export_cache.cache_root() is None
    assert not export_cache.cached_export("a" * 32, tmp_path / "off", export)

    if os.geteuid() == 0:
        root = tmp_path / "file-in-the-way"  # root writes anywhere: a file where the folder should be
        root.write_text("")
    else:
        root = tmp_path / "read-only"
        root.mkdir()
        root.chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(root))
    assert not export_cache.cached_export("b" * 32, tmp_path / "out", export)
    assert (tmp_path / "out" / "drafter.onnx").read_bytes() == b"graph"
    assert "not written" in capsys.readouterr().out


def test_only_the_most_recently_used_entries_stay(tmp_path, cache):
    def export(out):
        out.mkdir()
        (out / "g").write_text(out.name)

    keys = [f"{i:032d}" for i in range(export_cache.KEEP + 2)]
    for n, key in enumerate(keys):  # entries used in this order
        entry = cache / "onnx" / key
        entry.mkdir(parents=True)
        (entry / export_cache.COMPLETE).write_text("")
        os.utime(entry, (n, n))
    assert export_cache.cached_export(keys[0], tmp_path / "again", export)  # a hit: the oldest is now the newest
    export_cache.cached_export("z" * 32, tmp_path / "new", export)  # a store prunes
    left = {p.name for p in (cache / "onnx").iterdir()}
    assert len(left) == export_cache.KEEP and keys[0] in left and keys[1] not in left
