"""What a local Hugging Face checkpoint folder holds, read from its files before anything is built.

:func:`checkpoint_problem` is called when the run config is checked (``PolicyConfig.validate``),
so a folder that cannot load is refused in one line before any rank starts, instead of by
transformers inside every rank (or, for custom code, by an interactive prompt).
:func:`declared_dtype` is the dtype the checkpoint's weights were saved in.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
"""The single-file weight names ``from_pretrained`` looks for; each may instead be sharded
(``<name>.index.json`` plus the shards its ``weight_map`` names)."""


def read_config(path: str) -> dict:
    """The checkpoint's ``config.json`` (``{}`` where it is missing or unreadable)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def text_config(config: dict) -> dict:
    """The language model's part of a ``config.json`` (a multimodal one nests it in ``text_config``)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def weights_problem(path: str) -> str | None:
    """Why the folder ``path`` has no complete set of weight files, else None."""
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return None
        index = os.path.join(path, name + ".index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return f"its shard index {name}.index.json is not readable (no weight_map)"
            absent = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
            if absent:
                return (f"{len(absent)} of the {len(shards)} weight shards that {name}.index.json names "
                        f"are missing ({', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''}): an "
                        "incomplete copy")
            return None
    return ("it holds no weights (model.safetensors, pytorch_model.bin, or a sharded "
            "model.safetensors.index.json with its shards)")


def _custom_code_problem(config: dict) -> str | None:
    """Why the architecture needs the checkpoint's own Python code, else None.

    A config with ``auto_map`` whose ``model_type`` the installed transformers knows (with a causal-LM
    class) loads with transformers' own code, as ``from_pretrained`` does without ``trust_remote_code``.
    """
    auto_map = config.get("auto_map")
    if not auto_map:
        return None
    model_type = config.get("model_type")
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        native = model_type in CONFIG_MAPPING and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        native = False
    if native:
        return None
    code = auto_map.get("AutoModelForCausalLM") if isinstance(auto_map, dict) else None
    return (f"its architecture (model_type {model_type!r}{f', {code}' if code else ''}) is defined by Python "
            "code shipped in the checkpoint (auto_map in config.json), which needs trust_remote_code: dstrain "
            "never runs a checkpoint's own code and downloads nothing; use a checkpoint of an architecture the "
            "installed transformers has")


def _custom_tokenizer_problem(path: str) -> str | None:
    """Why the tokenizer needs the checkpoint's own code (``auto_map`` in ``tokenizer_config.json`` and a
    ``tokenizer_class`` the installed transformers lacks), else None."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    auto_map = cfg.get("auto_map") if isinstance(cfg, dict) else None
    if not (isinstance(auto_map, dict) and auto_map.get("AutoTokenizer")):
        return None
    cls = str(cfg.get("tokenizer_class") or "")
    import transformers
    if cls and (hasattr(transformers, cls) or hasattr(transformers, cls.removesuffix("Fast"))):
        return None
    return (f"its tokenizer ({cls or 'no tokenizer_class'}) is defined by Python code shipped in the checkpoint "
            "(auto_map in tokenizer_config.json), which needs trust_remote_code: dstrain never runs a checkpoint's "
            "own code and downloads nothing; use a checkpoint whose tokenizer the installed transformers has")


_HEADLESS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
"""Class-name endings of checkpoints whose head is no next-token head (reward models, classifiers)."""


def _head_problem(config: dict) -> str | None:
    """Why ``config.json`` ``architectures`` says the weights are no causal LM (a reward model or classifier: a
    ``score``/``classifier`` head, no ``lm_head``), else None. transformers would load the body and a random
    output head, with a warning."""
    archs = config.get("architectures")
    named = [a for a in archs if isinstance(a, str) and a.endswith(_HEADLESS)] if isinstance(archs, list) else []
    if not named or len(named) < len(archs):
        return None
    return (f"config.json architectures names {', '.join(named)}: a classifier or reward model, whose head scores "
            "a sequence instead of predicting the next token; loaded as a causal LM its output head would start "
            "random. Point --model.args.path at the causal LM (a reward model belongs to the reward, not the policy)")


def eos_setting(path: str, name: str):
    """``eos_token_id`` of the checkpoint's ``name`` (``generation_config.json`` or ``config.json``): None where the
    file or the key is missing or unreadable (see :func:`eos_setting_problem`), else an int or a list of ints."""
    try:
        with open(os.path.join(path, name)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    value = data.get("eos_token_id") if isinstance(data, dict) else None
    return value if _is_eos_setting(value) else None


def _is_eos_setting(value) -> bool:
    """Whether ``value`` is a token id or a non-empty list of token ids."""
    ids = value if isinstance(value, list) else [value]
    return bool(ids) and all(isinstance(v, int) and not isinstance(v, bool) for v in ids)


def eos_setting_problem(path: str) -> str | None:
    """Why the end-of-sequence ids a checkpoint names cannot be read, else None: ``generation_config.json`` that is
    no JSON object, or an ``eos_token_id`` (there or in ``config.json``) that is neither an id nor a list of ids
    (``[null, 2]``, ``"2"``). A completion ends at every id of that setting, so it is read, never guessed."""
    generation = {}
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        try:
            with open(os.path.join(path, "generation_config.json")) as f:
                generation = json.load(f)
        except (OSError, ValueError) as err:
            return f"generation_config.json is not readable JSON ({err}): fix or remove the file"
        if not isinstance(generation, dict):
            return "generation_config.json is not a JSON object: fix or remove the file"
    for name, data in (("generation_config.json", generation), ("config.json", read_config(path))):
        value = data.get("eos_token_id")
        if value is not None and value != [] and not _is_eos_setting(value):
            return (f"{name} eos_token_id is {json.dumps(value)}: it must be a token id or a list of token ids "
                    "(the ids that end a completion); fix the file")
    return None


def checkpoint_problem(path: str, weights: bool = True) -> str | None:
    """Why the folder ``path`` (which has a ``config.json``) cannot be loaded as a policy, else None:
    no weights or an incomplete sharded copy (``weights``: checked), an architecture or tokenizer that exists only
    as custom code, or the weights of a classifier (``architectures``)."""
    config = read_config(path)
    return ((weights_problem(path) if weights else None) or _custom_code_problem(config) or _custom_tokenizer_problem(path)
            or _head_problem(config) or eos_setting_problem(path))


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


EXPORT_DTYPE_KEY = "dstrain_export_dtype"
"""``config.json`` key of a folder dstrain wrote in fp32 from a 16-bit checkpoint (a warm start): the
dtype its weights came in, so that an export of what was trained from it writes that dtype again."""


def declared_dtype(path: str) -> torch.dtype:
    """The dtype ``config.json`` says the weights were saved in (:data:`EXPORT_DTYPE_KEY`, ``dtype``, or
    the older ``torch_dtype``); float32 where it says none or one that is not a float type."""
    cfg = read_config(path)
    for source in (cfg, text_config(cfg)):
        for key in (EXPORT_DTYPE_KEY, "dtype", "torch_dtype"):
            value = source.get(key)
            if isinstance(value, str) and value.replace("torch.", "") in _DTYPES:
                return _DTYPES[value.replace("torch.", "")]
    return torch.float32


def checkpoint_dtype(cfg) -> torch.dtype | None:
    """The dtype of the weights a policy config loads (``cfg.path``'s declared dtype); None when it
    builds from its fields (no checkpoint)."""
    return declared_dtype(cfg.path) if getattr(cfg, "path", "") else None


IGNORED_GENERATION_KEYS = (
    "do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty", "no_repeat_ngram_size",
    "num_beams", "max_new_tokens", "max_length", "min_new_tokens", "min_length", "length_penalty",
    "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens", "bad_words_ids")
"""``generation_config.json`` settings dstrain's generators never apply: sampling is ``softmax(logits /
task.temperature)`` within ``task.top_p``, for ``task.max_new_tokens``; of that file only ``eos_token_id`` is used."""


def ignored_generation_settings(path: str) -> dict:
    """The settings of ``path``'s ``generation_config.json`` that dstrain ignores (:data:`IGNORED_GENERATION_KEYS`,
    those set to something), in the file's order; ``{}`` where there are none or no such file."""
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if k in IGNORED_GENERATION_KEYS and v is not None and v != []}


@contextlib.contextmanager
def no_hf_bars():
    """transformers' progress bars off for one load or save: every rank drew "Loading weights" for the policy and
    the reference, rank 0 "Writing model shards" for the warm start (five carriage-return bars in a 2-rank GRPO
    run's log, between the plan and dstrain's own progress)."""
    from transformers.utils import logging as hf_logging
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
