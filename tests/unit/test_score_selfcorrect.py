"""SCoRe self-correction pieces: the paired interval of delta(t1,t2) against independent
computations, held-out statistics from counts, the no-guidance and answer-key modes, and the
maths warm start's wrong answers."""
import random

import pytest
import torch

from dstrain.data.tasks import make_arithmetic_tasks
from dstrain.rl import episode as ep
from dstrain.rl import score_math as sm
from dstrain.trainers import score_models as sc
from dstrain.trainers import score_warm
from dstrain.trainers.score_config import ScoreTaskConfig
from dstrain.trainers.score_step import FixedHint, eval_stats

@pytest.mark.parametrize("k, n", [(0, 10), (3, 10), (81, 263), (400, 400), (37, 400)])
def test_wilson_bounds_solve_the_score_equation(k, n):
    """Wilson's bounds are the p with |k/n - p| = z sqrt(p (1 - p) / n): checked on the equation itself."""
    z = 1.959964
    low, high = sm.wilson_interval(k, n)
    for p in (low, high):
        assert (k / n - p) ** 2 == pytest.approx(z * z * p * (1 - p) / n, abs=1e-12)
    assert low <= k / n <= high and (low < high)
    if k == 0:
        assert low == 0.0
    if k == n:
        assert high == pytest.approx(1.0)


def test_paired_interval_by_hand():
    # 2x2 table: both correct a=30, only turn 1 b=5, only turn 2 c=25, neither d=40 (n = 100)
    a, b, c, d = 30, 5, 25, 40
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n
    z = 1.959964

    def wilson(k):
        p = k / n
        mid = (2 * k + z * z) / (2 * (n + z * z))
        half = z * (k * (n - k) / n + z * z / 4) ** 0.5 / (n + z * z)
        assert mid == pytest.approx((p + z * z / (2 * n)) / (1 + z * z / n))
        return mid - half, mid + half
    (l1, u1), (l2, u2) = wilson(a + b), wilson(a + c)
    phi = (a * d - b * c) / ((a + b) * (c + d) * (a + c) * (b + d)) ** 0.5
    low = (p2 - p1) - ((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2) ** 0.5
    high = (p2 - p1) + ((u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2) ** 0.5
    diff, lo, hi = sm.paired_difference_interval(a, b, c, d)
    assert diff == pytest.approx(0.20) and lo == pytest.approx(low, abs=1e-9) and hi == pytest.approx(high, abs=1e-9)
    assert 0.05 < lo < 0.20 < hi < 0.35


def test_paired_interval_covers_the_true_difference_about_95_percent():
    """Simulated paired outcomes with a known difference: the interval covers it in ~95% of runs."""
    rng = random.Random(0)
    probs = {"a": 0.3, "b": 0.05, "c": 0.2, "d": 0.45}  # true p2 - p1 = c - b = 0.15
    covered, runs = 0, 2000
    for _ in range(runs):
        counts = dict.fromkeys(probs, 0)
        for _ in range(150):
            counts[rng.choices(list(probs), weights=list(probs.values()))[0]] += 1
        _, lo, hi = sm.paired_difference_interval(counts["a"], counts["b"], counts["c"], counts["d"])
        covered += lo <= 0.15 <= hi
    assert 0.93 <= covered / runs <= 0.975


def test_paired_interval_refuses_bad_counts():
    with pytest.raises(ValueError, match="at least one pair"):
        sm.paired_difference_interval(0, 0, 0, 0)
    with pytest.raises(ValueError, match="must not be negative"):
        sm.paired_difference_interval(1, -1, 0, 0)


def test_eval_stats_from_counts():
    # 20 tasks: 8 right at turn 1, 13 at turn 2; 6 fixed, 1 broken; 2 hints leaked
    s = eval_stats(20, 8, 13, 6, 1, 2)
    assert s["accuracy@t1"] == 0.4 and s["accuracy@t2"] == 0.65 and s["delta(t1,t2)"] == pytest.approx(0.25)
    assert s["incorrect_to_correct"] == 0.3 and s["correct_to_incorrect"] == 0.05 and s["hint_leak"] == 0.1
    diff, lo, hi = sm.paired_difference_interval(7, 1, 6, 6)  # both = 8 - 1, neither = 20 - 7 - 1 - 6
    assert diff == pytest.approx(0.25) and (s["delta_ci95_low"], s["delta_ci95_high"]) == (lo, hi)


# ---------------------------------------------------------------- guidance modes

TASKS = make_arithmetic_tasks(30, seed=5)


def test_guidance_modes_are_checked():
    assert ScoreTaskConfig(source="arithmetic", guidance="none").guidance == "none"
    with pytest.raises(ValueError, match="task.guidance must be one of model, none"):
        ScoreTaskConfig(source="arithmetic", guidance="teacher")
    with pytest.raises(ValueError, match="guidance is none"):
        ScoreTaskConfig(source="arithmetic", guidance="none", guidance_key=True)
    roles = sc.present_roles(ScoreTaskConfig(source="arithmetic", guidance="none", advantage="group"))
    assert "guidance" not in roles and "policy" in roles


def test_hint_prompt_shows_the_key_only_when_given():
    t = TASKS[0]
    plain = ep.hint_prompt(t.prompt, "#### 1")
    keyed = ep.hint_prompt(t.prompt, "#### 1", score_warm.answer_key(t))
    assert ep.KEY not in plain and f"{ep.KEY}\n{t.answer}\n" in keyed
    assert keyed.index(ep.PREVIOUS) < keyed.index(ep.KEY) < keyed.index(ep.HINT)
    code = make_program_key_task()
    assert score_warm.answer_key(code) == "\n".join(code.tests)


def make_program_key_task():
    from dstrain.data.tasks import make_program_tasks
    return make_program_tasks(1, seed=0)[0]


def test_no_guidance_runs_use_the_fixed_hint():
    from types import SimpleNamespace

    from dstrain.trainers.score_step import ScoreStep
    task = ScoreTaskConfig(source="arithmetic", guidance="none", advantage="group")
    rl = SimpleNamespace(generate=lambda *a, **k: pytest.fail("no hint may be generated"))
    runner = ScoreStep(SimpleNamespace(guidance=None), rl, None, task, None, 0, 2, 1, 0)
    hints = runner.hints(TASKS[:2], ["#### 1", "#### 2"], seed=0)
    assert [h.text for h in hints] == [score_warm.NO_HINT] * 2 and isinstance(hints[0], FixedHint)
    pol = score_warm.policy_examples(TASKS, 0)  # per task: turn 1, turn 2 with a verdict, turn 2 with NO_HINT
    assert len(pol) == 3 * len(TASKS) and all(p.reference == t.reference for p, t in zip(pol[::3], TASKS))
    assert all(f"{ep.HINT}\n{score_warm.NO_HINT}\n" in p.prompt for p in pol[2::3])
    verdicts = (score_warm.TOO_HIGH, score_warm.TOO_LOW, score_warm.CORRECT)
    assert all(any(f"{ep.HINT}\n{v}\n" in p.prompt for v in verdicts) for p in pol[1::3])


def test_maths_warm_start_answers_are_wrong_by_a_digit_step():
    rng = random.Random(0)
    for t in TASKS:
        wrong = score_warm.corrupt_maths(t, rng)
        value = int(wrong.split("####")[1])
        assert value - int(t.answer) in score_warm.MATHS_SHIFTS
        assert score_warm.verdict(t, wrong) in (score_warm.TOO_HIGH, score_warm.TOO_LOW)
    guid = score_warm.guidance_examples(TASKS, 0, key=True)
    assert all(f"{ep.KEY}\n" in g.prompt for g in guid)
    assert {g.reference for g in guid} == {score_warm.CORRECT, score_warm.TOO_HIGH, score_warm.TOO_LOW}


def test_leaks_answer():
    t = next(t for t in TASKS if int(t.answer) > 9)
    assert score_warm.leaks_answer(t, f"it should be {t.answer}.")
    assert not score_warm.leaks_answer(t, score_warm.TOO_HIGH)
    assert not score_warm.leaks_answer(t, f"it should be {t.answer}1")
    assert not score_warm.leaks_answer(make_program_key_task(), "x + 1")


def test_leaked_hints_get_the_lowest_guidance_reward():
    """A hint that states the answer is trained as reward -1, whatever turn 2 did."""
    r1, r2, leaks = torch.tensor([0., 0., 1., 0.]), torch.tensor([1., 1., 1., 0.]), torch.tensor([1., 0., 0., 0.])
    assert sm.guidance_rewards(r1, r2, leaks).tolist() == [-1.0, 1.0, 0.0, 0.0]
    assert sm.guidance_rewards(r1, r2).tolist() == [1.0, 1.0, 0.0, 0.0]


def test_benchmark_reads_held_out_and_training_curves(tmp_path):
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "score_selfcorrect.py"
    spec = importlib.util.spec_from_file_location("score_selfcorrect_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    run = tmp_path / "score"
    run.mkdir()
    records = [{"step": 0, **{f"val/{k}": v for k, v in eval_stats(10, 2, 3, 2, 1).items()}},
               {"step": 5, "train/incorrect_to_correct": 0.25, "train/correct_to_incorrect": 0.0},
               {"step": 5, "time/policy": 1.0},
               {"step": 10, **{f"val/{k}": v for k, v in eval_stats(10, 3, 6, 3, 0).items()}}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    s = bench.summarise(run)
    assert s["held_out_before"]["accuracy@t2"] == 0.3 and s["held_out_final"]["delta(t1,t2)"] == pytest.approx(0.3)
    assert s["train"]["incorrect_to_correct"] == {5: 0.25}
    assert s["val"]["incorrect_to_correct"] == {0: 0.2, 10: 0.3}
    assert "--task.guidance=none" in bench.command("no_guidance", tmp_path, [])


# ---------------------------------------------------------------- two-choice arithmetic

def test_choice_tasks_offer_the_answer_and_a_slip():
    from dstrain.data import choice_tasks as ct
    from dstrain.data.tasks import load_tasks
    from dstrain.rewards.maths import maths_reward
    tasks = ct.make_choice_tasks(200, seed=1)
    assert len({t.prompt for t in tasks}) == 200 and tasks == ct.make_choice_tasks(200, seed=1)
    firsts = 0
    for t in tasks:
        a, op, b = t.prompt.split("What is ")[1].split(":")[0].split()
        assert op == "-" and 10 <= int(b) <= int(a) <= 99
        value = int(a) - int(b)  # recomputed from the prompt
        assert 0 <= value <= 9 and t.answer == str(value) and t.reference == f"#### {value}"
        offered = ct.choices(t.prompt)
        assert str(value) in offered and abs(int(offered[0]) - int(offered[1])) in (1, 2)
        assert all(len(x) == 1 for x in offered)  # one digit each
        firsts += offered[0] == t.answer
        other = offered[1] if offered[0] == t.answer else offered[0]
        assert maths_reward(t.reference, t.answer) == 1.0 and maths_reward(f"#### {other}", t.answer) == 0.0
        assert score_warm.corrupt_maths(t, random.Random(0)) == f"#### {other}"
        assert score_warm.verdict(t, f"#### {other}") == score_warm.WRONG
        assert score_warm.verdict(t, f"#### {t.answer}") == score_warm.CORRECT
    assert 70 < firsts < 130  # the right answer is not always in the same place
    assert {t.answer for t in tasks} == {str(d) for d in range(10)}
    train, held = load_tasks({"source": "choice", "n_train": 50, "n_eval": 10, "seed": 1})
    assert [t.prompt for t in train + held] == [t.prompt for t in tasks[:60]]
    assert ct.choices("Question: What is 1 + 2?\nAnswer: ") is None


def test_distractor_stays_a_digit():
    from dstrain.data.choice_tasks import SLIPS, distractor
    for value in range(10):
        for slip in SLIPS:
            d = distractor(value, slip)
            assert 0 <= d <= 9 and abs(d - value) == abs(slip)
    assert distractor(0, -1) == 1 and distractor(9, 2) == 7 and distractor(5, -2) == 3


def _turn2_parts(prompt: str) -> tuple[str, str]:
    """(previous attempt, hint) of a turn-2 prompt, read back from its sections."""
    prev = prompt.split(f"{ep.PREVIOUS}\n")[1].split("\n\n")[0]
    hint = prompt.split(f"{ep.HINT}\n")[1].split("\n\n")[0]
    return prev, hint


def test_warm_turn2_modes():
    """verdict: turn 2 after a verdict teaches the reference (keep or flip); format: keep or switch to
    the other offered answer, half and half, whatever the verdict; the fixed-hint examples teach the
    reference in both."""
    from dstrain.data.choice_tasks import choices, make_choice_tasks
    tasks = make_choice_tasks(400, seed=3)
    for mode in score_warm.TURN2_MODES:
        ex = score_warm.policy_examples(tasks, 0, mode)
        assert len(ex) == 3 * len(tasks)
        assert all(e.reference == t.reference for e, t in zip(ex[2::3], tasks))
        kept = {score_warm.CORRECT: 0, score_warm.WRONG: 0}
        for e, t in zip(ex[1::3], tasks):
            prev, hint = _turn2_parts(e.prompt)
            assert hint == (score_warm.CORRECT if prev == t.reference else score_warm.WRONG)
            assert e.reference.split("#### ")[1] in choices(t.prompt)
            if mode == "verdict":
                assert e.reference == t.reference
            kept[hint] += e.reference == prev
        seen = {h: sum(_turn2_parts(e.prompt)[1] == h for e in ex[1::3]) for h in kept}
        assert all(150 < n < 250 for n in seen.values())
        if mode == "verdict":  # keep after CORRECT, switch after WRONG
            assert kept == {score_warm.CORRECT: seen[score_warm.CORRECT], score_warm.WRONG: 0}
        else:  # keep about half the time after either verdict
            assert all(0.35 < kept[h] / seen[h] < 0.65 for h in kept)
    with pytest.raises(ValueError, match="turn2 must be one of verdict, format"):
        score_warm.policy_examples(tasks, 0, "copy")
    with pytest.raises(ValueError, match="task.warm_turn2 must be one of verdict, format"):
        ScoreTaskConfig(source="choice", warm_turn2="copy")


def test_guidance_warm_start_is_a_multiple_of_the_policys(monkeypatch, tmp_path):
    """The trainer warm-starts the guidance model for ceil(guidance_warm_start x warm_start_steps) steps,
    on its own examples (hint prompts, verdict targets), from the policy's warm start with
    guidance_from_policy (else from the run's model), and the policy for warm_start_steps."""
    from pathlib import Path
    from types import SimpleNamespace

    from dstrain.config import load_run_config
    from dstrain.data.choice_tasks import make_choice_tasks
    from dstrain.trainers import score as score_mod
    calls = []
    monkeypatch.setattr(score_mod.prl, "warm_start",
                        lambda cfg, task, examples, world, out, log: calls.append(
                            (cfg.model.args.get("path"), task.warm_start_steps, examples, out)) or str(out))
    lrs = []
    monkeypatch.setattr(score_mod.prl, "warm_start", lambda cfg, task, *a, _inner=score_mod.prl.warm_start, **k:
                        lrs.append(task.warm_start_lr) or _inner(cfg, task, *a, **k))
    tasks = make_choice_tasks(20, seed=2)
    cfg = load_run_config(Path(__file__).resolve().parents[2] / "models/policy/recipes/score_selfcorrect_cpu.json")
    for from_policy in (False, True):
        calls.clear()
        lrs.clear()
        fake = SimpleNamespace(task=ScoreTaskConfig(source="choice", warm_start_steps=7, guidance_warm_start=0.3,
                                                    guidance_key=True, guidance_from_policy=from_policy,
                                                    warm_start_lr=3e-3, guidance_warm_start_lr=1e-3 * from_policy),
                               train_tasks=tasks, world=None, out=tmp_path, _print=print)
        policy, guidance = score_mod.ScoreTrainer._warm_start(fake, cfg)
        (p_init, p_steps, p_ex, p_out), (g_init, g_steps, g_ex, g_out) = calls
        assert (p_steps, g_steps) == (7, 3) and g_out == tmp_path / "guidance" and policy == str(tmp_path)
        assert p_init is None and g_init == (str(tmp_path) if from_policy else None)
        assert lrs == [3e-3, 1e-3 if from_policy else 3e-3]
        assert len(p_ex) == 3 * len(tasks) and {g.reference for g in g_ex} <= {score_warm.CORRECT, score_warm.WRONG}
        for g, t in zip(g_ex[::2], tasks):  # the key: each offered answer with its verdict
            a, b = t.prompt.split(": ")[1].rstrip("?").split(" or ")
            line = {x: f"#### {x} {score_warm.CORRECT if x == t.answer else score_warm.WRONG}" for x in (a, b)}
            assert f"{ep.KEY}\n{line[a]}\n{line[b]}\n" in g.prompt
    calls.clear()
    fake.task = ScoreTaskConfig(source="choice", warm_start_steps=7, guidance="none")
    assert score_mod.ScoreTrainer._warm_start(fake, cfg)[1] is None and len(calls) == 1


@pytest.mark.parametrize("override, message", [
    ("--task.guidance_warm_start=0", "task.guidance_warm_start must be positive"),
    ("--task.guidance_warm_start=-1.5", "task.guidance_warm_start must be positive"),
    ("--task.warm_turn2=copy", "task.warm_turn2 must be one of verdict, format"),
    ("--task.guidance_warm_start_lr=-1", "task.guidance_warm_start_lr must not be negative"),
])
def test_selfcorrect_recipe_refuses_bad_warm_start_settings(override, message):
    from pathlib import Path

    from dstrain.config import ConfigError, load_run_config
    recipe = Path(__file__).resolve().parents[2] / "models" / "policy" / "recipes" / "score_selfcorrect_cpu.json"
    with pytest.raises(ConfigError, match=message):
        load_run_config(recipe, [override])


def test_diagnostic_counts_offered_answers():
    import importlib.util
    from pathlib import Path

    from dstrain.data.choice_tasks import make_choice_tasks
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "score_diagnose.py"
    spec = importlib.util.spec_from_file_location("score_diagnose", path)
    diag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diag)
    tasks = make_choice_tasks(4, seed=0)
    offered = [tuple(t.prompt.split(": ")[1].rstrip("?").split(" or ")) for t in tasks]
    texts = [f"#### {offered[0][0]}", f"#### {offered[1][1]}", "#### 12", "no answer"]
    assert diag.offered_fraction(tasks, texts) == 0.5
