"""bench/common.py's run_metadata: what every benchmark's JSON records of its run (the device,
the date, the commit and whether the tree differed from it), and its fallbacks where the tree
travelled without .git (a commit named by $KVCACHE_EXT_COMMIT) or is no checkout at all."""
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import common  # noqa: E402


def test_run_metadata_names_the_device_date_and_commit(monkeypatch):
    monkeypatch.delenv("KVCACHE_EXT_COMMIT", raising=False)
    meta = common.run_metadata("cpu")
    assert set(meta) == {"device", "date", "commit", "dirty"}
    assert meta["device"] == common.device_name("cpu") and "threads" in meta["device"]
    assert datetime.datetime.fromisoformat(meta["date"]).date() == datetime.date.today()
    if os.path.isdir(os.path.join(common.ROOT, ".git")):   # a checkout: HEAD's short hash
        assert meta["commit"] and all(c in "0123456789abcdef" for c in meta["commit"])
        assert isinstance(meta["dirty"], bool)


def test_a_commit_given_by_the_environment_is_taken_with_its_dirty_flag(monkeypatch):
    monkeypatch.setenv("KVCACHE_EXT_COMMIT", "abc1234+dirty")
    assert common.commit_state() == ("abc1234", True)
    assert common.git_commit() == "abc1234+dirty"
    monkeypatch.setenv("KVCACHE_EXT_COMMIT", "abc1234")
    assert common.run_metadata()["commit"] == "abc1234" and common.run_metadata()["dirty"] is False


def test_outside_a_checkout_the_commit_is_none(monkeypatch, tmp_path):
    monkeypatch.delenv("KVCACHE_EXT_COMMIT", raising=False)
    monkeypatch.setattr(common, "ROOT", str(tmp_path))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))   # no checkout above it either
    assert common.commit_state() == (None, None)
    meta = common.run_metadata()
    assert meta["commit"] is None and meta["dirty"] is None
    assert common.git_commit() == "unknown"
