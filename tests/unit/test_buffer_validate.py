"""The vectorised ``validate_group`` and ``entry_from_group`` against the plain, one completion
at a time reference code they replaced: same verdict, same reason, same values."""

import math

import msgspec
import numpy as np

from buffer.store import entry_from_group
from core.messages import (LOGPROB_DTYPE, NO_LIMITS, SCHEMA_VERSION, TOKEN_DTYPE, VERSION_DTYPE, InvalidMessage,
                           Limits, make_completion, validate_group, validate_groups)
from tests.support.synth import make_group


def _ids_bad(ids, limits):
    return ids.size and (ids.min() < 0 or (limits.vocab_size and ids.max() >= limits.vocab_size))


def reference_validate(g, limits=NO_LIMITS):
    """validate_group written plainly: one completion at a time."""
    if g.schema_version != SCHEMA_VERSION:
        raise InvalidMessage("schema_version")
    if not g.completions:
        raise InvalidMessage("empty_group")
    if g.seq < 0 or g.start_version < 0:
        raise InvalidMessage("negative_id")
    if not math.isfinite(g.created_at):
        raise InvalidMessage("bad_timestamp")
    if len(g.prompt_tokens) % TOKEN_DTYPE.itemsize:
        raise InvalidMessage("ragged_bytes")
    prompt = np.frombuffer(g.prompt_tokens, TOKEN_DTYPE)
    if limits.group_size and len(g.completions) != limits.group_size:
        raise InvalidMessage("group_size")
    if not prompt.size:
        raise InvalidMessage("empty_prompt")
    if limits.max_prompt_tokens and prompt.size > limits.max_prompt_tokens:
        raise InvalidMessage("prompt_too_long")
    if limits.context and prompt.size >= limits.context:
        raise InvalidMessage("over_context")
    if _ids_bad(prompt, limits):
        raise InvalidMessage("token_out_of_vocab")
    for c in g.completions:
        n_tok, r1 = divmod(len(c.tokens), TOKEN_DTYPE.itemsize)
        n_lp, r2 = divmod(len(c.logprobs), LOGPROB_DTYPE.itemsize)
        n_ver, r3 = divmod(len(c.versions), VERSION_DTYPE.itemsize)
        if r1 or r2 or r3:
            raise InvalidMessage("ragged_bytes")
        if not (n_tok == n_lp == n_ver):
            raise InvalidMessage("length_mismatch")
        if limits.max_new_tokens and n_tok > limits.max_new_tokens:
            raise InvalidMessage("completion_too_long")
        if limits.context and prompt.size + n_tok > limits.context:
            raise InvalidMessage("over_context")
        if not math.isfinite(c.reward):
            raise InvalidMessage("nonfinite_reward")
        if abs(c.reward) > 1e6:
            raise InvalidMessage("reward_out_of_range")
        if n_tok:
            lp = np.frombuffer(c.logprobs, LOGPROB_DTYPE)
            if not np.isfinite(lp).all():
                raise InvalidMessage("nonfinite_logprob")
            if (lp > 1e-4).any():
                raise InvalidMessage("positive_logprob")
            if (lp < -1e4).any():
                raise InvalidMessage("logprob_out_of_range")
            if (np.frombuffer(c.versions, VERSION_DTYPE) < 0).any():
                raise InvalidMessage("negative_version")
            if _ids_bad(np.frombuffer(c.tokens, TOKEN_DTYPE), limits):
                raise InvalidMessage("token_out_of_vocab")
        if c.finish_reason not in ("stop", "length"):
            raise InvalidMessage("finish_reason")


def reason_of(fn, g, limits=NO_LIMITS):
    try:
        fn(g, limits)
    except InvalidMessage as e:
        return e.reason
    return None


VOCAB, MAX_PROMPT, MAX_NEW = 32000, 40, 48
LIMITS = Limits(group_size=3, max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW, vocab_size=VOCAB,
                context=MAX_PROMPT + MAX_NEW - 8)  # a long prompt and a long completion do not fit together


def corrupt(g, rng, limited=False):
    """One or two random defects of the kinds validate_group looks for, in random completions
    (``limited``: also the kinds only the run's limits refuse)."""
    comps = list(g.completions)
    for _ in range(int(rng.integers(1, 3))):
        if not comps:
            break
        i = int(rng.integers(len(comps)))
        c = comps[i]
        kind = int(rng.integers(14 if limited else 10))
        if kind in (0, 1, 2) and (len(c.logprobs) % 4 or len(c.versions) % 4):
            continue  # already ragged by the first defect
        lp = np.frombuffer(c.logprobs[: len(c.logprobs) // 4 * 4], LOGPROB_DTYPE).copy()
        ver = np.frombuffer(c.versions[: len(c.versions) // 4 * 4], VERSION_DTYPE).copy()
        j = int(rng.integers(max(1, lp.size)))
        if kind == 10 and len(c.tokens) % 4 == 0 and c.tokens:
            tok = np.frombuffer(c.tokens, TOKEN_DTYPE).copy()
            tok[int(rng.integers(tok.size))] = rng.choice([-1, VOCAB, VOCAB - 1, 2**31 - 1])
            c = msgspec.structs.replace(c, tokens=tok.tobytes())
        elif kind == 11:
            n = int(rng.choice([0, 1, MAX_PROMPT, MAX_PROMPT + 1]))
            g = msgspec.structs.replace(g, prompt_tokens=rng.integers(-1, VOCAB + 1, n).astype("<i4").tobytes())
        elif kind == 12:
            comps.append(c)  # one completion too many
            continue
        elif kind == 13:
            n = MAX_NEW + int(rng.integers(0, 2))
            c = make_completion(rng.integers(0, VOCAB, n), -rng.random(n), np.zeros(n), "length", 0.0)
        elif kind == 0 and lp.size:
            lp[j] = rng.choice([np.nan, np.inf, -np.inf])
        elif kind == 1 and lp.size:
            lp[j] = rng.choice([0.5, 1e-3, 1e-4, 0.0, 2e-4, -1e4, -1.001e4, -3e38])  # around both bounds
        elif kind == 2 and ver.size:
            ver[j] = -1
        elif kind == 3:
            c = msgspec.structs.replace(c, reward=float(rng.choice([np.nan, np.inf, -np.inf, 1e39, -2e6, 1e6])))
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
            "positive_logprob", "negative_version", "finish_reason", "reward_out_of_range",
            "logprob_out_of_range"} <= seen


def test_with_the_runs_limits_the_vectorised_verdict_is_still_the_reference_one():
    rng = np.random.default_rng(2)
    seen = set()
    for n in range(800):
        g = make_group("a", n, completions=3, tokens=int(rng.integers(1, MAX_NEW + 1)),
                       prompt_tokens=int(rng.integers(1, MAX_PROMPT + 1)), rng=rng, ragged=bool(n % 2))
        if n % 5:
            g = corrupt(g, rng, limited=True)
        want = reason_of(reference_validate, g, LIMITS)
        assert reason_of(validate_group, g, LIMITS) == want, g
        seen.add(want)
    assert {None, "group_size", "empty_prompt", "prompt_too_long", "token_out_of_vocab",
            "completion_too_long", "length_mismatch", "nonfinite_logprob", "over_context"} <= seen


def test_groups_validated_together_get_each_its_own_verdict_reason_and_versions():
    """validate_groups (the buffer's one pass over an actor message) against the reference, one group
    at a time: batches of 1..16 groups, all valid or with a few broken ones among them, some empty."""
    rng = np.random.default_rng(3)
    reasons = set()
    for n in range(300):
        batch = []
        for i in range(int(rng.integers(1, 17))):
            g = make_group("a", i, completions=3, tokens=int(rng.integers(1, MAX_NEW + 1)),
                           prompt_tokens=int(rng.integers(1, MAX_PROMPT + 1)), rng=rng, ragged=bool(i % 2),
                           version=int(rng.integers(0, 5)))
            if n % 3 and rng.random() < 0.2:
                g = corrupt(g, rng, limited=True)
            elif rng.random() < 0.1:
                g = msgspec.structs.replace(g, completions=[make_completion([], [], [], "stop", 0.0)] * 3)
            batch.append(g)
        got = validate_groups(batch, LIMITS)
        assert len(got) == len(batch)
        for g, verdict in zip(batch, got):
            want = reason_of(reference_validate, g, LIMITS)
            if want is None:
                assert verdict == validate_group(g, LIMITS) and verdict[0] == g.min_version(), g
            else:
                assert isinstance(verdict, InvalidMessage) and verdict.reason == want, g
            reasons.add(want)
    assert None in reasons and len(reasons) > 5  # valid groups beside several kinds of broken ones


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
