"""The SGLang adapter's pure logic, without SGLang: request bodies, response parsing into
``Sample``, finish-reason mapping, per-token versions, and the poisoning state machine (a fake
server and link stand in for the HTTP server and the learner's publisher). That these bodies and
responses are SGLang's own shapes is checked in ``tests/sglang`` against SGLang's structs."""

from __future__ import annotations

import os
import sys
import time

import pytest

from actor.engines import make_engine
from actor.engines import sglang as S
from core import config as C
from model.sampling import SamplingSpec
from weightsync import layout
from weightsync.nccl import CollectiveInit, GroupLink


def _header(version: int = 7):
    specs = [("embed.weight", "bfloat16", [10, 4]), ("norm.weight", "float32", [4]),
             ("lm_head.weight", "bfloat16", [10, 4]), ("layer.bias", "float32", [3])]
    return layout.plan(version, specs, bucket_bytes=128)


def _response(tokens, logprobs, finish, spans=None, **meta):
    meta = {"finish_reason": finish, "output_token_logprobs": [[lp, t, None] for t, lp in zip(tokens, logprobs)],
            **meta}
    if spans is not None:
        meta["weight_versions"] = spans
    return {"output_ids": list(tokens), "meta_info": meta}


# ---- requests


def test_sampling_params_map_driftrl_spec():
    plain = S.sampling_params(SamplingSpec(0.7, 0, 1.0), 5, [3, 2, 3], greedy=False)
    assert plain == {"max_new_tokens": 5, "temperature": 0.7, "top_p": 1.0, "stop_token_ids": [2, 3]}
    truncated = S.sampling_params(SamplingSpec(1.0, 40, 0.9), 5, [2], greedy=False)
    assert truncated["top_k"] == 40 and truncated["top_p"] == 0.9
    assert S.sampling_params(SamplingSpec(0.7), 5, [2], greedy=True)["temperature"] == 0.0


def test_generate_body_asks_for_logprobs_and_mask_only_when_truncating():
    params = S.sampling_params(SamplingSpec(), 4, [2], greedy=False)
    body = S.generate_body([5, 6], params, sampling_mask=False)
    assert body["input_ids"] == [5, 6] and body["return_logprob"] is True and "return_sampling_mask" not in body
    assert S.generate_body([5], params, sampling_mask=True)["return_sampling_mask"] is True
    assert S.truncates(SamplingSpec(1.0, 0, 0.95)) and S.truncates(SamplingSpec(1.0, 3, 1.0))
    assert not S.truncates(SamplingSpec(0.5, 0, 1.0))


def test_bucket_bodies_follow_the_header_and_mark_the_version_once():
    header = _header(7)
    bodies = S.bucket_bodies(header)
    assert len(bodies) == len(header.buckets) > 1
    assert [n for b in bodies for n in b["names"]] == [n for b in header.buckets for n in b.names]
    for body, bucket in zip(bodies, header.buckets):
        assert set(body["dtypes"]) == {bucket.dtype}
        assert body["shapes"] == [header.shapes[header.names.index(n)] for n in body["names"]]
        assert body["load_format"] == "flattened_bucket" and body["group_name"] == S.GROUP_NAME
    assert [b["weight_version"] for b in bodies] == [None] * (len(bodies) - 1) + ["7"]
    assert [b["flush_cache"] for b in bodies] == [False] * (len(bodies) - 1) + [True]


def test_init_group_body_and_launch_argv_refuse_bad_values():
    body = S.init_group_body("10.0.0.1", 29500, 1, 2)
    assert body["rank_offset"] == 1 and body["world_size"] == 2 and body["backend"] == "nccl"
    with pytest.raises(ValueError, match="rank_offset"):
        S.init_group_body("h", 1, 0, 2)
    with pytest.raises(ValueError, match="actor.sglang.python"):
        S.launch_argv("", "/m", 1, dtype="bfloat16", mem_fraction=0.5, max_running=4, seed=0, version=0)
    argv = S.launch_argv("/v/bin/python", "/m", 31, dtype="bfloat16", mem_fraction=0.5, max_running=4, seed=2,
                         version=-1)
    assert argv[:3] == ["/v/bin/python", "-m", "sglang.launch_server"] and "--enable-fp32-lm-head" in argv
    assert argv[argv.index("--weight-version") + 1] == "-1" and "--base-gpu-id" not in argv
    assert S.launch_argv("p", "/m", 1, dtype="float32", mem_fraction=0.5, max_running=1, seed=0, version=0,
                         gpu=3)[-2:] == ["--base-gpu-id", "3"]
    assert [S.gpu_index(d) for d in ("auto", "cuda", "cuda:2")] == [None, None, 2]
    with pytest.raises(ValueError, match="actor.device='cpu'"):
        S.gpu_index("cpu")


# ---- responses


@pytest.mark.parametrize("kind,want", [("stop", "stop"), ("length", "length")])
def test_finish_reason_maps(kind, want):
    assert S.finish_reason({"type": kind, "matched": 2}) == want


@pytest.mark.parametrize("bad", [{"type": "abort", "message": "oom"}, None, {"type": "eos"}, "stop"])
def test_finish_reason_refuses_abort_and_unknown(bad):
    with pytest.raises(S.SGLangError, match="abort|finish_reason"):
        S.finish_reason(bad)


def test_token_versions_from_spans_else_fallback():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert S.token_versions({"weight_versions": spans}, 5, fallback=9) == [3, 3, 4, 4, 4]
    assert S.token_versions({}, 3, fallback=9) == [9, 9, 9]
    assert S.token_versions({"weight_versions": [{"version": "default", "start": 0, "end": 2}]}, 2, 5) == [5, 5]


def test_parse_sample_takes_tokens_logprobs_versions_and_finish():
    out = _response([4, 5, 2], [-0.5, -1.0, -0.25], {"type": "stop", "matched": 2},
                    spans=[{"version": "6", "start": 0, "end": 3}])
    s = S.parse_sample(out, 1, sampling_mask=False)
    assert (s.tokens, s.logprobs, s.versions, s.finish_reason) == ([4, 5, 2], [-0.5, -1.0, -0.25], [6, 6, 6], "stop")
    out["meta_info"]["output_token_sampling_logprobs"] = [-0.1, -0.2, -0.3]
    assert S.parse_sample(out, 1, sampling_mask=True).logprobs == [-0.1, -0.2, -0.3]


def test_parse_sample_refuses_inconsistent_responses():
    out = _response([4, 5], [-0.5, -1.0], {"type": "length", "length": 2})
    out["output_ids"] = [4, 6]
    with pytest.raises(S.SGLangError, match="disagree"):
        S.parse_sample(out, 0, sampling_mask=False)
    with pytest.raises(S.SGLangError, match="sampling_logprobs"):
        S.parse_sample(_response([4], [-0.5], {"type": "length"}), 0, sampling_mask=True)
    with pytest.raises(S.SGLangError, match="output_token_logprobs"):
        S.parse_sample({"output_ids": [1], "meta_info": {}}, 0, sampling_mask=False)
    with pytest.raises(S.SGLangError, match="/x failed: nccl timeout"):
        S.post_ok(FakeServer(fail="/x"), "/x", {}, 1)


# ---- the poisoning state machine


class FakeServer:
    """Records every POST; ``fail`` names a path that answers success=False; ``generate``
    answers every /generate with the same finished response."""

    def __init__(self, fail: str | None = None):
        self.posts: list[tuple[str, dict]] = []
        self.fail, self.started, self.stopped = fail, 0, 0

    def start(self, timeout_s, stop=None):
        self.started += 1

    def stop(self):
        self.stopped += 1

    def post(self, path, body, timeout_s=None):
        self.posts.append((path, body))
        if path == "/generate":
            return _response([7, 2], [-0.1, -0.2], {"type": "stop", "matched": 2},
                             spans=[{"version": "5", "start": 0, "end": 2}])
        return {"success": path != self.fail, "message": "ok" if path != self.fail else "nccl timeout"}


def _init(port: int, backend: str = "torch_dist") -> CollectiveInit:
    return CollectiveInit(1, 2, backend, f"127.0.0.1:{port}".encode(), layout.with_version(_header(), -1))


class FakeLink(GroupLink):
    """The learner's side as queued headers; ``join`` answers a fixed rank (no sockets)."""

    def __init__(self):  # the real one connects to the publisher's socket
        from weightsync.base import SubscriberStats

        self.pending, self.stats, self.joins, self.arrivals, self.restarts = [], SubscriberStats(), 0, [], 0
        self.rejoin = None

    def join(self):
        self.joins += 1
        self.pending.clear()
        return _init(1234)

    def latest_version(self):
        if self.arrivals:
            self.pending.append(self.arrivals.pop(0))
        return self.pending[-1].version if self.pending else -1

    def _close(self):
        pass


def _engine(server, link, restart=None):
    engine = S.SGLangEngine(server, SamplingSpec(), eos_ids=[2], max_new_tokens=4, max_batch=2, weights=link,
                            update_timeout_s=5, restart=restart)
    engine.boot()
    return engine


def test_update_sequence_pauses_begins_receives_each_bucket_ends_continues():
    server, link = FakeServer(), FakeLink()
    engine = _engine(server, link)
    assert server.posts[0][0] == "/init_weights_update_group" and link.joins == 1
    link.arrivals.append(_header(5))
    assert engine.refresh_weights() == 5
    paths = [p for p, _ in server.posts[1:]]
    n = len(_header(5).buckets)
    assert paths == ["/pause_generation", "/begin_weight_update"] + ["/update_weights_from_distributed"] * n + [
        "/end_weight_update", "/continue_generation"]
    assert engine.refresh_weights() == 5  # nothing newer: no request
    assert len(server.posts) == 1 + len(paths)
    assert [s.versions for s in engine.generate([[1, 3], [4]])] == [[5, 5], [5, 5]]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []])


def test_failed_update_poisons_then_restart_re_joins_and_re_pulls():
    first, second = FakeServer(fail="/update_weights_from_distributed"), FakeServer()
    link = FakeLink()
    engine = _engine(first, link, restart=lambda: second)
    link.arrivals.append(_header(3))
    assert engine.refresh_weights() == -1 and "version 3" in engine.poisoned
    with pytest.raises(S.SGLangError, match="poisoned"):
        engine.generate([[1]])
    link.arrivals.append(_header(4))
    assert engine.refresh_weights() == 4 and engine.poisoned is None
    assert first.stopped == 1 and second.started == 1 and link.joins == 2 and link.restarts == 1
    assert second.posts[0][0] == "/init_weights_update_group"
    assert engine.generate([[1]])[0].tokens == [7, 2]


def test_poisoned_without_restart_fails_loudly():
    link = FakeLink()
    engine = _engine(FakeServer(fail="/begin_weight_update"), link)
    link.arrivals.append(_header(1))
    engine.refresh_weights()
    with pytest.raises(S.SGLangError, match="cannot restart"):
        engine.refresh_weights()


def test_registry_and_config_reach_the_sglang_engine(tmp_path):
    cfg = C.load(None, ["actor.engine=sglang", "actor.sglang.python=/nonexistent/python"])
    assert cfg.actor.sglang.mem_fraction == 0.8
    with pytest.raises(ValueError, match="GroupLink"):
        make_engine(cfg.actor, str(tmp_path), weights=object())
    with pytest.raises(C.ConfigError, match=r"\$\.actor\.sglang\.mem_fraction"):
        C.load(None, ["actor.sglang.mem_fraction=1.5"])


# ---- the HTTP client and the server process (real loopback sockets and processes)

HEALTH_SERVER = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, code, body):
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)
    def do_GET(self):
        self._send(200 if self.path == "/health_generate" else 404, {})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(200, {"echo": body}) if self.path == "/ok" else self._send(400, {"error": "bad " + self.path})
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.slow
def test_server_waits_for_health_posts_json_and_stops_its_process_group():
    from core.net import free_port

    port = free_port()
    server = S.SGLangServer([sys.executable, "-c", HEALTH_SERVER, str(port)], port, request_timeout_s=10)
    server.start(timeout_s=30)
    try:
        assert server.post("/ok", {"a": [1, 2]}) == {"echo": {"a": [1, 2]}}
        with pytest.raises(S.SGLangError, match="HTTP 400.*bad /nope"):
            server.post("/nope", {})
    finally:
        server.stop()
    assert not server.alive() and server.proc.returncode is not None
    with pytest.raises(S.SGLangError, match="/ok"):
        server.post("/ok", {}, timeout_s=2)  # nothing listens any more


@pytest.mark.slow
def test_server_that_exits_early_is_reported_with_its_status():
    server = S.SGLangServer([sys.executable, "-c", "import sys; sys.exit(3)"], 1, request_timeout_s=5)
    with pytest.raises(S.SGLangError, match="status 3"):
        server.start(timeout_s=30)


def test_stop_event_abandons_the_batch_and_aborts_the_server_requests():
    import threading

    server, link = FakeServer(), FakeLink()
    engine = _engine(server, link)
    engine.stop = threading.Event()
    engine.stop.set()
    with pytest.raises(S.EngineStopped):
        engine.generate([[1], [2]])
    assert ("/abort_request", S.ABORT_ALL_BODY) in server.posts


def _fake_publisher(run_dir: str, backend: str, versions: list[int]):
    """The learner's side of the rendezvous over a real ROUTER socket, as the adapter would speak
    it: endpoint file, wait for Hello, CollectiveInit, then one header per version."""
    import json
    import threading

    import zmq

    from core.files import atomic_write
    from core.messages import Hello, decoder, encode
    from weightsync.nccl import endpoint_path

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    path = endpoint_path(run_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, json.dumps({"host": "127.0.0.1", "port": port}).encode())

    def serve():
        peer, frame = sock.recv_multipart()
        assert decoder(Hello).decode(frame).role == "weightsync"
        sock.send_multipart([peer, encode(_init(29555, backend))])
        for v in versions:  # a version number, or a CollectiveInit (the group rebuilt)
            msg = v if isinstance(v, CollectiveInit) else layout.with_version(_header(), v)
            sock.send_multipart([peer, encode(msg)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread, sock, ctx


def test_link_joins_the_learner_group_and_queues_headers(tmp_path):
    thread, sock, ctx = _fake_publisher(str(tmp_path), "torch_dist", [3, 4])
    link = GroupLink(str(tmp_path), timeout_s=10, actor_id="actor0")
    try:
        assert S.join_body(link.join()) == S.init_group_body("127.0.0.1", 29555, 1, 2)
        thread.join(10)
        deadline = time.monotonic() + 10
        while link.latest_version() < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [h.version for h in link.pending] == [3, 4]
    finally:
        link.close()
        sock.close()
        ctx.term()


def test_link_refuses_a_publisher_that_set_up_no_torch_dist_group(tmp_path):
    thread, sock, ctx = _fake_publisher(str(tmp_path), "nccl", [])
    link = GroupLink(str(tmp_path), timeout_s=10)
    try:
        with pytest.raises(ValueError, match="set weightsync.transport=torch_dist"):
            link.join()
    finally:
        thread.join(10)
        link.close()
        sock.close()
        ctx.term()


def test_a_rebuilt_group_is_rejoined_before_the_next_version(tmp_path):
    """Another actor's server restarted: the learner rebuilt the group and sent every peer a new
    CollectiveInit. The link keeps the new join body and only the headers that follow it; the
    engine leaves the old group, joins the new one, then receives the version."""
    thread, sock, ctx = _fake_publisher(str(tmp_path), "torch_dist", [3, _init(29666), 4])
    link = GroupLink(str(tmp_path), timeout_s=10, actor_id="actor0")
    try:
        link.join()
        thread.join(10)
        deadline = time.monotonic() + 10
        while link.latest_version() < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [h.version for h in link.pending] == [4]  # 3 belonged to the old group
        assert link.rejoin == _init(29666)
    finally:
        link.close()
        sock.close()
        ctx.term()
    server, fake = FakeServer(), FakeLink()
    engine = _engine(server, fake)
    fake.rejoin, fake.arrivals = _init(29666), [_header(4)]
    assert engine.refresh_weights() == 4 and fake.rejoin is None
    paths = [p for p, _ in server.posts[1:]]
    assert paths[:3] == ["/destroy_weights_update_group", "/init_weights_update_group", "/pause_generation"]
    assert server.posts[2][1]["master_port"] == 29666


def test_a_refused_rejoin_poisons_the_engine():
    server, fake = FakeServer(fail="/destroy_weights_update_group"), FakeLink()
    engine = _engine(server, fake)
    fake.rejoin = _init(29666)
    assert engine.refresh_weights() == -1 and "re-joining" in engine.poisoned


def test_an_episode_goes_turn_by_turn_with_the_prefix_as_input_ids():
    """SGLang stops on the environment's pause id as on EOS; the next turn sends the prompt, the sampled
    tokens and the environment's as input ids, for what is left of the limit; the mask is the torch engine's."""
    from actor.episodes import Environment

    class Env(Environment):
        pause_ids = (9,)

        def respond(self, samples):
            return [[5, 5] for _ in samples]

    class Turns(FakeServer):
        def post(self, path, body, timeout_s=None):
            if path != "/generate":
                return super().post(path, body, timeout_s)
            self.posts.append((path, body))
            first = body["input_ids"] == [1]
            return _response([7, 9] if first else [8, 2], [-0.1, -0.2], {"type": "stop", "matched": 9 if first else 2},
                             spans=[{"version": "5", "start": 0, "end": 2}])

    server = Turns()
    engine = S.SGLangEngine(server, SamplingSpec(), eos_ids=[2], max_new_tokens=10, max_batch=2)
    engine.env = Env()
    s = engine.generate([[1]])[0]
    assert (s.tokens, s.mask, s.finish_reason) == ([7, 9, 5, 5, 8, 2], [1, 1, 0, 0, 1, 1], "stop")
    assert s.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.1, -0.2] and s.versions == [5] * 6
    bodies = [b for p, b in server.posts if p == "/generate"]
    assert [b["input_ids"] for b in bodies] == [[1], [1, 7, 9, 5, 5]]
    assert [b["sampling_params"]["max_new_tokens"] for b in bodies] == [10, 6]
    assert all(b["sampling_params"]["stop_token_ids"] == [2, 9] for b in bodies)
