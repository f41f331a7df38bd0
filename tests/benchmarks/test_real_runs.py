"""benchmarks/real_runs.py: the corpus is whole and sourced, the published rules do what their sources do,
and the short form of the benchmark scores every rule on every signal."""

from __future__ import annotations

import csv
import json
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import real_runs as rr  # noqa: E402

from stable_attn.monitor import SpikeDetector  # noqa: E402

HELD_OUT_OWNERS = "abcdefghijklm"  # owners a-m are kept for a held-out evaluation


def test_corpus_is_whole_sourced_and_keeps_held_out_owners_out():
    runs = rr.load_manifest()["runs"]
    assert len(runs) >= 40
    assert len({r["id"] for r in runs}) == len(runs)
    size = 0
    for run in runs:
        path = os.path.join(rr.CORPUS, run["file"])
        size += os.path.getsize(path)
        source = run["source"]
        if "repo" in source:
            owner = source["repo"].split("/")[0]
            assert owner[0].lower() not in HELD_OUT_OWNERS, owner
            assert len(source["commit"]) == 40 and source["path"].endswith("trainer_state.json")
        else:
            assert source["script"] == "benchmarks/record_cpu_runs.py"
        with open(path) as f:
            rows = list(csv.DictReader(f))
        steps = [int(r["step"]) for r in rows]
        assert steps == sorted(set(steps)) and len(rows) == run["points"], run["id"]
        assert all(math.isfinite(float(r["loss"])) for r in rows)
        assert run.get("blind", False) in (True, False)
        logged = {s for s in rr.SIGNALS if any(r[s] for r in rows)}
        assert set(run["signals"]) == logged
        for item in run["context"] + run["events"]:
            lo, hi = item["steps"]
            assert steps[0] <= lo <= hi <= steps[-1] and item["reason"], (run["id"], item)
        for event in run["events"]:
            assert set(event["signals"]) <= logged and event["kind"] in ("spike", "instability", "divergence")
    assert size < 3_000_000


def test_episodes_are_maximal_runs_of_flags():
    flags = np.array([0, 1, 1, 0, 1, 0, 0, 1], dtype=bool)
    assert rr.episodes(flags) == [(1, 2), (4, 4), (7, 7)]
    assert rr.episodes(np.zeros(3, dtype=bool)) == []


def noisy(n: int = 200, seed: int = 0) -> np.ndarray:
    return 1.0 + 0.01 * np.random.default_rng(seed).standard_normal(n)


def test_olmo_rule_waits_for_64_values_is_two_sided_and_lets_a_spike_hide_the_next():
    v = noisy()
    v[40] += 0.2
    assert not rr.olmo_flags(v).any()  # fewer than 64 values held
    v = noisy()
    v[120] -= 0.2
    assert np.nonzero(rr.olmo_flags(v))[0].tolist() == [120]  # |z|: a drop skips too
    alone, after = noisy(), noisy()
    alone[106] += 0.12
    after[100] += 0.3
    after[106] += 0.12
    assert np.nonzero(rr.olmo_flags(alone))[0].tolist() == [106]
    assert np.nonzero(rr.olmo_flags(after))[0].tolist() == [100]  # the first spike entered the window


def test_llmc_rule_keeps_flagged_values_out_except_the_third_in_a_row():
    after = noisy()
    after[100] += 0.3
    after[106] += 0.12
    assert np.nonzero(rr.llmc_flags(after))[0].tolist() == [100, 106]
    run = noisy()
    run[100:104] += 0.2
    assert np.nonzero(rr.llmc_flags(run))[0].tolist() == [100, 101, 102]  # the third re-enters, the fourth is hidden
    drop = noisy()
    drop[120] -= 0.2
    assert not rr.llmc_flags(drop).any()  # one-sided


def test_cosmos_rule_needs_10x_the_median_capped_at_4x_the_lowest_median():
    v = np.concatenate([np.ones(60), [9.5, 10.5]])
    assert np.nonzero(rr.cosmos_flags(v))[0].tolist() == [61]
    assert not rr.cosmos_flags(np.concatenate([np.ones(11), [50.0]])).any()  # fewer than 12 observations
    # the median follows a level shift to 6, but the baseline stops at 4x the lowest median (1): 45 > 10 x 4
    shifted = np.concatenate([np.ones(60), np.full(100, 6.0), [45.0]])
    assert np.nonzero(rr.cosmos_flags(shifted))[0].tolist() == [160]
    assert rr.cosmos_flags(np.array([1.0] * 20 + [math.nan]))[-1]


def test_short_benchmark_scores_every_rule_on_every_signal(tmp_path, capsys):
    out = tmp_path / "summary.json"
    summary = rr.main(["--traces", "1", "--steps", "500", "--verify-steps", "200", "--json", str(out)])
    assert json.loads(out.read_text())["traces"] == 1
    text = capsys.readouterr().out
    assert "**Loss, real runs**" in text and "**Gradient norm, real runs**" in text
    corpus = summary["corpus"]
    assert set(corpus) == set(rr.RULES) | {rr.ENGINE_ROW}
    assert "labelled blind**" in text and set(summary["corpus_blind"]) == set(corpus)
    for name, per in summary["corpus_blind"].items():  # a part of the corpus
        for signal, s in per.items():
            assert 0 < s["points"] < corpus[name][signal]["points"] and s["events"] <= corpus[name][signal]["events"]
    for name, per in corpus.items():
        assert set(per) == ({"grad_norm"} if name.startswith("cosmos") else set(rr.SIGNALS))
        for s in per.values():
            assert s["runs_alerted"] <= s["runs"] and s["caught"] <= s["events"]
            assert s["benign_episodes"] <= s["flagged"]
            assert s["benign_per_10k"] == 1e4 * s["benign_episodes"] / s["points"]
    # ours flags the two garbled batches of cpu_corrupted_batches on both signals, cosmos on the gradient norm
    assert corpus["ours"]["loss"]["caught"] >= 2 and corpus["ours"]["grad_norm"]["caught"] >= 2
    assert corpus["cosmos 10x median"]["grad_norm"]["caught"] >= 2
    for name, per in summary["synthetic"].items():
        assert set(per) == set(rr.FAMILIES) | set(rr.RESTART_FAMILIES) | set(rr.WARMUP_FAMILIES) | {rr.CLUSTER_FAMILY}
        assert all((s is None) == name.startswith("cosmos") for s in per.values())


def test_the_end_of_a_warm_up_re_seats_the_level() -> None:
    """Tuning warm-up traces 22 and 24: the loss rose with the warm-up, and 22 and 2 steps after its end (steps 303
    and 716) a forecast still carrying the rise's trend flagged a clean step (325, 718). With the learning rate the
    end of the warm-up re-seats the level and the forecast settles: those flags go (the rule off, as without the
    learning rate, they are back)."""
    for seed, end, benign in ((22, 303, 325), (24, 716, 718)):
        trace, lrs = rr.warmup_trace(seed, 4000, "warm-up")
        assert int(np.argmax(lrs)) == end and trace.clean[benign]
        assert benign not in np.flatnonzero(rr.ours_flags(trace.values, "loss", lrs)).tolist()
        det = SpikeDetector.loss()
        det._warmup_end = lambda: None  # the rule off
        assert benign in np.flatnonzero(rr.lr_detector_flags(det, trace.values, lrs)).tolist()
        assert benign in np.flatnonzero(rr.ours_without_lr_flags(trace.values, "loss", lrs)).tolist()


def test_holding_the_drift_in_a_warm_up_trades_a_real_event_for_quiet_warm_ups() -> None:
    """``warmup_drift=False`` silences the drift alarms of a loss rising with a warm-up (tuning warm-up traces 2 and
    10: 5 and 7 benign episodes before the peak) but also the slow rise of ``cpu_lr_divergence``'s learning-rate
    ramp (a ramp never ends, so it is a warm-up all along): why it is not the default."""
    for seed in (2, 10):
        trace, lrs = rr.warmup_trace(seed, 4000, "warm-up")
        end = int(np.argmax(lrs))
        default = np.flatnonzero(rr.ours_flags(trace.values, "loss", lrs))
        held = np.flatnonzero(rr.ours_warmup_hold_flags(trace.values, "loss", lrs))
        assert len([i for i in default if i < end and trace.clean[i]]) >= 5
        assert [i for i in held if i < end and trace.clean[i]] == []
    ramp = next(s for s in rr.load_series() if s.run == "cpu_lr_divergence" and s.signal == "loss")
    window = (ramp.steps >= 420) & (ramp.steps <= 580)
    assert rr.ours_flags(ramp.values, "loss", ramp.lrs)[window].any()
    assert not rr.ours_warmup_hold_flags(ramp.values, "loss", ramp.lrs)[window].any()


def test_the_agreement_table_bounds_what_a_lower_bar_buys() -> None:
    """``--agreement``: the first row is ours alone (its gradient-norm score of the main table); every lower bar where
    the loss agrees adds benign episodes (hard batches move both signals)."""
    series = rr.load_series()
    ours = rr.score_corpus(series)["ours"]["grad_norm"]
    rows = [line.split(" | ") for line in rr.agreement_table(series)[2:]]
    assert rows[0][0] == "| ours alone" and rows[0][2] == f"{ours.caught} of {ours.events}"
    assert rows[0][3].endswith(f"({ours.benign})")
    assert len(rows) == 1 + len(rr.AGREEMENT_BARS)
    assert all(int(row[3].split("(")[1].rstrip(")")) > ours.benign for row in rows[1:])


def test_the_frontier_scores_every_setting_against_every_target() -> None:
    """``--frontier``: one row per setting; its count of targets met is the number of cells shown met (bold), and the
    defaults' corpus cells are ours' scores of the main table."""
    series = rr.load_series()
    families = rr.synthetic_families(2, 600)
    rows = [line.strip("| ").split(" | ") for line in rr.frontier_table(series, families)[2:]]
    assert [row[0] for row in rows] == [name for name, _, _ in rr.FRONTIER]
    for row in rows:
        assert len(row) == 6 + len(families)
        assert row[-1] == f"{sum(cell.startswith('**') for cell in row[1:-1])} of {4 + len(families)}"
    ours = rr.score_corpus(series)["ours"]
    loss, grad_norm = ours["loss"], ours["grad_norm"]
    assert rows[0][1].strip("*") == f"{loss.caught} of {loss.events}"
    assert rows[0][3].strip("*") == f"{grad_norm.caught} of {grad_norm.events}"
    assert rows[0][4].strip("*") == f"{grad_norm.rate():.1f}"
    assert rows[0][2].strip("*") == f"{loss.rate():.1f}"
    # bold exactly where met
    assert rows[0][2].startswith("**") == (loss.rate() <= rr.FRONTIER_CORPUS_BENIGN["loss"])
    assert rows[0][4].startswith("**") == (grad_norm.rate() <= rr.FRONTIER_CORPUS_BENIGN["grad_norm"])
    assert rows[0][3].startswith("**") == (grad_norm.caught == grad_norm.events)
    assert any(row[1:-1] != rows[0][1:-1] for row in rows[1:])  # the settings reach the detectors


def test_the_engine_row_alerts_a_gradient_norm_jump_only_where_the_loss_confirms_it() -> None:
    """ENGINE_ROW: a run's loss and norm judged together, matched by step (the norm logged at other steps than the
    loss in part: steps with one signal are judged on it). A norm jump with an ordinary loss is flagged by the norm's
    detector but not by the engine; with the loss up at the same step both are; the learning rate reaches the
    detectors (a restart the engine follows, without which the loss flags it)."""
    loss_steps = np.arange(0, 600, 2)
    norm_steps = np.concatenate([np.arange(0, 400, 2), np.arange(401, 600, 2)])  # from 401 on, steps of its own
    loss = noisy(len(loss_steps), seed=1) * (1.0 + 2.0 * np.exp(-loss_steps / 100.0))  # a run that makes progress
    norm = noisy(len(norm_steps), seed=2)
    norm[150] *= 20.0  # step 300: alone
    norm[170] *= 20.0  # step 340: with the loss
    loss[170] *= 3.0
    lrs = np.where(loss_steps < 480, 1e-3 * (1.0 - loss_steps / 480.0) + 1e-6, 1e-3)  # a restart at step 480
    restart = loss_steps >= 480
    loss[restart] *= 1.0 + 0.8 * np.exp(-(loss_steps[restart] - 480) / 30.0)  # the loss jumps with it, settles
    norm_lrs = np.interp(norm_steps, loss_steps, lrs)
    series = [rr.Series("r", "loss", loss_steps, loss, lrs=lrs),
              rr.Series("r", "grad_norm", norm_steps, norm, lrs=norm_lrs)]
    flags = rr.engine_flags(series)
    alone = rr.ours_flags(norm, "grad_norm", norm_lrs)
    assert alone[150] and alone[170]
    assert np.flatnonzero(flags[("r", "grad_norm")]).tolist() == [170]
    assert np.flatnonzero(flags[("r", "loss")]).tolist() == [170]
    assert np.flatnonzero(rr.ours_flags(loss, "loss", lrs)).tolist() == [170]
    assert len(np.flatnonzero(rr.ours_flags(loss, "loss"))) > 1  # without the learning rate the restart is flagged
    assert len(flags[("r", "loss")]) == len(loss_steps) and len(flags[("r", "grad_norm")]) == len(norm_steps)
    norm_only = np.flatnonzero(flags[("r", "grad_norm")][200:])  # steps 401+: judged on the norm alone
    assert norm_only.tolist() == []
    jumpy = norm.copy()
    jumpy[250] *= 30.0  # step 501, a norm-only step: nothing can confirm it
    assert not rr.engine_flags([series[0], rr.Series("r", "grad_norm", norm_steps, jumpy, lrs=norm_lrs)])[
        ("r", "grad_norm")][250]
