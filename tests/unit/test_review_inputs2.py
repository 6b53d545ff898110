"""Review of adversarial inputs 2 on real files: text that is not UTF-8 but is not binary either, and a puzzle file
saved by a Windows editor.

- a corpus file saved as UTF-16 (Windows' "Unicode" text, with or without its byte-order mark) has a NUL byte in
  every second place: it was refused as "binary ... not text", which sends the user looking for a stray binary
  file; it is now named as UTF-16 text with the iconv line that converts it. A real binary file is still binary.
- a puzzle file of bare 81-digit lines saved with a UTF-8 byte-order mark: its first line was refused with
  "no 81-character puzzle field" (the mark made it 82 characters); the mark is now dropped, as Python's
  ``utf-8-sig`` does.
"""
from __future__ import annotations

import numpy as np
import pytest

from dstrain.data import sudoku
from dstrain.data.corpus import load_documents, text_file_problem

TEXT = "Grüße aus Köln. A corpus line of text, and another one.\n\n" * 200


@pytest.mark.parametrize("encoding, named", [("utf-16", "UTF-16"), ("utf-16-le", "UTF-16"), ("utf-16-be", "UTF-16"),
                                             ("utf-32", "UTF-32")])
def test_a_utf16_corpus_is_named_as_such_not_as_binary(tmp_path, encoding, named):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding=encoding)
    problem = text_file_problem(corpus)
    assert problem is not None and f"is {named} text, not UTF-8" in problem and f"iconv -f {named} -t UTF-8" in problem
    assert "binary" not in problem
    with pytest.raises(ValueError, match=f"is {named} text"):  # the rank's reader says the same
        load_documents(str(corpus))


def test_a_binary_file_is_still_binary(tmp_path):
    corpus = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    for blob in (b"\x00\xff\xfeabc\x00\n\n" * 60, rng.integers(0, 256, 4096, dtype=np.uint8).tobytes() + b"\0",
                 np.arange(1, 2000, dtype="<u2").tobytes()):  # (small int16s: a NUL every second byte, not text)
        corpus.write_bytes(blob)
        assert "is binary (a NUL byte" in text_file_problem(corpus)
    corpus.write_text(TEXT, encoding="utf-8-sig")  # a UTF-8 byte-order mark: UTF-8 text
    assert text_file_problem(corpus) is None


def test_a_puzzle_file_with_a_utf8_byte_order_mark_is_read(tmp_path):
    puzzles, _ = sudoku.generate_many(3, 30, seed=0)
    lines = ["".join(map(str, p)) for p in puzzles]
    path = tmp_path / "puzzles.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8-sig")
    got, solutions = sudoku.read_puzzle_file(path)
    assert got.shape == (3, 81) and np.array_equal(got, puzzles)
    assert all(sudoku.is_solution(s) for s in solutions)
    path.write_bytes(b"\n" + "\ufeff".encode() + lines[0].encode() + b"\n")  # (a mark inside the file: not read)
    with pytest.raises(ValueError, match="no 81-character puzzle field"):
        sudoku.read_puzzle_file(path)
