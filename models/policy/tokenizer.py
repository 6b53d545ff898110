"""An embedded byte-level tokenizer (nothing to download) and tokenizer loading.

Ids 0..255 are the 256 byte values, so a text's ids are exactly its UTF-8 bytes;
then three special tokens:

====  =========  ==========================================================
id    token      use
====  =========  ==========================================================
256   ``<eos>``  end of a completion / document. Same id as the framework's
                 ``dstrain.data.corpus.ByteTokenizer`` end-of-sequence, so a
                 policy trained by the supervised LM trainer on byte streams
                 learns to emit the same end token that generation stops on.
257   ``<pad>``  padding (never sampled: :func:`~models.policy.generation.generate`
                 suppresses it)
258   ``<bos>``  beginning of sequence; never added automatically
====  =========  ==========================================================

Special tokens are only ever produced from ids, never matched in text
(``split_special_tokens=True``): encoding the text ``"<eos>"`` gives its five bytes,
so any string round-trips exactly. The tokenizer pads on the LEFT (what batched
generation needs: every prompt ends at the same position); training batches are
built right-padded by :func:`~models.policy.generation.pack` instead.
"""

from __future__ import annotations

import os

from .config import PolicyConfig

EOS, PAD, BOS = "<eos>", "<pad>", "<bos>"
BYTE_VOCAB = 256
VOCAB_SIZE = BYTE_VOCAB + 3
EOS_ID, PAD_ID, BOS_ID = 256, 257, 258

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _byte_symbols() -> list[str]:
    """The printable stand-in of each byte used by byte-level BPE (GPT-2's table).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are mapped, in
    order, to code points 256, 257, ... so that every symbol is a visible character.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def byte_tokenizer(model_max_length: int = 512):
    """The embedded byte-level tokenizer as a ``transformers.PreTrainedTokenizerFast``.

    A ``tokenizers`` BPE model whose vocabulary is exactly the 256 byte symbols and
    which has no merges (so one token per byte), a byte-level pre-tokenizer without
    the word-splitting regex or prefix space, and the byte-level decoder. Decoding
    an id sequence that is not valid UTF-8 gives U+FFFD for the broken bytes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: b for b, symbol in enumerate(_byte_symbols())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([EOS, PAD, BOS])  # ids 256, 257, 258 in this order
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, pad_token=PAD, bos_token=BOS,
        padding_side="left", truncation_side="left", split_special_tokens=True,
        clean_up_tokenization_spaces=False, model_max_length=model_max_length)
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (EOS_ID, PAD_ID, BOS_ID)
    return tok


def has_tokenizer_files(path: str) -> bool:
    """Whether a checkpoint directory carries its own tokenizer."""
    return any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES)


def _generation_eos_ids(path: str) -> list[int]:
    """``eos_token_id`` of a checkpoint's ``generation_config.json`` (else ``config.json``) as a list (checked when
    the run config loads: :func:`~models.policy.hf_files.eos_setting_problem`)."""
    from .hf_files import eos_setting

    for name in ("generation_config.json", "config.json"):
        value = eos_setting(path, name)
        if value is not None:
            return [int(v) for v in (value if isinstance(value, list) else [value])]
    return []


def eos_token_ids(tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS first, then the checkpoint's others.

    A checkpoint's ``generation_config.json`` may list several (Llama-3's
    ``<|eot_id|>`` and ``<|end_of_text|>``, Qwen's ``<|im_end|>`` and
    ``<|endoftext|>``); :func:`load_tokenizer` records them on the tokenizer.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = [eos] if eos is not None else []
    return list(dict.fromkeys(ids + list(getattr(tokenizer, "dstrain_eos_ids", ()))))


CHAT_TEMPLATE_MODES = ("off", "on", "auto")


def use_chat_template(tokenizer, mode: str = "off"):
    """Switch ``tokenizer`` (in place; returned) to render every prompt through its chat template.

    ``mode``: ``off`` (prompts are plain text), ``on`` (a ValueError for a tokenizer with
    no ``chat_template``), ``auto`` (on exactly when the tokenizer has one). The choice is
    kept on the tokenizer, so every path that turns a prompt into ids through
    :func:`encode_prompt` (generation, vLLM, log-prob scoring of the packed ids, the
    supervised warm start, both SCoRe turns and the hint) renders it the same way.
    """
    if mode not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"chat_template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, not {mode!r}")
    has = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has:
        raise ValueError("task.chat_template is 'on' but the tokenizer has no chat template (the embedded "
                         "byte tokenizer and base checkpoints have none): use 'off', or 'auto' to apply "
                         "a template only where the checkpoint has one")
    tokenizer.dstrain_chat_template = has and mode != "off"
    return tokenizer


def chat_template_problem(path: str) -> str | None:
    """Why ``task.chat_template=on`` cannot work with the model at ``path`` (``model.args.path``), read from its
    files before anything is built, else None: the embedded byte tokenizer (no path, or a checkpoint saved without
    tokenizer files) and a tokenizer whose files hold no template have none."""
    import json

    if not path or not has_tokenizer_files(path):
        return ("'on' needs a tokenizer with a chat template, and this model uses the embedded byte tokenizer "
                "(no model.args.path with tokenizer files): use 'off'")
    if os.path.isfile(os.path.join(path, "chat_template.jinja")) or \
            os.path.isfile(os.path.join(path, "chat_template.json")):
        return None
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            has = bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return None  # not readable here: the trainer's load decides (use_chat_template)
    return None if has else (f"'on' but the tokenizer in {path} has no chat template (a base checkpoint): use "
                             "'off', or 'auto' to apply one only where a checkpoint has it")


def render_prompt(tokenizer, text: str) -> str:
    """The text a prompt is encoded from: ``text`` itself, or, after :func:`use_chat_template`
    switched it on, ``text`` as one user message through the chat template with the
    assistant's generation prompt appended (``apply_chat_template(..., tokenize=False)``)."""
    if not getattr(tokenizer, "dstrain_chat_template", False):
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A prompt's ids: its text without special tokens, after the special tokens the tokenizer
    itself puts in front (a BOS where its post-processor or ``add_bos_token`` adds one,
    as Llama's and Gemma's do); an EOS it would append is left off (the completion follows).

    With the chat template switched on (:func:`use_chat_template`) the rendered conversation
    is encoded without added special tokens: the template writes its own BOS where the model
    wants one, and a second one from the tokenizer would be a different prompt than training saw.
    """
    if getattr(tokenizer, "dstrain_chat_template", False):
        return tokenizer(render_prompt(tokenizer, text), add_special_tokens=False)["input_ids"]
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", ()))
    if not special:
        return plain
    full = tokenizer(text, add_special_tokens=True)["input_ids"]
    ends = set(eos_token_ids(tokenizer))
    head = []
    for t in full:
        if t not in special or t in ends or (plain and t == plain[0]):
            break
        head.append(t)
    return head + plain


_ANCHOR = "\n"
"""Text put before a continuation when it is encoded or decoded on its own: it ends a word for every
pre-tokenizer (no merge across it, no prefix space after it) and decodes to itself."""


def encode_continuation(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` as it follows other text (a completion after its prompt), without special tokens.

    A tokenizer that puts a space in front of the text it encodes (``add_prefix_space``, a byte-level
    pre-tokenizer's or a SentencePiece ``▁``) would otherwise teach a completion that starts with a space
    that is not in ``text``: here ``text`` is encoded after :data:`_ANCHOR` and the anchor's ids dropped,
    where that gives ids that decode to ``text`` and the plain encoding does not.
    """
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not text or not hasattr(tokenizer, "decode"):
        return plain
    # read as :func:`decode_continuation` reads a completion (after other text): a SentencePiece decoder's Strip
    # hides the ``▁`` its pre-tokenizer put in front of ``text`` when the ids are decoded alone
    anchor = tokenizer(_ANCHOR, add_special_tokens=False)["input_ids"]
    if decode_continuation(tokenizer, anchor, plain) == text:
        return plain
    both = tokenizer(_ANCHOR + text, add_special_tokens=False)["input_ids"]
    if both[:len(anchor)] == anchor and decode_continuation(tokenizer, anchor, both[len(anchor):]) == text:
        return both[len(anchor):]
    return plain


def decode_continuation(tokenizer, prefix_ids, ids) -> str:
    """The text ``ids`` add after ``prefix_ids`` (a completion after its prompt), special tokens dropped.

    A SentencePiece-style decoder strips the space of the first ``▁`` it decodes (Llama-2, Mistral,
    Gemma: ``Strip`` in ``tokenizer.json``), so a completion decoded alone loses its first space (an
    indented code line loses a column). Decoded after the prompt's last tokens it keeps it; a byte-level
    tokenizer gives the same text either way. Plain ``decode(ids)`` where the prompt's text does not
    decode to a prefix of the whole (a character split between prompt and completion).
    """
    return continuation_reader(tokenizer, prefix_ids)(ids)


def continuation_reader(tokenizer, prefix_ids):
    """:func:`decode_continuation` with ``prefix_ids`` fixed: a function of ``ids`` that decodes the prompt's
    tail once, however many prefixes of a completion it reads (``cut_at_stop``'s search)."""
    tail = list(prefix_ids[-8:])
    head = tokenizer.decode(tail, skip_special_tokens=True) if tail else ""
    usable = bool(tail) and "\ufffd" not in head

    def read(ids) -> str:
        ids = list(ids)
        if ids and usable:
            whole = tokenizer.decode(tail + ids, skip_special_tokens=True)
            if whole.startswith(head):
                return whole[len(head):]
        return tokenizer.decode(ids, skip_special_tokens=True)
    return read


def _embedding_rows(path: str, tok) -> int:
    """The checkpoint's embedding rows (``config.json`` ``vocab_size``), checked against ``tok``.

    A pad token past the embedding (one added to the tokenizer without resizing the model) is
    replaced by the EOS token: padded positions are masked, but their ids are still looked up,
    and an id past the embedding fails inside the model. Any other id past it is refused, naming
    both sizes: text that encodes to it could never be embedded.
    """
    from .hf_files import read_config, text_config

    rows = text_config(read_config(path)).get("vocab_size")
    if not isinstance(rows, int) or isinstance(rows, bool):
        return len(tok)
    pad = tok.pad_token_id
    if pad >= rows and tok.eos_token_id < rows:
        tok.pad_token = tok.eos_token
    over = [i for i in range(rows, len(tok)) if i != pad]
    if over or tok.eos_token_id >= rows:
        over = over or [tok.eos_token_id]
        names = ", ".join(repr(t) for t in tok.convert_ids_to_tokens(over[:3]))
        raise ValueError(f"the tokenizer in {path} has {len(tok)} ids but the checkpoint's embedding has "
                         f"{rows} rows (config.json vocab_size): ids {over[0]}..{over[-1]} ({names}"
                         f"{', ...' if len(over) > 3 else ''}) have no embedding; tokenizer and checkpoint "
                         "do not belong together")
    return rows


def load_tokenizer(cfg: PolicyConfig):
    """The tokenizer that belongs to ``cfg``'s model, padding on the left.

    With ``cfg.path`` holding tokenizer files: ``AutoTokenizer.from_pretrained(path,
    local_files_only=True)``; a tokenizer without a pad token gets its EOS token as
    pad (the usual choice for Llama/Qwen checkpoints; padded positions are masked
    anyway), one without an EOS token the checkpoint's first generation EOS. The
    checkpoint's generation EOS ids (``generation_config.json``, possibly a list) are
    kept on it for :func:`eos_token_ids`. A pad token past the model's embedding becomes
    the EOS token; any other id past it is refused (:func:`_embedding_rows`). Otherwise (built from config, or a checkpoint
    saved without tokenizer) the embedded :func:`byte_tokenizer`.
    """
    if cfg.path and has_tokenizer_files(cfg.path):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.path, local_files_only=True)
        tok.padding_side = "left"
        extra = _generation_eos_ids(cfg.path)
        known = [t for t in extra if 0 <= t < len(tok)]
        if tok.eos_token_id is None and known:  # the first of the checkpoint's end ids the tokenizer has
            tok.eos_token = tok.convert_ids_to_tokens(known[0])
        if tok.eos_token_id is None:
            named = (f"names only ids past its {len(tok)} tokens ({', '.join(map(str, extra))})" if extra else
                     "names none")
            raise ValueError(f"the tokenizer in {cfg.path} has no EOS token and the checkpoint {named} "
                             "(generation_config.json eos_token_id): completions could never end; set eos_token "
                             "in tokenizer_config.json or eos_token_id in generation_config.json")
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        rows = _embedding_rows(cfg.path, tok)
        tok.dstrain_eos_ids = [t for t in extra if t < min(len(tok), rows)]
        return tok
    return byte_tokenizer(cfg.max_positions)


class CorpusTokenizer:
    """A checkpoint's own tokenizer in the shape the LM trainer's corpus streams use.

    ``encode_array(doc)`` is the document's ids as :func:`encode_prompt` gives them (a
    BOS in front where the tokenizer adds one); ``eos_id`` ends each document;
    ``vocab_size`` is ``len(tokenizer)``.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.vocab_size = len(tokenizer)

    def encode_array(self, text: str):
        import numpy as np

        return np.asarray(encode_prompt(self.tokenizer, text), dtype=np.int64)

    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def corpus_tokenizer(cfg: PolicyConfig):
    """The tokenizer a text corpus must be read with for ``cfg``'s model: a
    :class:`CorpusTokenizer` around a checkpoint's own tokenizer, or None where the
    byte ids of ``dstrain.data.corpus.ByteTokenizer`` are the model's (the byte
    tokenizer: same ids, EOS 256)."""
    if cfg.path and has_tokenizer_files(cfg.path):
        return CorpusTokenizer(load_tokenizer(cfg))
    return None
