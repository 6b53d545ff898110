"""Make the CUDA build environment one DeepSpeed's op builders can read.

DeepSpeed 0.19's op builders (FusedAdam, CPU Adam, ...) parse ``TORCH_CUDA_ARCH_LIST``
entry by entry as ``MAJOR.MINOR[+PTX]`` with ``int()``. PyTorch itself also accepts
arch-specific and family suffixes (``9.0a``, ``10.0f``) and named architectures
(``Hopper``), and CUDA images commonly set them (``TORCH_CUDA_ARCH_LIST=9.0a``), so
every JIT build then dies with ``ValueError: invalid literal for int() with base 10:
'0a'``. :func:`sanitize_arch_list` rewrites such a list into the form DeepSpeed reads
(``9.0a`` -> ``9.0``, the ``+PTX`` marker kept); :func:`apply` does that to the
process environment before DeepSpeed starts and says what it changed.
"""
from __future__ import annotations

import os
import re

VAR = "TORCH_CUDA_ARCH_LIST"

#: PyTorch's named architectures (torch.utils.cpp_extension), as DeepSpeed-readable versions.
NAMED = {"kepler": "3.5", "kepler+tesla": "3.7", "maxwell": "5.0;5.2", "maxwell+tegra": "5.3",
         "pascal": "6.0;6.1", "pascal+tegra": "6.2", "volta": "7.0", "volta+tegra": "7.2", "turing": "7.5",
         "ampere": "8.0;8.6", "ampere+tegra": "8.7", "ada": "8.9", "hopper": "9.0", "blackwell": "10.0;12.0"}

_ENTRY = re.compile(r"^(\d+)\.(\d+)[a-z]*(\+ptx)?$", re.IGNORECASE)


def sanitize_arch_list(value: str) -> str:
    """``"9.0a 8.0+PTX"`` -> ``"8.0+PTX;9.0"``: entries DeepSpeed's ``int()`` parsing accepts.

    Suffix letters are dropped (``9.0a`` and ``9.0`` build the same ``sm_90`` code for
    DeepSpeed's kernels, which use no arch-specific instructions), named architectures
    become their versions, duplicates merge (``+PTX`` kept if any copy had it), and the
    result is sorted. Raises ValueError naming an entry that is none of these.
    """
    merged: dict[tuple[int, int], bool] = {}
    for raw in value.replace(",", ";").replace(" ", ";").split(";"):
        token = raw.strip()
        if not token:
            continue
        ptx = token.lower().endswith("+ptx")
        base = token[:-4] if ptx else token
        if base.lower() in NAMED:
            versions = NAMED[base.lower()].split(";")
        else:
            versions = [token]
            ptx = False
        for version in versions:
            m = _ENTRY.match(version)
            if m is None:
                raise ValueError(f"{VAR} entry {token!r} is not an architecture such as 9.0, 9.0a or 8.0+PTX")
            key = (int(m.group(1)), int(m.group(2)))
            merged[key] = merged.get(key, False) or bool(m.group(3)) or ptx
    return ";".join(f"{a}.{b}{'+PTX' if p else ''}" for (a, b), p in sorted(merged.items()))


def apply(environ=None) -> str | None:
    """Rewrite ``TORCH_CUDA_ARCH_LIST`` in ``environ`` (default: this process) if DeepSpeed cannot read it.

    Returns a one-line note of what changed, or None when nothing did. A list that
    cannot be made readable is removed (DeepSpeed then asks the visible GPUs).
    """
    env = os.environ if environ is None else environ
    value = env.get(VAR)
    if value is None:
        return None
    try:
        fixed = sanitize_arch_list(value)
    except ValueError as err:
        env.pop(VAR, None)
        return f"{VAR}={value!r} removed ({err}); DeepSpeed's op builds target the visible GPUs"
    if fixed == value:
        return None
    if not fixed:
        env.pop(VAR, None)
        return f"{VAR}={value!r} was empty; removed"
    env[VAR] = fixed
    return f"{VAR}={value!r} rewritten to {fixed!r} for DeepSpeed's op builders"
