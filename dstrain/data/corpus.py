"""Text corpora, a byte-level tokenizer and train/val token streams.

Corpora are read through Hugging Face ``datasets`` (which caches them as Arrow
files under ``cache_dir``, or ``~/.cache/huggingface/datasets`` by default) and
never touch the network:

- ``"stdlib"``: the ``.py`` files of the running Python's standard library,
  one document per file (always available, so tests and smoke runs need no data);
- a ``.txt`` file: one document per blank-line-separated paragraph;
- a ``.jsonl`` file: one document per line, from its ``"text"`` field;
- a directory: one document per ``.txt`` / ``.py`` / ``.md`` file below it.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                        "encodings"})  # encodings: machine-generated codec tables
_DIR_SUFFIXES = (".txt", ".py", ".md")


def stdlib_files(max_bytes: int = 4_000_000) -> list[str]:
    """Sorted paths of standard-library ``.py`` files totalling about ``max_bytes``.

    Files are taken in sorted order of their path relative to the stdlib root;
    directories named site-packages, test, tests, idlelib, lib2to3 or encodings are skipped.
    Files are added until the total size reaches ``max_bytes`` (the file that
    crosses the limit is included), so the result is deterministic for a given
    Python installation.

    Raises:
        ValueError: ``max_bytes`` is not positive.
        RuntimeError: no source files were found (e.g. a stdlib shipped as .pyc only).
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path.stat().st_size))
    found.sort()
    files, total = [], 0
    for rel, size in found:
        if total >= max_bytes:
            break
        files.append(str(root / rel))
        total += size
    if not files:
        raise RuntimeError(
            f"no .py files found in the standard library at {root}; "
            "use a local corpus path instead of 'stdlib'"
        )
    return files


def _load_dataset(builder: str, data_files: str | list[str], cache_dir: str | None, **kwargs):
    """Call ``datasets.load_dataset`` offline, without progress bars."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets  # heavy import, kept local

    bars_were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(
            builder, data_files=data_files, split="train", cache_dir=cache_dir, **kwargs
        )
    finally:
        if not bars_were_off:
            datasets.enable_progress_bars()


_SNIFF_BYTES = 1 << 16
_MAX_BAD_UTF8 = 0.01  # a stray Latin-1 byte is read as U+FFFD; a file mostly not UTF-8 is refused


def text_file_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be a text corpus file, from its first 64 KiB, else None: it cannot be read (no
    permission), it holds a NUL byte (a binary file: no text file has one), or over 1% of its bytes are not
    UTF-8 (another encoding, or binary). Before, such a file was decoded with U+FFFD for every bad byte and
    trained on as text; an unreadable one ended in ``datasets``' traceback."""
    import codecs
    try:
        with open(path, "rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    except OSError as err:
        return (f"corpus file {str(path)!r} cannot be read ({err.strerror or err}); make it readable "
                "(chmod a+r) or move it out of the corpus")
    if (nul := head.find(b"\0")) >= 0:
        if wide := _utf16_or_32(head):  # NULs of a Windows "Unicode" text file, not of a binary one
            return (f"corpus file {str(path)!r} is {wide} text, not UTF-8; convert it (iconv -f {wide} -t UTF-8) "
                    "or name another")
        return (f"corpus file {str(path)!r} is binary (a NUL byte at offset {nul}), not text; a corpus holds "
                "UTF-8 text: move the file out of it or name another")
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(head, final=False)
    bad = text.count("\ufffd") - head.count("\ufffd".encode())
    if head and bad > _MAX_BAD_UTF8 * len(head):
        return (f"corpus file {str(path)!r} is not UTF-8 text ({bad} undecodable bytes in its first {len(head)}, "
                f"the first at offset {_first_bad_utf8(head)}); convert it (iconv -f LATIN1 -t UTF-8) or name another")
    return None


def _utf16_or_32(head: bytes) -> str | None:
    """"UTF-16" or "UTF-32" for text in either (a byte-order mark, or ASCII text whose every second byte is NUL),
    else None: such a file has NUL bytes without being binary, and was called binary."""
    if head.startswith((b"\xff\xfe\0\0", b"\0\0\xfe\xff")):
        return "UTF-32"
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16"
    pairs = head[:len(head) // 2 * 2]
    if len(pairs) >= 4:  # BOM-less UTF-16 of mostly-ASCII text: NULs on one side of each pair, none on the other
        for zeros, other in ((pairs[0::2], pairs[1::2]), (pairs[1::2], pairs[0::2])):
            ascii_ = sum(1 for z, c in zip(zeros, other) if z == 0 and (32 <= c < 127 or c in (9, 10, 13)))
            if other.count(0) == 0 and ascii_ >= 0.5 * len(zeros):
                return "UTF-16"
    return None


def _first_bad_utf8(data: bytes) -> int:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return err.start
    return len(data)


def _require_text(files: list[str]) -> None:
    """ValueError for the first file :func:`text_file_problem` refuses."""
    for f in files:
        if problem := text_file_problem(f):
            raise ValueError(problem)


def corpus_files(path: Path) -> list[str]:
    """The files a corpus path names: itself, or the .txt/.py/.md files below a folder, sorted."""
    if not path.is_dir():
        return [str(path)]
    return sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix in _DIR_SUFFIXES)


def _require_bytes(files: list[str], corpus: str) -> None:
    """``datasets`` cannot build a dataset from empty files; say so clearly instead."""
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"corpus {corpus!r} contains no non-empty documents (all files are empty)")


def _text_documents(files: list[str], cache_dir: str | None, sample_by: str) -> list[str]:
    ds = _load_dataset(
        "text", files, cache_dir, sample_by=sample_by, encoding_errors="replace"
    )
    return list(ds["text"])


def load_documents(
    corpus: str, cache_dir: str | None = None, max_bytes: int = 4_000_000
) -> list[str]:
    """Read a corpus as a list of documents (strings), through ``datasets``.

    Args:
        corpus: ``"stdlib"`` or a local path (``.txt`` file, ``.jsonl`` file with a
            ``"text"`` field, or a directory of ``.txt``/``.py``/``.md`` files).
        cache_dir: where ``datasets`` caches its Arrow files (default: its own,
            ``~/.cache/huggingface/datasets`` or ``$HF_DATASETS_CACHE``).
        max_bytes: size budget of the ``"stdlib"`` corpus; ignored for paths.

    Empty documents are dropped.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: unsupported file type, a ``.jsonl`` without ``"text"``, or a
            corpus with no non-empty document.
    """
    if corpus == "stdlib":
        docs = _text_documents(stdlib_files(max_bytes), cache_dir, "document")
    else:
        path = Path(corpus).expanduser()
        if not path.exists():
            what = ("is a symbolic link to nothing (a loop, or its target is gone)" if path.is_symlink()
                    else "does not exist")
            raise FileNotFoundError(
                f"corpus path {str(path)!r} {what} (use 'stdlib' or a local "
                ".txt/.jsonl file or directory)"
            )
        if path.is_dir():
            files = corpus_files(path)
            if not files:
                raise ValueError(
                    f"corpus directory {str(path)!r} holds no {'/'.join(_DIR_SUFFIXES)} files"
                )
            _require_text(files)
            _require_bytes(files, corpus)
            docs = _text_documents(files, cache_dir, "document")
        elif path.suffix == ".txt":
            _require_text([str(path)])
            _require_bytes([str(path)], corpus)
            docs = _text_documents([str(path)], cache_dir, "paragraph")
        elif path.suffix == ".jsonl":
            _require_text([str(path)])
            _require_bytes([str(path)], corpus)
            try:
                ds = _load_dataset("json", str(path), cache_dir)
            except Exception as err:  # datasets wraps the JSON error in a generation error
                cause = err.__cause__ or err.__context__ or err
                raise ValueError(f"corpus file {str(path)!r} is not valid JSON lines: "
                                 f"{type(cause).__name__}: {str(cause)[:200]}") from None
            if "text" not in ds.column_names:
                raise ValueError(
                    f"corpus file {str(path)!r} has no 'text' field (columns: {ds.column_names})"
                )
            docs = [t for t in ds["text"] if isinstance(t, str)]
        else:
            raise ValueError(
                f"unsupported corpus file {str(path)!r}: expected .txt, .jsonl or a directory"
            )
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError(f"corpus {corpus!r} contains no non-empty documents")
    return docs


class ByteTokenizer:
    """UTF-8 byte tokenizer: ids 0..255 are bytes, 256 is end-of-sequence."""

    vocab_size = 257
    eos_id = 256

    def encode_array(self, text: str) -> np.ndarray:
        """UTF-8 bytes of ``text`` as a ``uint8`` numpy array (no EOS appended)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text`` as a list of ids (no EOS appended)."""
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Bytes back to text; EOS ids are dropped, invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        data = bytes(i for i in ids if i != self.eos_id)
        return data.decode("utf-8", errors="replace")


def build_token_streams(
    documents: Sequence[str], tokenizer: ByteTokenizer, val_every: int = 20
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate documents, each followed by EOS, into (train, val) 1-D streams.

    Document ``i`` goes to val when ``i % val_every == val_every - 1`` (every
    ``val_every``-th document, the first one being train), otherwise to train.
    Streams are ``torch.int16`` (``torch.int32`` for a vocabulary over 32768, a checkpoint's
    own tokenizer); convert batches to int64.

    Raises:
        ValueError: ``val_every < 2``, or either stream would be empty (fewer
            than ``val_every`` documents).
    """
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2, got {val_every}")
    dtype = np.int16 if tokenizer.vocab_size <= np.iinfo(np.int16).max + 1 else np.int32
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for i, doc in enumerate(documents):
        is_val = i % val_every == val_every - 1
        parts[is_val].append(tokenizer.encode_array(doc).astype(dtype))
        parts[is_val].append(eos)
    if not parts[False] or not parts[True]:
        raise ValueError(
            f"{len(documents)} documents cannot be split with val_every={val_every}: "
            f"need at least {val_every} documents for a non-empty validation stream"
        )
    train, val = (torch.from_numpy(np.concatenate(parts[k])) for k in (False, True))
    return train, val


def short_stream_problem(train: torch.Tensor, val: torch.Tensor, seq_len: int, val_every: int) -> str | None:
    """Why the token streams of a corpus hold no training or no validation window of ``seq_len + 1`` tokens, else
    None. Before, a corpus of short paragraphs (or a binary file read as a few) stopped the rank with the sampler's
    traceback."""
    for name, stream, what in (("training", train, "the documents"),
                               ("validation", val, f"every {val_every}th document")):
        if len(stream) < seq_len + 1:
            return (f"its {name} stream ({what}) holds {len(stream)} tokens, fewer than data.seq_len + 1 = "
                    f"{seq_len + 1}: add text, or lower --data.seq_len" +
                    (" or --data.val_every" if name == "validation" else ""))
    return None
