"""Maths answer checking: the GSM8K ``#### <answer>`` format and number normalisation.

* :func:`extract_final_answer` - the text after the last ``####`` (first line), or
  ``None``; optionally the last number in the text instead.
* :func:`normalize_number` - a canonical string for a number written with currency
  signs, thousands separators, units, trailing full stops, a unicode minus, decimals
  or a fraction: ``"$1,000.00"`` and ``"1000"`` both give ``"1000"``, ``"3.50"`` gives
  ``"3.5"``, ``"1/2"`` and ``".5"`` give ``"0.5"``, ``"2/3"`` stays ``"2/3"``.
* :func:`numbers_in` - the canonical form of every number in a text (a hint that states the answer).
* :func:`maths_reward` - 1.0 when the completion's final answer equals the reference
  after normalisation, else 0.0.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

FINAL_MARKER = "####"
_NUMBER = re.compile(
    r"(?P<sign>[-+])?\s*[$€£]?\s*(?P<num>\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*(?P<den>\d+(?:\.\d+)?))?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def extract_final_answer(text: str, fallback_last_number: bool = False) -> str | None:
    """The final answer of a GSM8K-style solution: the first line after the last
    ``####`` (stripped), or ``None`` when there is no marker or nothing follows it.

    With ``fallback_last_number`` a text without the marker yields its last number.
    """
    at = text.rfind(FINAL_MARKER)
    if at >= 0:
        rest = text[at + len(FINAL_MARKER):].strip()
        line = rest.splitlines()[0].strip() if rest else ""
        return line or None
    if fallback_last_number:
        numbers = [m.group(0) for m in _NUMBER.finditer(_THOUSANDS.sub("", text))]
        return numbers[-1].strip() if numbers else None
    return None


def _canonical(value: Fraction) -> str:
    """The integer, the exact terminating decimal (every digit: no rounding to a context's precision),
    or ``p/q`` in lowest terms."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    twos = (den & -den).bit_length() - 1
    den >>= twos
    fives = 0
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)  # value * 10**places is an integer, and no smaller power does it
    digits = str(abs(value.numerator) * (10 ** places // value.denominator)).rjust(places + 1, "0")
    sign = "-" if value.numerator < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


def normalize_number(s: str | None) -> str | None:
    """A canonical form of the first number in ``s`` (see the module docstring), or
    ``None`` when ``s`` holds no number."""
    if s is None:
        return None
    text = _THOUSANDS.sub("", s.strip().replace("\u2212", "-"))
    m = _NUMBER.search(text)
    if m is None:
        return None
    try:
        value = Fraction(Decimal(m.group("num")))
        if m.group("den") is not None:
            den = Fraction(Decimal(m.group("den")))
            if den == 0:
                return None
            value /= den
    except (InvalidOperation, ValueError, ZeroDivisionError):
        return None
    if m.group("sign") == "-":
        value = -value
    return _canonical(value)


def numbers_in(text: str) -> list[str]:
    """The canonical form (:func:`normalize_number`) of every number in ``text``, read as the verifier reads
    one: thousands separators, currency signs, a unicode minus, decimals and fractions included."""
    clean = _THOUSANDS.sub("", text.replace("\u2212", "-"))
    found = (normalize_number(m.group(0)) for m in _NUMBER.finditer(clean))
    return [x for x in found if x is not None]


def maths_reward(completion: str, answer: str) -> float:
    """1.0 when the final answer of ``completion`` (after ``####``) equals ``answer`` as
    a number (both normalised); when ``answer`` is not a number, the stripped strings
    must match exactly. 0.0 otherwise, including a missing ``####``."""
    predicted = extract_final_answer(completion)
    if predicted is None:
        return 0.0
    want = normalize_number(answer)
    if want is None:
        return float(predicted.strip() == answer.strip())
    return float(normalize_number(predicted) == want)
