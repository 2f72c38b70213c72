"""kvpress's protocol in ``kvcache-ext eval`` without a model: ``--keep kvpress`` and
``--protocol kvpress`` and their refusals, the spread over prompts on hand-made records (the
standard error of a task's mean, propagated to RULER's mean over tasks), and the frontier plot.
The run itself on the default model is in tests/test_ruler.py."""
import json
import math

import pytest

from kvcache_ext import cli
from kvcache_ext.cli.eval import DEFAULT_POLICIES, resolved
from kvcache_ext.evaluation.named_policies import parse_policies
from kvcache_ext.evaluation.frontier import MIB, frontier_rows, plot_frontier
from kvcache_ext.evaluation.report import format_table, summarize
from kvcache_ext.evaluation.spread import mean_of_means_error, standard_error

KVPRESS_KEEP = [0.75, 0.5, 0.25, 0.125]


def _parsed(*argv):
    return resolved(cli.build_parser().parse_args(["eval", *argv]))


def test_keep_kvpress_is_its_four_ratios():
    assert _parsed("--keep", "kvpress").keep == KVPRESS_KEEP
    assert _parsed("--keep", " KVpress ").keep == KVPRESS_KEEP
    assert _parsed("--keep", "0.5,0.1").keep == [0.5, 0.1]


def test_protocol_fills_in_what_the_command_line_leaves_out():
    args = _parsed("--protocol", "kvpress")
    assert (args.task, args.lengths, args.keep, args.seeds, args.mode) == (
        "ruler", [4096], KVPRESS_KEEP, 5, ["aware", "agnostic"])
    args = _parsed("--protocol", "kvpress", "--seeds", "8", "--lengths", "2048", "--keep", "0.5", "--mode", "agnostic")
    assert (args.task, args.lengths, args.keep, args.seeds, args.mode) == ("ruler", [2048], [0.5], 8, ["agnostic"])
    plain = _parsed("--task", "passkey")
    assert (plain.lengths, plain.seeds, plain.keep, plain.protocol, plain.first_seed) == (
        [1024, 2048], 1, None, None, 0)
    assert _parsed("--protocol", "kvpress", "--first-seed", "5").first_seed == 5


def test_protocol_runs_each_family_beside_our_best_selection_unless_policies_are_given():
    assert parse_policies(_parsed("--protocol", "kvpress").policy) == [
        "full", "snapkv", "ada-snapkv", "expected-attention", "kvzip-global",
        "ada-snapkv-sentences", "kvzip-global-context-sentences"]
    assert _parsed("--protocol", "kvpress", "--policy", "full,h2o").policy == ["full", "h2o"]
    assert parse_policies(_parsed("--task", "ruler").policy) == parse_policies(DEFAULT_POLICIES)


@pytest.mark.parametrize("argv,says", [
    (["--task", "ruler", "--keep", "0.5,kvpress"],
     "argument --keep: expected comma-separated fractions in (0, 1], got 'kvpress' in '0.5,kvpress'; "
     "or kvpress alone, for its four: 0.75,0.5,0.25,0.125"),
    (["--task", "ruler", "--keep", "1.5"],
     "argument --keep: must be fractions in (0, 1], got 1.5 in '1.5'; or kvpress"),
    (["--protocol", "kvpress", "--task", "passkey"], "--protocol kvpress runs --task ruler, not --task passkey"),
    (["--protocol", "kvpress", "--budget", "64"],
     "--protocol kvpress keeps fractions of each prompt (--keep 0.75,0.5,0.25,0.125); give --keep to change "
     "them, not --budget 64"),
    (["--task", "passkey", "--frontier", "{png}"],
     "--frontier draws RULER's mean: it applies to --task ruler, not passkey"),
    (["--report", "{passkey}", "--protocol", "kvpress"], "--report runs nothing: it takes no --protocol"),
    (["--report", "{passkey}", "--frontier", "{png}"],
     "--frontier {png}: the records hold no RULER task: the frontier plots RULER's scores"),
])
def test_bad_protocol_values_are_refused_naming_the_argument(argv, says, tmp_path, capsys):
    files = {"png": str(tmp_path / "f.png"), "passkey": str(tmp_path / "passkey.json")}
    (tmp_path / "passkey.json").write_text(json.dumps({"complete": True, "records": [
        {"task": "passkey", "mode": "aware", "policy": "full", "budget": None, "correct": True,
         "kv_bytes": 100, "full_bytes": 100}]}))
    assert cli.main(["eval", *[a.format(**files) for a in argv], "--no-progress"]) == 2
    assert says.format(**files) in capsys.readouterr().err
    assert not (tmp_path / "f.png").exists()


def test_an_unknown_protocol_is_refused_with_the_known_ones(capsys):
    assert cli.main(["eval", "--protocol", "leaderboard"]) == 2
    err = capsys.readouterr().err
    assert "argument --protocol: invalid choice: 'leaderboard' (choose from " in err and "kvpress" in err


def _record(task, policy, keep, seed, score, kv_bytes, mode="aware", length=4000):
    return {"task": task, "mode": mode, "policy": policy, "budget": keep, "length": length, "seed": seed,
            "depth": 0.5, "answer": "1", "output": "", "correct": score == 1.0, "score": score,
            "kv_bytes": kv_bytes, "full_bytes": 120}


def test_standard_errors_by_hand():
    assert standard_error([100.0, 50.0, 0.0]) == pytest.approx(50 / math.sqrt(3))
    assert standard_error([100 / 3] * 5) == 0.0        # equal scores: no spread, exactly
    assert standard_error([62.0]) is None               # one prompt: none to estimate
    assert mean_of_means_error([3.0, 4.0]) == pytest.approx(2.5)   # sqrt(9 + 16) / 2
    assert mean_of_means_error([3.0, None]) is None and mean_of_means_error([]) is None


def test_the_spread_over_prompts_in_rows_table_and_ruler_mean():
    records = [_record("niah_single_1", "snapkv", 0.25, seed, score, kv)   # listed out of seed order
               for seed, score, kv in ((2, 0.0, 35), (0, 1.0, 25), (1, 0.5, 30))]
    records += [_record("vt", "snapkv", 0.25, seed, 1.0, 30) for seed in range(3)]   # all equal
    rows = {(r["task"], r["policy"]): r for r in summarize(records)}
    niah = rows[("niah_single_1", "snapkv")]
    assert niah["prompt_scores"] == [{"length": 4000, "seed": s, "score": 100 * x}
                                     for s, x in ((0, 1.0), (1, 0.5), (2, 0.0))]
    assert niah["score"] == 50.0 and niah["sem"] == pytest.approx(50 / math.sqrt(3)) and niah["kv_bytes"] == 30
    assert rows[("vt", "snapkv")]["score"] == 100.0 and rows[("vt", "snapkv")]["sem"] == 0.0
    mean = rows[("ruler", "snapkv")]
    assert mean["score"] == 75.0 and mean["tasks"] == 2
    assert mean["sem"] == pytest.approx(50 / math.sqrt(3) / 2)   # sqrt(sem1^2 + 0^2) / 2 tasks
    table = format_table(summarize(records))
    assert "niah_single_1 (aware): RULER score (share of the answers found, 0-100); ± its standard error" in table
    assert "| snapkv | 50.0 ± 28.9 (0.25) |" in table
    assert "| snapkv | 100.0 ± 0.0 (0.25) |" in table
    assert "| snapkv | 75.0 ± 14.4 (0.25) |" in table


def test_one_prompt_shows_no_spread():
    records = [_record("niah_single_1", "snapkv", 0.25, 0, 1.0, 30), _record("vt", "snapkv", 0.25, 0, 0.5, 30)]
    rows = summarize(records)
    assert [r["sem"] for r in rows] == [None, None, None]   # both tasks and their mean
    table = format_table(rows)
    assert "±" not in table and "| snapkv | 75.0 (0.25) |" in table


def _frontier_records():
    records = []
    for mode in ("aware", "agnostic"):
        for task in ("niah_single_1", "vt"):
            for seed in range(2):
                records.append(_record(task, "full", None, seed, 1.0, 120, mode))
                for keep, score in ((0.5, 1.0), (0.25, 0.5)):
                    records.append(_record(task, "snapkv", keep, seed, score * (seed + 1) / 2, keep * 120, mode))
                    # an Ada-KV press masks a full-size cache: its bytes are the full cache's at every keep
                    records.append(_record(task, "kvpress-ada-snapkv", keep, seed, score, 124, mode))
    return records


def test_frontier_plot_has_one_line_per_method_at_its_measured_bytes(tmp_path):
    rows = summarize(_frontier_records())
    path = tmp_path / "frontier.png"
    drawn = plot_frontier(rows, str(path), title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(drawn) == ["aware", "agnostic"]
    for lines in drawn.values():
        assert list(lines) == ["full cache", "snapkv", "kvpress-ada-snapkv"]
        assert lines["full cache"] == [[120 / MIB, 100.0]]
        mean = {r["budget"]: r["score"] for r in rows if r["task"] == "ruler" and r["policy"] == "snapkv"}
        assert lines["snapkv"] == [[30 / MIB, mean[0.25]], [60 / MIB, mean[0.5]]]   # by bytes held
        assert [x for x, _ in lines["kvpress-ada-snapkv"]] == [124 / MIB] * 2


def test_frontier_of_a_single_task_and_of_no_ruler_task():
    one = summarize([r for r in _frontier_records() if r["task"] == "vt"])
    assert {r["task"] for r in frontier_rows(one)} == {"vt"}
    with pytest.raises(ValueError, match="the records hold no RULER task"):
        frontier_rows(summarize([{"task": "passkey", "mode": "aware", "policy": "full", "budget": None,
                                  "correct": True, "kv_bytes": 1, "full_bytes": 1}]))
