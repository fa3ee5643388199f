"""The SGLang engine (ARCHITECTURE.md, Seams), its server run from its own venv as SGLang pins its own torch
(``actor.sglang.python``); ``.ci/sglang-contract`` checks the bodies against SGLang's structs. With top-k/top-p on,
the behaviour log-probs are those of the renormalised support the token was drawn from
(``output_token_sampling_logprobs``). ``update_weights_from_tensor`` is not used: it pickles.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from actor.engines import Engine, EngineStopped, Sample
from core import net, precision, proc
from model.sampling import SamplingSpec
from model.tokenizer import Tokenizer
from weightsync.nccl import GROUP_NAME, GroupLink

log = logging.getLogger("driftrl.sglang")

HEALTH_PATH = "/health_generate"  # /health answers 200 without generating unless an env var is set
PAUSE_MODE = "retract"  # running requests go back to the queue and are recomputed on continue
POLL_S = 0.2  # how often a wait looks at the server process and the stop event
STOP_GRACE_S = 15.0  # SIGTERM -> SIGKILL
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # on loopback: never through an http_proxy


class SGLangError(RuntimeError):
    """The server refused a request, answered something unexpected, or is gone."""


def gpu_index(device: str) -> int | None:
    """The CUDA ordinal of ``actor.device`` (None: SGLang's default, the first visible GPU)."""
    if device in ("auto", "cuda"):
        return None
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    raise ValueError(f"actor.device={device!r}: the SGLang engine runs on a CUDA device (auto, cuda or cuda:N)")


def launch_argv(python: str, model_dir: str, port: int, *, dtype: str, mem_fraction: float,
                max_running: int, seed: int, version: int, gpu: int | None = None) -> list[str]:
    """The server's command line (flag names from 0.5.23's ``arg_groups/fields``)."""
    if not python:
        raise ValueError("actor.sglang.python is empty: set it to the interpreter of the venv SGLang is "
                         "installed in (see actor/engines/sglang.py)")
    argv = [python, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--mem-fraction-static", repr(float(mem_fraction)),
            "--max-running-requests", str(max_running), "--random-seed", str(seed),
            "--enable-fp32-lm-head", "--skip-tokenizer-init", "--weight-version", str(version)]
    return argv if gpu is None else [*argv, "--base-gpu-id", str(gpu)]


def truncates(spec: SamplingSpec) -> bool:
    return spec.top_k > 0 or spec.top_p < 1.0


def sampling_params(spec: SamplingSpec, max_new_tokens: int, eos_ids, greedy: bool) -> dict:
    """SGLang ``sampling_params`` (temperature 0 is its greedy, no ``top_k`` its whole vocabulary)."""
    return {"max_new_tokens": int(max_new_tokens), "temperature": 0.0 if greedy else float(spec.temperature),
            "top_p": float(spec.top_p), "stop_token_ids": sorted({int(t) for t in eos_ids}),
            **({"top_k": int(spec.top_k)} if spec.top_k > 0 else {})}


def generate_body(prompt: list[int], params: dict, *, sampling_mask: bool) -> dict:
    """One ``/generate`` body: ``input_ids`` (driftrl tokenises), output-token log-probs only."""
    return {"input_ids": [int(t) for t in prompt], "sampling_params": params, "return_logprob": True,
            "stream": False, **({"return_sampling_mask": True} if sampling_mask else {})}


def init_group_body(host: str, port: int, rank_offset: int, world_size: int) -> dict:
    if not 1 <= rank_offset < world_size:
        raise ValueError(f"rank_offset must be in [1, world_size): rank 0 is the learner; got "
                         f"rank_offset={rank_offset}, world_size={world_size}")
    return {"master_address": host, "master_port": int(port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": GROUP_NAME, "backend": "nccl"}


def bucket_bodies(header) -> list[dict]:
    """One ``/update_weights_from_distributed`` body per bucket, in the order the learner broadcasts."""
    shapes, last = dict(zip(header.names, header.shapes)), len(header.buckets) - 1
    return [{"names": list(b.names), "dtypes": [b.dtype] * len(b.names), "shapes": [list(shapes[n]) for n in b.names],
             "group_name": GROUP_NAME, "load_format": "flattened_bucket", "flush_cache": i == last,
             "weight_version": str(header.version) if i == last else None}
            for i, b in enumerate(header.buckets)]


PAUSE_BODY = {"mode": PAUSE_MODE}
CONTINUE_BODY: dict = {}
BEGIN_BODY: dict = {}
END_BODY: dict = {}
DESTROY_BODY = {"group_name": GROUP_NAME}  # leave the old group before joining a rebuilt one
ABORT_ALL_BODY = {"abort_all": True}


def finish_reason(reason) -> str:
    """driftrl's "stop" / "length" from SGLang's ``finish_reason`` (``BaseFinishReason.to_json``)."""
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind in ("stop", "length"):
        return kind
    if kind == "abort":
        raise SGLangError(f"request aborted by the server: {reason.get('message')!r}")
    raise SGLangError(f"unexpected finish_reason {reason!r} (want a dict with type stop/length)")


def token_versions(meta: dict, n: int, fallback: int) -> list[int]:
    """Per-token versions from ``meta_info["weight_versions"]`` spans [start, end), else ``fallback``."""
    out = [fallback] * n
    for span in meta.get("weight_versions") or []:
        v = fallback  # unless a number: "default" when the server started without --weight-version
        with contextlib.suppress(TypeError, ValueError):
            v = int(span.get("version"))
        for i in range(max(0, int(span["start"])), min(n, int(span["end"]))):
            out[i] = v
    return out


def parse_sample(out: dict, fallback_version: int, *, sampling_mask: bool) -> Sample:
    """A ``Sample`` from one ``/generate`` response, its tokens checked against ``output_ids``."""
    meta = out.get("meta_info")
    if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
        raise SGLangError(f"response has no meta_info.output_token_logprobs (keys: {sorted(out)})")
    entries = meta["output_token_logprobs"]
    tokens = [int(e[1]) for e in entries]
    ids = out.get("output_ids")
    if ids is not None and list(ids) != tokens:
        raise SGLangError(f"output_ids ({len(ids)}) and output_token_logprobs ({len(tokens)}) disagree")
    logprobs = ([float(x) for x in meta.get("output_token_sampling_logprobs") or []] if sampling_mask
                else [float(e[0]) for e in entries])
    if len(logprobs) != len(tokens):
        raise SGLangError(f"output_token_sampling_logprobs has {len(logprobs)} entries for {len(tokens)} tokens")
    return Sample(tokens, logprobs, token_versions(meta, len(tokens), fallback_version),
                  finish_reason(meta.get("finish_reason")))


def post_ok(server, path: str, body: dict, timeout_s: float) -> None:
    """POST to a weight-update route: it answers ``{"success": bool, "message": str}``; False raises."""
    reply = server.post(path, body, timeout_s)
    if isinstance(reply, dict) and reply.get("success") is False:
        raise SGLangError(f"{path} failed: {reply.get('message')}")


class SGLangServer:
    """One ``sglang.launch_server`` child in its own process group, and JSON over HTTP to it."""

    def __init__(self, argv: list[str], port: int, *, request_timeout_s: float = 600.0):
        self.argv, self.url, self.request_timeout_s = argv, f"http://127.0.0.1:{port}", request_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float, stop=None) -> None:
        log.info("starting SGLang: %s", " ".join(self.argv))
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,  # stdout/stderr: the actor's log
                                     start_new_session=True, preexec_fn=proc.sigterm_with_parent)
        deadline = time.monotonic() + timeout_s
        try:
            while not self._healthy():
                if not self.alive():
                    raise SGLangError(f"the SGLang server exited with status {self.proc.returncode} before it was "
                                      "healthy (see the actor log)")
                if stop is not None and stop.is_set():
                    raise EngineStopped("stopped while the SGLang server was starting")
                if time.monotonic() > deadline:
                    raise SGLangError(f"the SGLang server was not healthy within {timeout_s:.0f}s "
                                      "(actor.sglang.start_timeout_s)")
                time.sleep(POLL_S)
        except BaseException:
            self.stop()  # never leave a half-started server behind
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _healthy(self) -> bool:
        try:
            with _HTTP.open(self.url + HEALTH_PATH, timeout=30) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False  # not listening yet, or 503 while loading

    def post(self, path: str, body: dict, timeout_s: float | None = None):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with _HTTP.open(req, timeout=timeout_s or self.request_timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise SGLangError(f"POST {path}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise SGLangError(f"POST {path}: {e}") from None
        return json.loads(raw) if raw else None

    def stop(self) -> None:
        """SIGTERM to the whole group (SGLang forks its scheduler and detokenizer), then SIGKILL."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_GRACE_S)


def join_body(init) -> dict:
    """The ``/init_weights_update_group`` body for a ``CollectiveInit`` (b"host:port" of the store)."""
    host, port = init.unique_id.decode().rsplit(":", 1)
    return init_group_body(host, int(port), init.rank, init.world_size)


def push_update(server: SGLangServer, header, timeout_s: float) -> None:
    """pause -> begin -> one receive per bucket -> end -> continue. NCCL needs every rank in every
    broadcast, so a queued version is received even when a newer one follows."""
    server.post("/pause_generation", PAUSE_BODY, timeout_s)
    post_ok(server, "/begin_weight_update", BEGIN_BODY, timeout_s)
    for body in bucket_bodies(header):
        post_ok(server, "/update_weights_from_distributed", body, timeout_s)
    post_ok(server, "/end_weight_update", END_BODY, timeout_s)
    server.post("/continue_generation", CONTINUE_BODY, timeout_s)


class SGLangEngine(Engine):
    """``weights``: a :class:`GroupLink` to the learner's publisher, or None (fixed weights, version 0)."""

    name = "sglang"
    receives = "group"
    supports_prefixes = True  # a prefix is sent as input ids after the prompt (episodes, resume)

    def __init__(self, server: SGLangServer, spec: SamplingSpec, *, eos_ids, max_new_tokens: int = 16,
                 max_batch: int = 256, weights=None, start_timeout_s: float = 600.0,
                 update_timeout_s: float = 300.0, restart=None):
        super().__init__(weights)
        self.server, self.spec, self.eos_ids = server, spec, sorted({int(t) for t in eos_ids})
        self.max_new_tokens, self.max_batch = max_new_tokens, max_batch
        self.start_timeout_s, self.update_timeout_s = start_timeout_s, update_timeout_s
        self.restart = restart  # () -> SGLangServer: a fresh server on the model directory
        self.poisoned: str | None = None  # why the server's weights cannot be trusted

    @classmethod
    def from_config(cls, actor_cfg, model_dir: str, weights=None, seed: int = 0) -> "SGLangEngine":
        gpu, sg = gpu_index(str(actor_cfg.device)), actor_cfg.sglang
        if weights is not None and not isinstance(weights, GroupLink):
            raise ValueError(f"actor.engine=sglang takes its weights through a GroupLink (weightsync.transport="
                             f"torch_dist), got a {type(weights).__name__}")

        def fresh() -> SGLangServer:
            port = net.free_port()
            argv = launch_argv(sg.python, model_dir, port, dtype=precision.dtype_name(actor_cfg.dtype, "cuda"),
                               mem_fraction=sg.mem_fraction, max_running=actor_cfg.max_batch, seed=seed,
                               version=0 if weights is None else -1, gpu=gpu)
            return SGLangServer(argv, port, request_timeout_s=sg.request_timeout_s)

        engine = cls(fresh(), SamplingSpec.of(actor_cfg), eos_ids=Tokenizer.from_dir(model_dir).eos_ids,
                     max_new_tokens=actor_cfg.max_new_tokens, max_batch=actor_cfg.max_batch, weights=weights,
                     start_timeout_s=sg.start_timeout_s, update_timeout_s=sg.update_timeout_s, restart=fresh)
        try:
            engine.boot()
        except BaseException:
            engine.server.stop()
            raise
        return engine

    def boot(self) -> None:
        self.server.start(self.start_timeout_s, self.stop)
        if self.weights is not None:
            post_ok(self.server, "/init_weights_update_group", join_body(self.weights.join()), self.update_timeout_s)

    def _apply_weights(self) -> int | None:
        if self.poisoned is not None:
            return self._heal()
        latest = self.weights.latest_version()
        if self.weights.rejoin is not None:  # the learner rebuilt the group: leave the old one, join the new
            body, self.weights.rejoin = join_body(self.weights.rejoin), None
            try:
                post_ok(self.server, "/destroy_weights_update_group", DESTROY_BODY, self.update_timeout_s)
                post_ok(self.server, "/init_weights_update_group", body, self.update_timeout_s)
            except (SGLangError, OSError) as e:
                return self.poison(f"re-joining the rebuilt weight group: {e}")
        return self._push_pending() if latest > self.version else None

    def _push_pending(self) -> int | None:
        """Receive every queued version in order; the newest is in effect after the last."""
        t0, applied = time.perf_counter(), None
        while self.weights.pending:
            header = self.weights.pending.pop(0)
            try:
                push_update(self.server, header, self.update_timeout_s)
            except (SGLangError, OSError) as e:
                return self.poison(f"version {header.version}: {e}")
            applied = header.version
        s = self.weights.stats
        s.apply_s = time.perf_counter() - t0
        s.apply_s_total += s.apply_s
        return applied

    def poison(self, why: str) -> None:  # a failed or timed-out update: the weights may be half-written
        log.error("SGLang weight update failed (%s): the engine is poisoned and will restart", why)
        self.poisoned = why

    def _heal(self) -> int | None:
        """Restart on the model directory, re-join, and pull a whole version (poisoned until one lands)."""
        if self.restart is None:
            raise SGLangError(f"the SGLang engine is poisoned ({self.poisoned}) and cannot restart")
        self.server.stop()
        self.server = self.restart()
        self.weights.restarts += 1
        self.boot()
        deadline = time.monotonic() + self.update_timeout_s
        while self.weights.latest_version() < 0:
            if time.monotonic() > deadline:
                raise SGLangError(f"no weight version arrived within {self.update_timeout_s:.0f}s after a restart")
            if self.stop is not None and self.stop.is_set():
                raise EngineStopped("stopped while re-pulling weights after a restart")
            time.sleep(POLL_S)
        self.poisoned = None
        return self._push_pending()

    def _stream(self, prompts: list[list[int]], limits: list[int], greedy: bool,
                prefixes: list[Sample | None] | None = None) -> Iterator[tuple[int, Sample]]:
        """Every prompt in flight at once (at most ``max_batch``), each with its own limit."""
        if self.poisoned is not None:
            raise SGLangError(f"the SGLang engine is poisoned ({self.poisoned}); refresh_weights() restarts it")
        mask = truncates(self.spec) and not greedy
        prefixes = prefixes or [None] * len(prompts)
        stops = [*self.eos_ids, *(self.env.pause_ids if self.env is not None else ())]
        sent = [q.tokens if q else [] for q in prefixes]
        bodies = [generate_body(p + d, sampling_params(self.spec, n - len(d), stops, greedy), sampling_mask=mask)
                  for p, n, d in zip(prompts, limits, sent)]
        pool = cf.ThreadPoolExecutor(min(self.max_batch, len(bodies)), thread_name_prefix="sglang")
        try:
            futures = {pool.submit(self.server.post, "/generate", b): i for i, b in enumerate(bodies)}
            version, waiting = self.version, set(futures)
            while waiting:
                if self.stop is not None and self.stop.is_set():
                    pool.shutdown(wait=False, cancel_futures=True)  # what has not started never will
                    try:
                        self.server.post("/abort_request", ABORT_ALL_BODY, 10)
                    except SGLangError as e:
                        log.warning("could not abort the server's requests: %s", e)
                    raise EngineStopped("stopped mid-generation")
                done, waiting = cf.wait(waiting, timeout=POLL_S, return_when=cf.FIRST_COMPLETED)
                for f in done:
                    i = futures[f]
                    yield i, self._joined(prefixes[i], parse_sample(f.result(), version, sampling_mask=mask))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a consumer that stops early waits for nothing

    def _joined(self, prefix: Sample | None, s: Sample) -> Sample:
        """``s`` after ``prefix``; a stop on an environment's pause id ends a turn ("tool")."""
        if self.env is not None and s.finish_reason == "stop" and s.tokens and s.tokens[-1] in self.env.pause_ids:
            s.finish_reason = "tool"
        if prefix is None:
            return s
        mask = None if prefix.mask is None else prefix.mask + [1] * len(s.tokens)
        return Sample(prefix.tokens + s.tokens, prefix.logprobs + s.logprobs, prefix.versions + s.versions,
                      s.finish_reason, mask)

    def close(self) -> None:
        self.server.stop()
        super().close()
