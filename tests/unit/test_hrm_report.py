"""models.hrm.evaluate (segment-by-segment scoring, adaptive halting) and the report's curve reader and plots."""
import dataclasses
import json

import numpy as np
import pytest
import torch

from dstrain.data import sudoku
from models import registry
from models.hrm import evaluate, report


def test_adaptive_halting_by_hand():
    correct = np.array([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 1, 0]], dtype=bool)
    halt = np.array([[0, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 1]], dtype=bool)
    steps, right = evaluate.adaptive(correct, halt)
    assert steps.tolist() == [2, 1, 3, 3]  # first halt, else the last segment
    assert right.tolist() == [True, True, True, False]
    s = evaluate.summarise(correct, halt, groups=np.array([1, 1, 2, 2]))
    assert s["all"]["exact_1_segment"] == 0.25 and s["all"]["exact_max_segments"] == 0.75
    assert s["all"]["exact_adaptive"] == 0.75 and s["all"]["mean_act_steps"] == 2.25
    assert s["all"]["exact_by_segment"] == [0.25, 0.75, 0.75]
    assert s["by_group"][1]["mean_act_steps"] == 1.5 and s["by_group"][2]["exact_adaptive"] == 0.5
    with pytest.raises(ValueError, match="same"):
        evaluate.adaptive(correct, halt[:, :2])


def test_run_segments_agrees_with_the_model_metrics():
    cfg = registry.make_model_config("hrm", "tiny", {"halt_max_steps": 3, "seq_len": 36, "vocab_size": 8})
    torch.manual_seed(0)
    model = registry.get_spec("hrm").build(cfg)
    inputs, labels = sudoku.encode(*sudoku.generate_many(7, 20, seed=1, size=6))
    correct, halt = evaluate.run_segments(model, inputs, labels, 3, batch=4)
    assert correct.shape == halt.shape == (7, 3)
    x, y = torch.from_numpy(inputs), torch.from_numpy(labels)
    z_H = z_L = steps = None
    for t in range(3):  # the same segments by hand: exact = every blank predicted right
        _, out = model(x, y, None, z_H, z_L, steps, None)
        z_H, z_L, steps = out["z_H"], out["z_L"], out["steps"]
        by_hand = ((out["preds"] == y) | (x != sudoku.BLANK)).all(-1).numpy()
        assert np.array_equal(correct[:, t], by_hand)
        assert np.array_equal(halt[:, t], (out["q_halt"] > out["q_continue"]).numpy())
    assert int(out["metrics"]["exact_accuracy"]) == int(correct[:, -1].sum())


def test_curves_and_plots(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "train/loss": 2.0 / s, "train/exact_accuracy": s / 40, "train/steps": 4 - s / 10}
             for s in (10, 20, 30)] + [{"step": 30, "val/exact_accuracy": 0.7, "val/accuracy": 0.9}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    curve = report.read_curve(run)
    assert curve["train/steps"] == [[10, 3.0], [20, 2.0], [30, 1.0]] and curve["val/exact_accuracy"] == [[30, 0.7]]
    report.plot({"ACT": curve, "fixed": curve}, "t", tmp_path / "c.png")
    stats = {"puzzles": 2, "exact_1_segment": 0.1, "exact_max_segments": 0.9, "exact_adaptive": 0.8,
             "mean_act_steps": 3.0}
    result = {"halt_max_steps": 4, "blanks_10": {"mean_blanks": 10.0, "all": stats, "by_rounds": {2: stats}},
              "blanks_12": {"mean_blanks": 12.0, "all": stats, "by_rounds": {3: stats}}}
    report.plot_difficulty(result, "t", tmp_path / "d.png")
    assert (tmp_path / "c.png").stat().st_size > 1000 and (tmp_path / "d.png").stat().st_size > 1000


def test_run_segments_uses_the_models_halt_rule():
    cfg = registry.make_model_config("hrm", "tiny", {"halt_max_steps": 2, "seq_len": 36, "vocab_size": 8,
                                                     "halt_rule": "solved"})
    torch.manual_seed(0)
    model = registry.get_spec("hrm").build(cfg)
    with torch.no_grad():
        model.q_head.bias.copy_(torch.tensor([1.0, 5.0]))  # q_halt > 0 but below q_continue
    inputs, labels = sudoku.encode(*sudoku.generate_many(3, 20, seed=2, size=6))
    _, halt = evaluate.run_segments(model, inputs, labels, 2, batch=4)
    assert halt.all()  # "compare" would never halt these rows
    with torch.no_grad():
        model.q_head.bias.copy_(torch.tensor([-1.0, -5.0]))
    _, halt = evaluate.run_segments(model, inputs, labels, 2, batch=4)
    assert not halt.any()
    with torch.no_grad():
        model.q_head.bias.copy_(torch.tensor([1.5, 5.0]))
    _, halt = evaluate.run_segments(model, inputs, labels, 2, batch=4)
    assert halt.all()  # 1.5 > the default threshold 0
    model.config = dataclasses.replace(cfg, halt_threshold=2.0)
    _, halt = evaluate.run_segments(model, inputs, labels, 2, batch=4)
    assert not halt.any()  # 1.5 < 2


def test_report_names_a_folder_that_is_not_a_run(tmp_path, capsys):
    """A mistyped run folder gave a FileNotFoundError traceback."""
    with pytest.raises(SystemExit) as exc:
        report.main([str(tmp_path / "nope"), "--out", str(tmp_path / "r")])
    assert exc.value.code == 2
    assert "nope is not a run folder (no run_config.json there)" in capsys.readouterr().err
