"""Pieces every policy-RL trainer (GRPO, SCoRe) shares: tasks, schedule, warm start,
rollouts scored by the verifiers, and pass@k evaluation.

The policy model family is looked up in ``models.registry``; its ``SPEC.rl`` toolkit
(generate, pack, token_logprobs, token_entropy, build, load_tokenizer, reference)
is all a trainer uses, so any causal-LM family that provides one plugs in.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain import runtime
from dstrain.config import ConfigError, RunConfig
from dstrain.rl.grpo_math import pass_at_k
from dstrain.trainers.grpo_config import PolicyTaskConfig

WARM_START_DIR = "warm_start"
WARM_START_DONE = "WARM_START_COMPLETE"


def policy_toolkit(cfg: RunConfig):
    """(spec, model config, toolkit) of the run's policy model; a ConfigError if it is no policy."""
    from models import registry
    spec = registry.get_spec(cfg.model.name)
    if getattr(spec, "rl", None) is None:
        raise ConfigError("run config", "model.name",
                          f"model {cfg.model.name!r} is not a policy (no RL toolkit); use a policy model such "
                          f"as 'policy'")
    return spec, registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args), spec.rl


def export_policy_checkpoint(ckpt: str | Path, out: str | Path) -> Path | None:
    """``dstrain export`` of a policy run into a folder: a Hugging Face checkpoint (config, weights under
    transformers' names, tokenizer, generation config) that ``--model.args.path`` loads; None (nothing
    written) when the run's model is no policy."""

    from dstrain.checkpoint import consolidated_state_dict, resolve_checkpoint
    from models import registry
    root, tag = resolve_checkpoint(ckpt)
    run_cfg = json.loads((Path(root) / tag / "run_config.json").read_text())
    model = run_cfg.get("model", {})
    spec = registry.get_spec(model.get("name", ""))
    if getattr(spec, "rl", None) is None or not hasattr(spec.rl, "export_pretrained"):
        return None
    state, _ = consolidated_state_dict(ckpt)
    args = dict(model.get("args") or {})
    if args.get("path"):
        args["path"] = run_path_here(args["path"], Path(root).parent)
    mcfg = registry.make_model_config(model["name"], model.get("size"), args)
    write_folder_whole(Path(out), lambda folder: spec.rl.export_pretrained(state, mcfg, str(folder)))
    return Path(out)


def write_folder_whole(out: Path, write) -> None:
    """``write(folder)`` into a folder beside ``out`` (``.NAME.partial``), then moved into place, so that an
    export killed halfway (Ctrl-C, the scheduler's kill, a full disk) never leaves ``out`` looking like a whole
    Hugging Face checkpoint. Before, ``save_pretrained`` wrote straight into ``out``: a kill after
    ``config.json`` left a folder that looked like one (weights cut short, or no tokenizer), which
    ``--model.args.path`` failed on only once loading it. A new or empty ``out`` is renamed into place at once;
    into one that holds files (an earlier export) the new files are moved one by one, its ``config.json``
    removed first and the new one moved last: until then the folder is no checkpoint (a kill there is "not a
    Hugging Face checkpoint directory"), and every file in it is whole. Files of ``out`` that the export does
    not write stay."""
    import shutil
    out = Path(os.path.abspath(out))  # ("." has no name to put beside it)
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # an earlier export killed halfway
    try:
        partial.mkdir(parents=True)
        write(partial)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if not out.exists():
            os.replace(partial, out)
            return
        names = sorted((p.name for p in partial.iterdir()), key=lambda name: name == "config.json")
        (out / "config.json").unlink(missing_ok=True)
        for name in names:
            if (out / name).is_dir() and not (out / name).is_symlink():
                shutil.rmtree(out / name)
            os.replace(partial / name, out / name)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def run_path_here(path: str, run_dir: Path) -> str:
    """``path``, a folder the run recorded (made absolute: its warm start, ``with_model_path``), or its copy in
    ``run_dir`` when the run's folder was moved or copied (another machine, another ``output.dir``) and ``path``
    is gone: before, ``dstrain export`` of such a run failed on "path ... is not a Hugging Face checkpoint
    directory" although the run's folder held it. A path found in neither place is returned as it is."""
    if os.path.isdir(path):
        return path
    parts = Path(path).parts
    for k in range(1, min(4, len(parts))):  # warm_start, guidance/warm_start, ...: within the run's folder
        here = run_dir.joinpath(*parts[-k:])
        if (here / "config.json").is_file():
            import sys
            print(f"dstrain: note: {path}, recorded by the run, is gone; using {here} in the run's folder",
                  file=sys.stderr, flush=True)
            return str(here)
    return path


def load_task_sets(task: PolicyTaskConfig, seed: int) -> tuple[list, list]:
    """(train tasks, held-out tasks) as the task section names them."""
    from dstrain.data import tasks as T
    try:
        spec = {"source": task.source, "split": task.train_split, "eval_split": task.eval_split,
                "n_train": task.n_train or None, "n_eval": task.n_eval, "seed": seed}
        spec.update({k: v for k, v in (("path", task.path), ("eval_path", task.eval_path)) if v})
        if task.source == "mbpp":
            spec.update(max_reference_chars=getattr(task, "mbpp_max_reference_chars", 0),
                        signature=getattr(task, "mbpp_signature", False))
        return T.load_tasks(spec)
    except (FileNotFoundError, ValueError) as err:  # a missing or malformed task file
        raise ConfigError("run config", "task.path", str(err)) from None
    except PermissionError as err:  # (root reads anything: a user's chmod 000 file, or one of another user's)
        raise ConfigError("run config", "task.path" if err.filename != task.eval_path else "task.eval_path",
                          f"{err.filename}: cannot be read ({err.strerror}); make it readable (chmod a+r)") from None


def task_tokenizer(rl, model_cfg, task: PolicyTaskConfig):
    """The policy's tokenizer with the task's ``chat_template`` choice applied (a ConfigError
    when it asks for a template the tokenizer lacks)."""
    from models.policy.tokenizer import use_chat_template
    try:
        tok = rl.load_tokenizer(model_cfg)
    except ValueError as err:  # no EOS token anywhere, ids past the embedding: one line, not a traceback
        raise ConfigError("run config", "model.args.path", str(err)) from None
    try:
        return use_chat_template(tok, getattr(task, "chat_template", "off"))
    except ValueError as err:
        raise ConfigError("run config", "task.chat_template", str(err)) from None


def step_prompts(n_tasks: int, step: int, prompts_per_step: int, seed: int) -> list[int]:
    """Task indices of ``step``: consecutive slices of per-epoch permutations (pure; resume-exact)."""
    out: list[int] = []
    start = step * prompts_per_step
    while len(out) < prompts_per_step:
        epoch, offset = divmod(start + len(out), n_tasks)
        order = list(range(n_tasks))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.extend(order[offset:offset + prompts_per_step - len(out)])
    return out


def completion_target(task) -> str:
    """The reference completion, ending with the task's first stop string (so stopping is learnt)."""
    ref = task.reference
    if task.stop and not any(ref.endswith(s) for s in task.stop):
        ref += task.stop[0]
    return ref


def supervised_batch(tokenizer, prompts: list[str], targets: list[str], with_mask: bool = False) -> tuple:
    """(input_ids, labels): prompt + target, right-padded; labels are -100 except on target tokens. With
    ``with_mask``, also the attention mask of input_ids (1 on the rows' real tokens, 0 on their padding)."""
    from models.policy.tokenizer import encode_continuation, encode_prompt

    rows = []
    for p, t in zip(prompts, targets):
        pi = encode_prompt(tokenizer, p)
        ti = encode_continuation(tokenizer, t)
        rows.append((pi + ti, [-100] * len(pi) + ti))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in rows])
    labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in rows])
    out = ids[:, :-1].contiguous(), labels[:, 1:].contiguous()
    if not with_mask:
        return out
    lengths = torch.tensor([len(x) for x, _ in rows])
    return (*out, (torch.arange(width - 1)[None, :] < lengths[:, None]).long())


def router_aux(rl, module) -> tuple[torch.Tensor | None, float]:
    """(router load-balancing loss of ``module``'s last training forward, or None; its coefficient): what a trainer
    adds, times the coefficient, to the loss of a logits-returning forward (a mixture of experts whose coefficient
    is above 0; ``model.args.router_aux_loss_coef``). ``(None, 0.0)`` for a dense model or a toolkit without it."""
    take = getattr(rl, "take_router_aux", None)
    return take(module) if take is not None else (None, 0.0)


def supervised_step(model, opt, tokenizer, batch) -> float:
    """One AdamW step of teacher forcing on ``batch`` (tasks: prompt -> reference completion),
    gradient norm clipped to 1; returns the loss (with a mixture of experts' router load-balancing term where its
    coefficient is above 0: computed over the rows' real tokens, their attention mask given to the model)."""
    x, y, attn = supervised_batch(tokenizer, [t.prompt for t in batch], [completion_target(t) for t in batch],
                                  with_mask=True)
    aux = getattr(model, "router_aux_coef", 0.0) > 0  # a dense model's forward is left as it was (no mask)
    loss = model(x, y, attention_mask=attn) if aux else model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def warm_start(cfg: RunConfig, task: PolicyTaskConfig, tasks: list, world: runtime.World, out: Path,
               log=print) -> str | None:
    """Supervised phase on the tasks' references, once (rank 0, plain AdamW); returns the
    checkpoint folder every rank then loads (None when ``warm_start_steps`` is 0).

    A folder that already holds a finished warm start (resume, or a second run into the same
    output folder) is reused as is.
    """
    if not task.warm_start_steps:
        return None
    folder = out / WARM_START_DIR
    error = None
    if world.is_main and not (folder / WARM_START_DONE).is_file():
        error = _run_warm_start(cfg, task, tasks, folder, log)
    error = runtime.broadcast_object(error)  # also the barrier: the others load the warm start's files
    if isinstance(error, tuple):  # ("stopped", step, signal): a stop signal came during it
        from dstrain import rank_exit
        line, code = rank_exit.stopped_in_line(
            f"in the warm start at step {error[1]} of {task.warm_start_steps}", error[2],
            f"the warm start is not saved; a launch into {out} (--resume too) starts it again")
        if world.is_main:  # torchrun --max-restarts: its restarts leave at once, as after a stop in training
            from dstrain import elastic
            elastic.note_stopped_job(out, code, 0, None)
        raise rank_exit.StoppedBeforeTraining(line, code)
    if error is not None:
        from dstrain.config import RunFolderError
        raise RunFolderError(error)
    return str(folder)


def _run_warm_start(cfg: RunConfig, task: PolicyTaskConfig, tasks: list, folder: Path, log):
    """Rank 0's supervised phase, written to ``folder``; the one line when the disk cannot hold it (a full disk
    or quota: before, rank 0's ``OSError`` traceback with its peers waiting in a barrier, and the half-written
    weights left to fill the disk); ``("stopped", step, signal)`` when a stop signal (Ctrl-C to the launch, a
    scheduler's SIGTERM) came, checked after each step (before, the signal waited for the end of the warm start,
    minutes, and for the first RL step); else None."""
    from dstrain import rank_exit
    _, mcfg, rl = policy_toolkit(cfg)
    runtime.seed_everything(cfg.train.seed)
    model = rl.build(mcfg)
    tokenizer = task_tokenizer(rl, mcfg, task)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=task.warm_start_lr, weight_decay=0.0)
    rng = random.Random(cfg.data.seed + 17)
    start, losses = time.perf_counter(), []
    for step in range(task.warm_start_steps):
        batch = [tasks[rng.randrange(len(tasks))] for _ in range(task.warm_start_batch)]
        losses.append(supervised_step(model, opt, tokenizer, batch))
        if rank_exit.PENDING_STOP[0]:  # kept for the trainer's StopFlag, which does not exist yet
            return ("stopped", step + 1, rank_exit.PENDING_STOP[0])
        if (step + 1) % max(1, task.warm_start_steps // 5) == 0:
            log(f"warm start {step + 1}/{task.warm_start_steps}: loss {sum(losses) / len(losses):.3f}")
            losses = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        rl.save_pretrained(model, str(folder), tokenizer)
        (folder / WARM_START_DONE).write_text(f"{task.warm_start_steps} steps, "
                                              f"{time.perf_counter() - start:.1f} s\n")
    except OSError as err:
        from dstrain.trainers.run_files import disk_full_problem
        line = disk_full_problem(err, folder, "the warm start",
                                 f"its {task.warm_start_steps} supervised steps are lost, nothing else was trained "
                                 "(its partial files are removed)")
        if line is None:
            raise
        import shutil
        shutil.rmtree(folder, ignore_errors=True)  # no marker: redone next time; its space is given back now
        return line
    return None


def with_model_path(cfg: RunConfig, path: str) -> RunConfig:
    """``cfg`` with the policy loaded from ``path`` (the warm-started weights), made absolute: the run's saved
    config names it for ``dstrain export`` and ``--resume``, which may run from another directory."""
    model = dataclasses.replace(cfg.model, args={**cfg.model.args, "path": os.path.abspath(path)})
    return dataclasses.replace(cfg, model=model)


@dataclass
class Rollout:
    """One rank's sampled completions, packed for training, and their rewards."""

    completions: list
    batch: dict
    rewards: torch.Tensor
    statuses: list[str]
    gen_seconds: float
    gen_tokens: int
    score_seconds: float = 0.0
    """Time the verifiers took (the sandbox, for code)."""


def score(tasks: list, texts: list[str], pool, partial_credit: bool) -> tuple[list[float], list[str]]:
    """(reward, verifier status) of each completion; code runs in the sandbox ``pool``."""
    from dstrain.rewards.code import evaluate_tasks
    results = evaluate_tasks(tasks, texts, pool)
    return [r.reward(partial_credit) for r in results], [r.status for r in results]


def rollout(model, tokenizer, rl, tasks: list, task: PolicyTaskConfig, pool, seed: int,
            prompts: list[str] | None = None) -> Rollout:
    """Sample one completion per entry of ``tasks`` (their prompts, or ``prompts``) and score it."""
    stops = tuple(dict.fromkeys(s for t in tasks for s in t.stop))
    start = time.perf_counter()
    completions = rl.generate(model, tokenizer, prompts or [t.prompt for t in tasks], num_samples=1,
                              temperature=task.temperature, top_p=task.top_p,
                              max_new_tokens=task.max_new_tokens, stop=stops, seed=seed)
    gen_seconds = time.perf_counter() - start
    rewards, statuses = score(tasks, [c.text for c in completions], pool, task.partial_credit)
    return Rollout(completions, rl.pack(completions, tokenizer.pad_token_id),
                   torch.tensor(rewards, dtype=torch.float32), statuses, gen_seconds,
                   sum(len(c.completion_ids) for c in completions),
                   time.perf_counter() - start - gen_seconds)


@torch.no_grad()
def evaluate_pass_at_k(model, tokenizer, rl, tasks: list, task: PolicyTaskConfig, pool,
                       world: runtime.World, seed: int) -> dict[str, float]:
    """pass@1 (greedy) and pass@k (``eval_samples`` sampled, unbiased estimator) over ``tasks``,
    split over ranks and summed; also the mean sampled reward."""
    mine = tasks[world.rank::world.world_size]
    sums = torch.zeros(4, dtype=torch.float64)  # tasks, greedy passes, pass@k sum, sampled reward sum
    # Every rank calls generate, even with no tasks: under ZeRO-3 it gathers parameters collectively.
    stops = tuple(dict.fromkeys(s for t in tasks for s in t.stop))
    greedy = rl.generate(model, tokenizer, [t.prompt for t in mine], greedy=True,
                         max_new_tokens=task.max_new_tokens, stop=stops)
    rewards, _ = score(mine, [c.text for c in greedy], pool, False) if mine else ([], [])
    sums[0] += len(mine)
    sums[1] += sum(r == 1.0 for r in rewards)
    if task.eval_k:
        n = task.eval_samples
        sampled = rl.generate(model, tokenizer, [t.prompt for t in mine], num_samples=n,
                              temperature=task.temperature, top_p=task.top_p,
                              max_new_tokens=task.max_new_tokens, stop=stops, seed=seed)
        if mine:
            rewards, _ = score([t for t in mine for _ in range(n)], [c.text for c in sampled], pool, False)
            for i in range(len(mine)):
                got = rewards[i * n:(i + 1) * n]
                sums[2] += pass_at_k(n, sum(r == 1.0 for r in got), task.eval_k)
                sums[3] += sum(got) / n
    sums = runtime.all_reduce(sums)
    count = max(sums[0].item(), 1.0)
    stats = {"pass@1": sums[1].item() / count, "tasks": sums[0].item()}
    if task.eval_k:
        stats[f"pass@{task.eval_k}"] = sums[2].item() / count
        stats["sampled_reward"] = sums[3].item() / count
    return stats


def frozen_model_note(role: str, ref, how: str) -> str:
    """One plan.txt line: what a frozen model (GRPO's reference, SCoRe's frozen roles) got of the run's
    DeepSpeed JSON. ``ref`` has ``.engine`` (an inference-only DeepSpeed engine, or None) and ``.module``."""
    engine = getattr(ref, "engine", None)
    if engine is None:
        module = getattr(ref, "module", ref)
        p = next(module.parameters(), None)
        where = f"{p.device} in {str(p.dtype).replace('torch.', '')}" if p is not None else "no parameters"
        return (f"{role}: a plain frozen module ({how}) on {where}; the DeepSpeed JSON, its ZeRO stage, "
                "precision, optimizer and scheduler apply to the trained engines only")
    stage = engine.zero_optimization_stage()
    offload = " with its parameters offloaded to the CPU" if stage == 3 and engine.zero_offload_param() else ""
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    return (f"{role}: an inference-only DeepSpeed engine ({how}) at ZeRO stage {stage}{offload}, {precision}, "
            f"micro-batch {engine.train_micro_batch_size_per_gpu()}; of the DeepSpeed JSON it takes the ZeRO-3 "
            "choice and the precision (no optimizer, scheduler or other ZeRO keys)")


def weights_note(cfg: RunConfig, precision: str) -> str | None:
    """One plan line about a checkpoint saved in 16 bits (``config.json`` dtype bf16/fp16), else None: it is loaded
    as fp32 master weights and trained in ``precision``; ``dstrain export`` writes it back in its own dtype. A bf16
    checkpoint trained in fp16 gets a caution: activations a model learnt in bf16's range may overflow fp16's."""
    _, mcfg, rl = policy_toolkit(cfg)
    dtype = getattr(rl, "checkpoint_dtype", lambda _: None)(mcfg)
    if dtype is None or dtype == torch.float32:
        return None
    name = str(dtype).replace("torch.", "")
    from models.policy.hf_files import EXPORT_DTYPE_KEY, read_config
    held = (f"holds the fp32 weights dstrain wrote from a {name} checkpoint (config.json {EXPORT_DTYPE_KEY})"
            if read_config(mcfg.path).get(EXPORT_DTYPE_KEY) else f"holds {name} weights (config.json dtype)")
    line = (f"policy weights: {mcfg.path} {held}; loaded as fp32 master weights "
            f"and trained in {precision}; dstrain export: written back in {name}")
    if precision == "fp16" and dtype == torch.bfloat16:
        line += (". Caution: a model trained in bf16 may overflow fp16's range (65504) in its activations "
                 "(inf/NaN loss): prefer --deepspeed.precision=bf16 or fp32")
    return line


def generation_note(cfg: RunConfig) -> str | None:
    """One plan line naming the checkpoint's own ``generation_config.json`` settings that dstrain does not apply
    (its sampling settings, ``suppress_tokens``, ``bad_words_ids``, forced tokens...), else None."""
    _, mcfg, _ = policy_toolkit(cfg)
    from models.policy.hf_files import ignored_generation_settings
    found = ignored_generation_settings(getattr(mcfg, "path", "") or "")
    if not found:
        return None
    listed = ", ".join(f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in found.items())
    line = (f"generation: {mcfg.path}/generation_config.json sets {listed}; dstrain does not apply them: completions "
            "are sampled from softmax(logits / task.temperature) within task.top_p for task.max_new_tokens (no "
            "top-k, no repetition penalty), and only its eos_token_id is used")
    if any(k in found for k in ("suppress_tokens", "begin_suppress_tokens", "bad_words_ids")):
        line += "; the ids it suppresses or bans can be sampled"
    return line


_ROTARY_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "rotary_dim", "rotary_pct", "rotary_emb_base",
                "partial_rotary_factor")


def position_note(cfg: RunConfig) -> str | None:
    """One plan line where a rotary checkpoint (Llama, Qwen, Mistral...) may be run past the length it was trained
    for (``config.json`` ``max_position_embeddings``), else None. Rotary positions have no table to run out of, so
    it works, but the quality past that length is untested. Only ``task.max_new_tokens`` is known here (the
    longest prompt is not, before the data is read): the line says whether every completion passes the length
    or only those after a prompt longer than what ``task.max_new_tokens`` leaves of it (named when that is
    under half of it)."""
    _, mcfg, _ = policy_toolkit(cfg)
    path = getattr(mcfg, "path", "") or ""
    if not path:
        return None
    from dstrain.trainers import task_config
    from models.policy.hf_files import read_config, text_config
    try:
        conf = text_config(read_config(path))
    except (OSError, ValueError):
        return None
    limit, new = conf.get("max_position_embeddings"), getattr(task_config(cfg), "max_new_tokens", None)
    if not isinstance(limit, int) or not isinstance(new, int) or not any(k in conf for k in _ROTARY_KEYS):
        return None
    room = limit - new
    if room * 2 >= limit:
        return None
    head = (f"positions: {path}/config.json max_position_embeddings={limit} (rotary positions) and "
            f"task.max_new_tokens={new}: ")
    what = ("every completion runs past the length the checkpoint was trained for" if room < 1 else
            f"a completion after a prompt longer than {room} tokens runs past the length the checkpoint was "
            "trained for (prompt lengths are not known before the data is read)")
    return head + what + ("; generation and training go on (rotary positions have no table to run out of) but the "
                          "model's quality past that length is untested: lower task.max_new_tokens, or shorten "
                          "the prompts, to stay within it")


def experts_note(cfg: RunConfig) -> str | None:
    """One plan line for a mixture-of-experts checkpoint (Mixtral, Qwen-MoE, OLMoE...), else None: the parameters in
    all and those a token runs through (what FLOPs and MFU count), the experts module ZeRO-3 gathers whole, and
    whether the router's load-balancing loss is added to the training losses and with what coefficient
    (``model.args.router_aux_loss_coef``, by default the config's where ``output_router_logits`` is true)."""
    _, mcfg, rl = policy_toolkit(cfg)
    path = getattr(mcfg, "path", "") or ""
    from models.policy.hf_files import read_config, text_config
    from models.policy.moe import moe_fields
    fields = moe_fields(text_config(read_config(path))) if path else None
    if fields is None:
        return None
    from models.policy.moe import expert_modules, expert_params
    with torch.device("meta"):
        model = rl.build(mcfg)
    total = model.num_params()
    experts, active = expert_params(model.hf)
    gathered = max((sum(p.numel() for p in w) for _, w in expert_modules(model.hf)), default=0)
    k = fields["per_token"] or "some"
    line = (f"experts: {path} is a mixture of experts ({k} of {fields['experts']} experts per token): "
            f"{total:,} parameters, {total - experts + active:,} of them used per token (FLOPs and MFU count "
            f"these); ZeRO-3 gathers each layer's experts as one module ({gathered:,} parameters)")
    from models.policy.moe import computes_router_loss
    setting = getattr(mcfg, "router_aux_loss_coef", None)
    coef = model.router_aux_coef  # the config's only where transformers' forward computes the loss
    asked = (f"config.json output_router_logits={str(fields['output_router_logits']).lower()}, "
             f"router_aux_loss_coef={fields['router_aux_loss_coef']}")
    if not computes_router_loss(model.hf):
        asked = f"transformers' {type(model.hf).__name__} computes no load-balancing loss"
    if coef > 0:
        whose = f"model.args.router_aux_loss_coef; {asked}" if setting is not None else asked
        line += (f". The router's load-balancing loss is added to the training loss with coefficient {coef:g} "
                 f"({whose}), over each training forward's real tokens, as transformers adds it; logged as "
                 "train/router_aux_loss (without the coefficient)")
    else:
        why = "model.args.router_aux_loss_coef=0" if setting is not None else asked
        line += (f". The router's load-balancing loss is not added (coefficient 0: {why}), so the routers are "
                 "trained by the trainer's loss alone; " + ("model.args.router_aux_loss_coef sets one"
                                                            if computes_router_loss(model.hf) else
                                                            "model.args.router_aux_loss_coef is refused for it"))
    return line


def plan_notes(cfg: RunConfig, plan) -> list[str]:
    """``dstrain plan``'s notes for a policy run (the trainers' ``plan_notes`` hook)."""
    return [n for n in (weights_note(cfg, plan.precision), generation_note(cfg), position_note(cfg),
                        experts_note(cfg)) if n]


def append_plan_note(out: Path, world, line: str) -> None:
    """Rank 0: ``line`` printed and added to ``out/plan.txt``."""
    if world.is_main:
        print(line, flush=True)
        try:
            with open(out / "plan.txt", "a") as fh:
                fh.write(line + "\n")
        except OSError as err:  # a full disk: the note is said above; not a traceback that ends rank 0
            import sys
            print(f"dstrain: warning: {out / 'plan.txt'} could not be appended to ({err.strerror or err}); "
                  "the note above is not in it", file=sys.stderr, flush=True)
