"""GRPO trainer pieces that need no process group: task config, prompt schedule, SFT batches."""
import pytest
import torch

from dstrain.config import ConfigError, load_run_config
from dstrain.trainers import policy_rl as prl
from dstrain.trainers.grpo_config import PolicyTaskConfig
from tests.dist.harness import ROOT

RECIPE = ROOT / "models" / "policy" / "recipes" / "grpo_debug.json"


def test_recipe_loads_typed():
    cfg = load_run_config(RECIPE)
    assert cfg.trainer == "grpo" and cfg.model.name == "policy"


@pytest.mark.parametrize("override, key", [
    ("--task.num_generations=1", "task.num_generations"),
    ("--task.loss_type=mean", "task.loss_type"),
    ("--task.reference=gpu", "task.reference"),
    ("--task.source=mbpp", "task.path"),
    ("--task.epsilon=1.5", "task.epsilon"),
    ("--task.temperature=0", "task.temperature"),
    ("--task.eval_samples=2", "task.eval_samples"),
    ("--task.unknown=1", "task.unknown"),
])
def test_bad_task_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_run_config(RECIPE, [override])


def test_clip_high_defaults_to_epsilon():
    assert PolicyTaskConfig(epsilon=0.2).clip_high == 0.2
    assert PolicyTaskConfig(epsilon=0.2, epsilon_high=0.28).clip_high == 0.28


def test_step_prompts_cover_each_epoch_once_and_are_pure():
    n, per = 10, 4
    seen = [i for step in range(5) for i in prl.step_prompts(n, step, per, seed=3)]  # 20 = two epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert prl.step_prompts(n, 3, per, seed=3) == seen[12:16]
    assert prl.step_prompts(n, 0, per, seed=4) != prl.step_prompts(n, 0, per, seed=3)


class _Tok:
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_supervised_batch_masks_the_prompt():
    x, y = prl.supervised_batch(_Tok(), ["ab", "c"], ["X\n", "YZ"])
    # row 0: a b X \n ; row 1: c Y Z <pad>
    assert x.tolist() == [[97, 98, 88], [99, 89, 90]]
    assert y.tolist() == [[-100, 88, 10], [89, 90, -100]]


def test_completion_target_appends_the_stop_string():
    from dstrain.data.tasks import make_program_tasks
    task = make_program_tasks(1, 0)[0]
    assert prl.completion_target(task) == task.reference + "\n"


def test_non_policy_model_is_refused():
    with pytest.raises(ConfigError, match="trainer 'grpo' trains a policy model"):  # when the config loads
        load_run_config(RECIPE, ["--model.name=gpt", "--model.size=tiny"])
    cfg = load_run_config(ROOT / "models" / "gpt" / "recipes" / "tiny.json")
    with pytest.raises(ConfigError, match="not a policy"):
        prl.policy_toolkit(cfg)


def test_rollout_scores_in_sample_order():
    """rollout keeps completions, rewards and packed rows aligned with the tasks given."""
    from dstrain.data.tasks import make_program_tasks
    from dstrain.rewards import SandboxPool
    from models.policy import SPEC, Completion
    tasks = make_program_tasks(3, 1)
    answers = [tasks[0].reference, "0 +", tasks[2].reference]

    class FakeRL:
        pack = staticmethod(SPEC.rl.pack)

        @staticmethod
        def generate(model, tok, prompts, **kw):
            return [Completion(i, 0, [1, 2], [ord(c) for c in answers[i]], answers[i], True) for i in range(3)]

    with SandboxPool(2) as pool:
        roll = prl.rollout(None, _Tok(), FakeRL, tasks, PolicyTaskConfig(), pool, seed=0)
    assert roll.rewards.tolist() == [1.0, 0.0, 1.0]
    assert roll.batch["input_ids"].shape[0] == 3
    assert torch.equal(roll.batch["completion_mask"].sum(1), torch.tensor([len(a) for a in answers]))
