"""The vectorised ``validate_group`` and ``entry_from_group`` against the plain, one completion
at a time reference code they replaced: same verdict, same reason, same values."""

import math

import msgspec
import numpy as np

from buffer.store import entry_from_group
from core.messages import (LOGPROB_DTYPE, SCHEMA_VERSION, TOKEN_DTYPE, VERSION_DTYPE, InvalidMessage,
                           make_completion, validate_group)
from tests.support.synth import make_group


def reference_validate(g):
    """validate_group as it was before vectorisation: one completion at a time."""
    if g.schema_version != SCHEMA_VERSION:
        raise InvalidMessage("schema_version")
    if not g.completions:
        raise InvalidMessage("empty_group")
    if g.seq < 0 or g.start_version < 0:
        raise InvalidMessage("negative_id")
    if len(g.prompt_tokens) % TOKEN_DTYPE.itemsize:
        raise InvalidMessage("ragged_bytes")
    for c in g.completions:
        n_tok, r1 = divmod(len(c.tokens), TOKEN_DTYPE.itemsize)
        n_lp, r2 = divmod(len(c.logprobs), LOGPROB_DTYPE.itemsize)
        n_ver, r3 = divmod(len(c.versions), VERSION_DTYPE.itemsize)
        if r1 or r2 or r3:
            raise InvalidMessage("ragged_bytes")
        if not (n_tok == n_lp == n_ver):
            raise InvalidMessage("length_mismatch")
        if not math.isfinite(c.reward):
            raise InvalidMessage("nonfinite_reward")
        if n_tok:
            lp = np.frombuffer(c.logprobs, LOGPROB_DTYPE)
            if not np.isfinite(lp).all():
                raise InvalidMessage("nonfinite_logprob")
            if (lp > 1e-4).any():
                raise InvalidMessage("positive_logprob")
            if (np.frombuffer(c.versions, VERSION_DTYPE) < 0).any():
                raise InvalidMessage("negative_version")
        if c.finish_reason not in ("stop", "length"):
            raise InvalidMessage("finish_reason")


def reason_of(fn, g):
    try:
        fn(g)
    except InvalidMessage as e:
        return e.reason
    return None


def corrupt(g, rng):
    """One or two random defects of the kinds validate_group looks for, in random completions."""
    comps = list(g.completions)
    for _ in range(int(rng.integers(1, 3))):
        if not comps:
            break
        i = int(rng.integers(len(comps)))
        c = comps[i]
        kind = int(rng.integers(10))
        if kind in (0, 1, 2) and (len(c.logprobs) % 4 or len(c.versions) % 4):
            continue  # already ragged by the first defect
        lp = np.frombuffer(c.logprobs[: len(c.logprobs) // 4 * 4], LOGPROB_DTYPE).copy()
        ver = np.frombuffer(c.versions[: len(c.versions) // 4 * 4], VERSION_DTYPE).copy()
        j = int(rng.integers(max(1, lp.size)))
        if kind == 0 and lp.size:
            lp[j] = rng.choice([np.nan, np.inf, -np.inf])
        elif kind == 1 and lp.size:
            lp[j] = rng.choice([0.5, 1e-3, 1e-4, 0.0, 2e-4])  # around the 1e-4 tolerance
        elif kind == 2 and ver.size:
            ver[j] = -1
        elif kind == 3:
            c = msgspec.structs.replace(c, reward=float(rng.choice([np.nan, np.inf, -np.inf])))
        elif kind == 4:
            c = msgspec.structs.replace(c, finish_reason=str(rng.choice(["", "eos", "Stop"])))
        elif kind == 5:
            c = msgspec.structs.replace(c, tokens=c.tokens[:-4])
        elif kind == 6:
            c = msgspec.structs.replace(c, versions=c.versions + b"\0")
        elif kind == 7:
            c = make_completion([], [], [], "stop", 0.0)  # empty completions are valid
        elif kind == 8:
            comps = []
            break
        else:
            c = msgspec.structs.replace(c, logprobs=c.logprobs[:-4])
        if kind in (0, 1, 2):
            c = msgspec.structs.replace(c, logprobs=lp.tobytes(), versions=ver.tobytes())
        comps[i] = c
    return msgspec.structs.replace(g, completions=comps)


def test_vectorised_validate_group_gives_the_reference_verdict_and_reason():
    rng = np.random.default_rng(0)
    seen = set()
    for n in range(600):
        g = make_group("a", n, completions=int(rng.integers(1, 5)), tokens=int(rng.integers(1, 40)),
                       rng=rng, ragged=bool(n % 2))
        if n % 6:  # mostly broken ones; some valid
            g = corrupt(g, rng)
        want = reason_of(reference_validate, g)
        assert reason_of(validate_group, g) == want, g
        seen.add(want)
    # the sample exercised every completion-level reason and the valid case
    assert {None, "empty_group", "ragged_bytes", "length_mismatch", "nonfinite_reward", "nonfinite_logprob",
            "positive_logprob", "negative_version", "finish_reason"} <= seen


def test_all_empty_completions_are_valid_and_keep_the_start_version():
    g = make_group("a", 0, completions=2, tokens=4, version=3)
    g = msgspec.structs.replace(g, completions=[make_completion([], [], [], "stop", 0.0)] * 2)
    validate_group(g)
    e = entry_from_group(g, b"xx")
    assert (e.min_version, e.length, e.nbytes) == (g.min_version(), 0, 2) == (3, 0, 2)


def test_entry_from_group_matches_the_per_completion_definitions():
    rng = np.random.default_rng(1)
    for n in range(50):
        g = make_group("a", n, completions=int(rng.integers(1, 6)), tokens=int(rng.integers(1, 64)),
                       version=int(rng.integers(0, 5)), rng=rng)
        e = entry_from_group(g)
        assert e.min_version == g.min_version()
        assert e.length == max(c.num_tokens for c in g.completions)
        assert e.nbytes == g.nbytes()
