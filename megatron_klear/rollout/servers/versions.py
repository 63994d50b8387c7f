"""Weight versions in SGLang's answers: which version sampled each token, and which answers are stale.

**Per token** (:func:`token_versions`). SGLang 0.5.23 reports, with every finished or aborted output,
``meta_info["weight_version"]`` (the version that sampled its last token) and, for a request that
ran across a weight update (pause -> update -> continue, ``srt/utils/weight_versions.py``),
``meta_info["weight_versions"]``: ``[{"version": str, "start": int, "end": int}, ...]``, contiguous
spans from token 0 over the output tokens (``start`` inclusive, ``end`` exclusive). The trainer
pushes its versions as the strings of integers (its weight version: +1 per update that applied an
optimizer step, not the RL step), so a version reads as an ``int``; any other string (SGLang's
``"default"`` before a push) reads as ``None`` (unknown).

**Stale answers** (:func:`stale_version`). After a push the client expects every live worker to hold
``expected`` (:attr:`~.membership.Membership.expected_version`). A request may run while the weights
change (SGLang's ``retract`` pause keeps it running through a push: its later tokens come from the
new weights), so an answer is stale only when its final version is **older than the version expected
when the request was sent** (its worker missed a push) or **newer than the version expected now**
(a worker ahead of the client). With non-integer versions the rule is equality with the version
expected now. While a push is under way the upper bound is not applied: the servers already hold the
version the client is about to expect.
"""

from __future__ import annotations

import re

from megatron_klear.rollout.servers.transport import EngineError

_INT = re.compile(r"[+-]?\d+")


def version_number(version):
    """``"3"`` -> 3; ``3`` -> 3; anything else (``"default"``, None) -> None."""
    if isinstance(version, bool):
        return None
    if isinstance(version, int):
        return version
    if isinstance(version, str) and _INT.fullmatch(version.strip()):
        return int(version)
    return None


def token_versions(meta: dict, n_tokens: int, where: str) -> list:
    """The weight version (int, or None when unknown) of each of the ``n_tokens`` output tokens, from
    ``meta_info["weight_versions"]`` when present, else ``meta_info["weight_version"]`` for every
    token. ``where`` names the URL and sample in the error raised for spans that are not contiguous
    from 0 or do not cover exactly the output tokens."""
    spans = meta.get("weight_versions")
    if spans is None:
        return [version_number(meta.get("weight_version"))] * n_tokens
    bad = f"rollout: {where}: meta_info.weight_versions {spans!r} "
    if not isinstance(spans, list) or not spans:
        raise EngineError(bad + "is not a non-empty list of {version, start, end} spans")
    out, at = [], 0
    for i, span in enumerate(spans):
        try:
            version, start, end = span["version"], span["start"], span["end"]
        except (KeyError, TypeError):
            raise EngineError(bad + f"span {i} is not an object with version, start and end") from None
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end)):
            raise EngineError(bad + f"span {i}: start and end must be integers")
        if start != at or end < start:
            raise EngineError(
                bad + f"span {i} covers [{start}, {end}); expected contiguous spans from token 0 "
                f"(this one starting at {at})"
            )
        out += [version_number(version)] * (end - start)
        at = end
    if at != n_tokens:
        raise EngineError(bad + f"cover {at} tokens, but the output has {n_tokens}")
    return out


def stale_version(version, sent, expected, pushing: bool = False) -> bool:
    """Is an answer whose final ``weight_version`` is ``version`` stale, for a request sent while
    the client expected ``sent`` when it now expects ``expected`` (None: no push yet, any version
    goes)? See the module's docstring; ``pushing``: a weight push is under way."""
    if expected is None or version is None:
        return False
    v, now, then = version_number(version), version_number(expected), version_number(sent)
    if v is None or now is None or (sent is not None and then is None):
        return str(version) != str(expected)
    if then is not None and v < then:
        return True
    return not pushing and v > now
