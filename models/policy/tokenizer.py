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


def load_tokenizer(cfg: PolicyConfig):
    """The tokenizer that belongs to ``cfg``'s model, padding on the left.

    With ``cfg.path`` holding tokenizer files: ``AutoTokenizer.from_pretrained(path,
    local_files_only=True)``; a tokenizer without a pad token gets its EOS token as
    pad (the usual choice for Llama/Qwen checkpoints; padded positions are masked
    anyway). Otherwise (built from config, or a checkpoint saved without tokenizer)
    the embedded :func:`byte_tokenizer`.
    """
    if cfg.path and has_tokenizer_files(cfg.path):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.path, local_files_only=True)
        tok.padding_side = "left"
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok
    return byte_tokenizer(cfg.max_positions)
