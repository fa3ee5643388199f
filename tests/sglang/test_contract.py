"""Contract of the SGLang adapter (actor/engines/sglang.py) with the pinned SGLang 0.5.23, on CPU.

Requests: every body the adapter sends is validated the way the server validates it -- the
route exists in SGLang's own FastAPI app with that method, its declared body type accepts the
JSON (pydantic, as FastAPI runs it), ``/generate`` also passes the API schema gate
(``api_contract.generate_contract_error``) and the tokenizer manager's normalisation and
``SamplingParams.normalize``/``verify`` -- and, stricter than the server, which ignores unknown
keys: a key the struct does not declare, or a required one missing, fails the test (a typo would
otherwise be silently dropped). Responses are assembled with SGLang's own pieces
(``BaseFinishReason.to_json``, ``TokenizerManager.detokenize_logprob_tokens``,
``compute_weight_version_spans`` / ``add_weight_versions_to_meta_info``,
``SamplingMaskChunk.to_lists``), keyed as ``_handle_batch_output`` keys them, sent through
orjson as the server sends them, checked by the API schema's ``GenerateResponse`` decoder, and
parsed by the adapter. The launch command parses with SGLang's own ``prepare_server_args``. The
engine's real HTTP traffic (weight update, then generation) goes to a loopback server that
judges every body the same way. The learner's publisher against SGLang's own weight receiver:
test_publisher_contract.py.

Runs in the SGLang venv (``.ci/sglang-contract``); skips where SGLang is not importable.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

io_struct = pytest.importorskip("sglang.srt.managers.io_struct")

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import orjson  # noqa: E402
import pydantic  # noqa: E402
import torch  # noqa: E402
from sglang.api.v1.api_types import GenerateResponse  # noqa: E402
from sglang.srt.entrypoints.api_contract import generate_contract_error  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_TOKEN  # noqa: E402
from sglang.srt.managers.tokenizer_manager import TokenizerManager  # noqa: E402
from sglang.srt.sampling.sampling_mask import SamplingMaskChunk  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from sglang.srt.utils.weight_versions import (  # noqa: E402
    WeightVersionEvent,
    add_weight_versions_to_meta_info,
    compute_weight_version_spans,
)
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket  # noqa: E402

from actor.engines import sglang as S  # noqa: E402
from model.sampling import SamplingSpec  # noqa: E402
from weightsync import layout  # noqa: E402

VOCAB = 64
EOS = [2, 5]
SPECS = [SamplingSpec(1.0, 0, 1.0), SamplingSpec(0.7, 20, 1.0), SamplingSpec(1.0, 0, 0.9)]


@pytest.fixture(scope="module")
def routes():
    """``path -> (methods, body type)`` of SGLang's own HTTP app."""
    from fastapi.routing import APIRoute
    from sglang.srt.entrypoints.http_server import app

    out = {}
    for r in app.routes:
        if isinstance(r, APIRoute):
            body = r.dependant.body_params
            out[r.path] = (r.methods, body[0].field_info.annotation if body else None)
    return out


def _declared(cls) -> tuple[set[str], set[str]]:
    """(every field, the required fields) of an io_struct dataclass or msgspec Struct."""
    if dataclasses.is_dataclass(cls):
        fields = dataclasses.fields(cls)
        required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        return {f.name for f in fields}, required
    fields = msgspec.structs.fields(cls)
    required = {f.name for f in fields if f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT}
    return {f.name for f in fields}, required


def _validate(routes, path: str, body: dict):
    """The route's body object, as the server would build it from this JSON; strict on keys."""
    methods, cls = routes[path]
    assert "POST" in methods, f"{path} does not take POST"
    names, required = _declared(cls)
    assert set(body) <= names, f"{path}: keys SGLang does not declare: {sorted(set(body) - names)}"
    assert required <= set(body), f"{path}: required keys missing: {sorted(required - set(body))}"
    return pydantic.TypeAdapter(cls).validate_json(json.dumps(body))


def _generate_body(spec: SamplingSpec, greedy: bool = False) -> dict:
    params = S.sampling_params(spec, 6, EOS, greedy)
    return S.generate_body([1, 7, 9], params, sampling_mask=S.truncates(spec) and not greedy)


# ---- requests


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("greedy", [False, True])
def test_generate_body_is_accepted_and_normalised_like_the_server(routes, spec, greedy):
    body = _generate_body(spec, greedy)
    assert generate_contract_error(body) is None
    obj = _validate(routes, "/generate", body)
    obj.normalize_batch_and_arguments()
    assert obj.is_single and obj.return_logprob is True and obj.logprob_start_len == -1
    assert obj.return_sampling_mask is (S.truncates(spec) and not greedy)
    sp = SamplingParams(**obj.sampling_params)
    sp.normalize(None)
    sp.verify(VOCAB)
    assert sp.stop_token_ids == set(EOS) and sp.max_new_tokens == 6
    if greedy:
        assert sp.top_k == 1  # SGLang's greedy
    else:
        assert sp.temperature == pytest.approx(spec.temperature) and sp.top_p == pytest.approx(spec.top_p)
        assert sp.top_k == (spec.top_k or (1 << 30))


def test_the_checks_catch_a_misspelt_field(routes):
    """The strict checks are not vacuous: a key SGLang does not know fails them."""
    body = _generate_body(SPECS[0])
    body["sampling_params"]["max_tokens"] = 4
    assert "max_tokens" in generate_contract_error(body)
    with pytest.raises(AssertionError, match="does not declare"):
        _validate(routes, "/init_weights_update_group", {**S.init_group_body("h", 1, 1, 2), "rank": 1})


def test_weight_update_bodies_are_accepted(routes):
    header = layout.plan(3, [("a", "bfloat16", [4, 8]), ("b", "float32", [8]), ("c", "bfloat16", [8])], 64)
    init = _validate(routes, "/init_weights_update_group", S.init_group_body("127.0.0.1", 29511, 1, 3))
    assert (init.rank_offset, init.world_size, init.backend, init.group_name) == (1, 3, "nccl", S.GROUP_NAME)
    updates = [_validate(routes, "/update_weights_from_distributed", b) for b in S.bucket_bodies(header)]
    assert [u.weight_version for u in updates][-1] == "3" and updates[-1].flush_cache is True
    assert all(u.load_format == "flattened_bucket" for u in updates)
    assert _validate(routes, "/pause_generation", S.PAUSE_BODY).mode == S.PAUSE_MODE
    for path, body in [("/continue_generation", S.CONTINUE_BODY), ("/begin_weight_update", S.BEGIN_BODY),
                       ("/end_weight_update", S.END_BODY), ("/abort_request", S.ABORT_ALL_BODY),
                       ("/destroy_weights_update_group", S.DESTROY_BODY)]:
        _validate(routes, path, body)
    methods, _ = routes[S.HEALTH_PATH]
    assert "GET" in methods


def test_bucket_plan_is_what_flattened_bucket_receives():
    """The plan the learner-side adapter broadcasts by: each body's tensors, packed back to back
    as uint8, are what SGLang's receive buffer for that body holds, tensor for tensor."""
    header = layout.plan(1, [("a", "bfloat16", [3, 5]), ("b", "bfloat16", [7]), ("c", "float32", [2, 3])], 48)
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen).to(getattr(torch, d))
               for n, d, s in zip(header.names, header.dtypes, header.shapes)}
    for body in S.bucket_bodies(header):
        recv = FlattenedTensorBucket.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
        packed = torch.cat([tensors[n].flatten().view(torch.uint8) for n in body["names"]])
        assert recv.get_flattened_tensor().numel() == packed.numel()
        recv.get_flattened_tensor().copy_(packed)
        for name, got in recv.reconstruct_tensors():
            assert torch.equal(got, tensors[name]) and got.dtype == tensors[name].dtype


def test_launch_argv_parses_as_sglang_server_args():
    argv = S.launch_argv("/venv/bin/python", "/models/m", 31234, dtype="bfloat16", mem_fraction=0.7,
                         max_running=16, seed=11, version=-1, gpu=1)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    args = prepare_server_args(argv[3:])
    assert (args.model_path, args.host, args.port, args.dtype) == ("/models/m", "127.0.0.1", 31234, "bfloat16")
    assert args.mem_fraction_static == pytest.approx(0.7) and args.max_running_requests == 16
    assert args.random_seed == 11 and args.weight_version == "-1"
    assert args.enable_fp32_lm_head is True and args.skip_tokenizer_init is True and args.base_gpu_id == 1


# ---- responses


def _sglang_response(tokens, logprobs, finish, events=(), current="4", mask_logprobs=None) -> dict:
    """A finished ``/generate`` response as ``TokenizerManager._handle_batch_output`` builds it
    for a BatchTokenIDOutput (skip_tokenizer_init), through orjson as the server sends it."""
    meta = {"id": "r0", "finish_reason": finish.to_json(), "prompt_tokens": 3, "weight_version": current,
            "num_retractions": 0}
    entries = TokenizerManager.detokenize_logprob_tokens(None, logprobs, tokens, False)
    meta["input_token_logprobs"] = []
    meta["output_token_logprobs"] = entries
    meta["output_token_logprobs_length"] = len(entries)
    if mask_logprobs is not None:
        chunk = SamplingMaskChunk(lengths=np.ones(len(tokens), np.int32), token_ids=np.array(tokens, np.int32),
                                  logprobs=np.array(mask_logprobs, np.float32))
        masks, values = chunk.to_lists(support_logprobs=False)
        meta.update(output_token_sampling_mask=masks, output_token_sampling_logprobs=values,
                    output_token_sampling_mask_length=len(masks))
    meta.update(reasoning_tokens=0, completion_tokens=len(tokens), cached_tokens=0)
    spans = compute_weight_version_spans(list(events), current_version=current, num_output_tokens=len(tokens))
    add_weight_versions_to_meta_info(meta, spans, num_output_tokens=len(tokens))
    return orjson.loads(orjson.dumps({"output_ids": list(tokens), "meta_info": meta}))


def test_stop_response_with_a_version_change_mid_sequence():
    tokens, lps = [9, 8, 7, 2], [-0.5, -1.25, -2.0, -0.125]
    out = _sglang_response(tokens, lps, FINISH_MATCHED_TOKEN(matched=2), events=[WeightVersionEvent("3", 2)])
    GenerateResponse.from_json_value(out)  # the API schema's own decoder accepts it
    s = S.parse_sample(out, fallback_version=0, sampling_mask=False)
    assert s.tokens == tokens and s.logprobs == pytest.approx(lps)
    assert s.versions == [3, 3, 4, 4] and s.finish_reason == "stop"


def test_length_response_with_sampling_mask_logprobs():
    tokens = [9, 8, 7]
    out = _sglang_response(tokens, [-0.5, -1.0, -2.0], FINISH_LENGTH(length=3), mask_logprobs=[-0.25, -0.5, -0.75])
    GenerateResponse.from_json_value(out)
    s = S.parse_sample(out, fallback_version=0, sampling_mask=True)
    assert s.logprobs == pytest.approx([-0.25, -0.5, -0.75]) and s.finish_reason == "length"
    assert s.versions == [4, 4, 4]


def test_aborted_response_is_an_error():
    out = _sglang_response([9], [-0.5], FINISH_ABORT(message="out of memory"))
    with pytest.raises(S.SGLangError, match="out of memory"):
        S.parse_sample(out, fallback_version=0, sampling_mask=False)


# ---- the adapter's real HTTP traffic, against a server that judges it with SGLang's own types


class _Judge:
    """A loopback HTTP server: every POST body is validated as SGLang's app would (the route's own
    type, strict on keys) and answered the way SGLang answers; violations are recorded."""

    def __init__(self, routes):
        import http.server
        import threading

        judge = self
        self.routes, self.seen, self.errors = routes, [], []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.seen.append(self.path)
                try:
                    reply = judge.answer(self.path, body)
                except Exception as e:  # a contract violation: the client sees a 400, the test the cause
                    judge.errors.append(f"{self.path}: {e}")
                    reply = None
                raw = orjson.dumps(reply if reply is not None else {"error": "invalid"})
                self.send_response(200 if reply is not None else 400)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, path: str, body: dict):
        obj = _validate(self.routes, path, body)
        if path != "/generate":
            return {"success": True, "message": "ok"}
        assert generate_contract_error(body) is None
        n = obj.sampling_params["max_new_tokens"]
        tokens = [(t * 7 + 3) % VOCAB for t in obj.input_ids][:n] or [3]
        lps = [-0.5 / (i + 1) for i in range(len(tokens))]
        mask = [x - 0.1 for x in lps] if obj.return_sampling_mask else None
        return _sglang_response(tokens, lps, FINISH_LENGTH(length=len(tokens)), current="5", mask_logprobs=mask)


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2]])
def test_engine_traffic_is_valid_for_sglang(routes, spec):
    judge = _Judge(routes)
    try:
        server = S.SGLangServer(["unused"], judge.port, request_timeout_s=10)
        engine = S.SGLangEngine(server, spec, eos_ids=EOS, max_new_tokens=2, max_batch=3)
        header = layout.plan(5, [("a", "bfloat16", [4, 8]), ("b", "float32", [8])], 64)
        S.push_update(server, header, timeout_s=10)
        samples = engine.generate([[1, 2, 3], [4], [5, 6], [7, 8, 9]])
    finally:
        judge.httpd.shutdown()
    assert judge.errors == []
    assert judge.seen[:3] == ["/pause_generation", "/begin_weight_update", "/update_weights_from_distributed"]
    assert judge.seen.count("/generate") == 4
    assert [len(s.tokens) for s in samples] == [2, 1, 2, 2] and all(s.versions == [5] * len(s.tokens) for s in samples)
    assert (samples[0].logprobs[0] == pytest.approx(-0.6)) is S.truncates(spec)
