"""The plain-PyTorch backend: FP32 master weights, AdamW, on ``learner.device`` (each micro-batch moves there;
metrics and the tail's numerator stay on the host). The numerator is recomputed with the current weights: body
under ``body_autocast``, head via ``learner/logprobs.py``. With ``learner.context_parallel`` > 1, one process
per rank runs its chunk of every row and the gradients are summed (ARCHITECTURE.md: Precision and the ratio).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import math
import os
import re
from dataclasses import replace

import msgspec
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from core import heartbeat, placement, precision
from learner.advantages import group_advantages
from learner.backends import Backend, NonFiniteError
from learner.batching import TENSORS, Batch, by_length, micro_batches
from learner.logprobs import token_logprobs
from learner.losses import LossInputs, make_loss
from learner.ratio_metrics import ratio_metrics
from model.attention import DTYPES, body_autocast
from model.context_parallel import ContextParallel, group_of
from model.decoder import Decoder
from model.hf import load_pretrained, save_pretrained, tokenizer_files
from model.sampling import SamplingSpec


@contextlib.contextmanager
def _as_oserror(path: str):
    """safetensors' full disk (SafetensorError "... os error 28") as the OSError it is: a write failure."""
    try:
        yield
    except SafetensorError as e:
        found = re.search(r"os error (\d+)", str(e))
        code = int(found.group(1)) if found else errno.EIO
        raise OSError(code, os.strerror(code), path) from None


def _alone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` as safetensors writes them (each alone in its storage, contiguous), copied only where one is not:
    the optimiser's moments are written in place, not as a second model-sized copy (megatron's relabelled views and
    shared step counters are copied)."""
    seen, out = set(), {}
    for k, t in tensors.items():
        whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes
        out[k] = t if whole and t.untyped_storage().data_ptr() not in seen else t.contiguous().clone()
        seen.add(t.untyped_storage().data_ptr())
    return out


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, cfg, model_dir: str, model=None):
        self.cfg, self.model_dir = cfg, model_dir
        lc = cfg.learner
        self.device = self._place()
        self.model = self._build_model(model_dir, model)
        self.ref = self._frozen_copy() if lc.kl_beta > 0 else None
        self.cp = None if lc.context_parallel == 1 else ContextParallel(
            group_of(lc.context_parallel, self.device), self.arch.num_attention_heads, self.arch.num_key_value_heads,
            self.device)
        # fused: one kernel per parameter, where the default runs ~10 passes over each (3.5x on CPU)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lc.lr, betas=tuple(lc.betas),
                                     weight_decay=lc.weight_decay, fused=True)
        self.loss_fn = make_loss(lc.loss, **msgspec.structs.asdict(lc))
        # constant divisor of the token-level loss: the most tokens one step can hold
        self.token_divisor = float(lc.groups_per_step * cfg.actor.group_size * cfg.actor.max_new_tokens)
        self.sampling = SamplingSpec.of(cfg.actor)

    def logprobs(self, batch: Batch, *, reference: bool = False, with_entropy: bool = False, sampling=None):
        """``sampling`` defaults to the actor's (the numerator must match the behaviour distribution's
        transformation). Returned on ``batch``'s device."""
        model = self.ref if reference else self.model
        lc, s = self.cfg.learner, sampling or self.sampling
        home, batch = batch.ids.device, self._on_device(batch)
        hidden = self._hidden(model, batch.ids[:, :-1], batch.key_mask[:, :-1])
        sel, targets = batch.mask > 0, batch.ids[:, 1:]
        if self.cp is not None:  # this rank's chunk of every row: [N, Tc]
            sel, targets = self.cp.shard(sel), self.cp.shard(targets)
        h = hidden[sel]
        if not lc.fp32_head:
            h = h.to(DTYPES[precision.dtype_name(lc.body_dtype, h.device)])
        lp, ent = token_logprobs(h, self._head_weight(model), targets[sel],
                                 temperature=s.temperature, fp32=lc.fp32_head, chunk=lc.logprob_chunk,
                                 with_entropy=with_entropy, top_k=s.top_k, top_p=s.top_p)
        full = torch.zeros(sel.shape, dtype=lp.dtype, device=lp.device).masked_scatter(sel, lp)
        if self.cp is not None:  # each rank scored its own tokens: gathered once, the whole batch's on each
            full = self.cp.gather(full, batch.mask.shape[1], hidden)  # every rank's [N, Tc] -> [N, L-1]
        if self.cp is not None and ent is not None:  # the scored tokens' entropies, in row order
            ent = torch.zeros(sel.shape, dtype=ent.dtype, device=ent.device).masked_scatter(sel, ent.detach())
            ent = self.cp.gather(ent, batch.mask.shape[1], hidden.detach())[batch.mask > 0]
        return full.to(home), (ent if ent is None else ent.to(home))

    def _all_reduce_grads(self) -> None:
        """Each CP rank holds its tokens' share of every gradient: summed, so all ranks step alike. A
        parameter no rank has a gradient for stays without one, as AdamW expects."""
        params = list(self.model.parameters())
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=self.device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.cp.group)
        params = [p for p, h in zip(params, has.tolist()) if h]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        dist.all_reduce(flat, group=self.cp.group)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad = g.view_as(p)

    def _on_device(self, batch: Batch) -> Batch:
        return replace(batch, **{f: t.to(self.device) for f in TENSORS if (t := getattr(batch, f)) is not None})

    # hooks: what another framework's model (learner/backends/megatron.py) does differently

    def _place(self):
        return placement.learner_device(self.cfg)

    def _build_model(self, model_dir: str, model):
        model = (model if model is not None else load_pretrained(model_dir)).float().to(self.device).train()
        model.fp32_attn_softmax = self.cfg.learner.fp32_attn_softmax
        model.checkpoint_layers = self.cfg.learner.checkpoint_layers
        self.arch = model.cfg  # the checkpoint's config: save_model's config.json
        return model

    def _frozen_copy(self):
        """The KL reference: a frozen copy of the policy as it is now."""
        return copy.deepcopy(self.model).eval().requires_grad_(False)

    def _hidden(self, model, ids, key_mask):
        """Final-normed hidden states ``[N, T, H]`` of right-padded ``ids`` ``[N, T]`` (CP: ``[N, Tc, H]``)."""
        pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        with body_autocast(self.cfg.learner.body_dtype, ids.device.type):
            if self.cp is None:
                return model(ids, pos, key_mask)
            return model(self.cp.shard(ids), self.cp.shard(pos), self.cp.pad(key_mask), cp=self.cp)

    def _head_weight(self, model):
        return model.head_weight()

    def _optim_state(self) -> dict:
        return self.opt.state_dict()

    def _load_optim_state(self, sd: dict) -> None:
        self.opt.load_state_dict(sd)

    def _load_weights(self, state: dict) -> None:
        self.model.load_state_dict(state, strict=True)

    def forward_backward(self, batch: Batch) -> dict[str, float]:
        """Gradients accumulated over micro-batches (``learner.micro_batch_tokens``), advantages over
        whole groups first; under ``norm=sample`` each micro-batch is scaled by its share of the rows."""
        lc = self.cfg.learner
        rows, order = by_length(batch)
        adv = group_advantages(batch.rewards).reshape(-1)[order]
        n = batch.ids.shape[0]
        logp_sorted = torch.zeros(batch.mask.shape)
        entropies, parts = [], []
        for start, stop in micro_batches(rows, lc.micro_batch_tokens):
            heartbeat.pulse()  # a step of minutes is not a hang
            micro = rows.rows(start, stop)
            share = (stop - start) / n if lc.norm == "sample" else 1.0
            logp, ent, metrics = self._micro_step(micro, adv[start:stop], share)
            logp_sorted[start:stop, : logp.shape[1]] = logp
            entropies.append(ent.reshape(-1))
            parts.append((micro.num_tokens, metrics))
        # back in the batch's row order: the step's numerator for learner/tail.py
        self.last_logp = logp_all = logp_sorted[order.argsort()]
        total = sum(tokens for tokens, _ in parts) or 1  # the (pre-scaled) loss adds up, the rest: token-weighted
        metrics = {key: sum(m[key] for _, m in parts) if key == "learner/loss"
                   else sum(tokens * m[key] for tokens, m in parts) / total for key in parts[0][1]}
        metrics.update(ratio_metrics(logp_all, batch.behaviour_logp, batch.mask, batch.staleness, lc.eps_high))
        ent = torch.cat(entropies)
        metrics["learner/entropy"] = float(ent.mean().item()) if ent.numel() else math.nan
        if self.cp is not None:
            self._all_reduce_grads()
        return metrics

    def _micro_step(self, micro: Batch, adv, share: float):
        lc = self.cfg.learner
        micro, adv = self._on_device(micro), adv.to(self.device)
        logp, ent = self.logprobs(micro, with_entropy=True)
        with torch.no_grad():
            ref_logp = self.logprobs(micro, reference=True)[0] if self.ref is not None else None
        inp = LossInputs(logp=logp, behaviour_logp=micro.behaviour_logp, advantages=adv, mask=micro.mask,
                         norm=lc.norm, token_norm_divisor=self.token_divisor, ref_logp=ref_logp,
                         kl_beta=lc.kl_beta, kl_estimator=lc.kl_estimator)
        loss, metrics = self.loss_fn(inp)
        if not torch.isfinite(loss):
            raise NonFiniteError(f"non-finite loss {loss.item()}")
        (loss * share).backward()
        metrics["learner/loss"] *= share
        return logp.detach(), ent.detach(), metrics

    def optim_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.learner.grad_clip or float("inf")))
        if not math.isfinite(norm):
            raise NonFiniteError(f"non-finite gradient norm {norm}")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm

    def discard_grads(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save_model(self, path: str) -> None:
        model = Decoder.from_state(self.arch, self.named_tensors())  # megatron's weights under HF names
        with _as_oserror(path):
            save_pretrained(model, path, tokenizer_files(self.model_dir))

    def save_state(self, path: str) -> dict:
        self.save_model(os.path.join(path, "model"))
        sd = self._optim_state()
        tensors = _alone({f"{idx}.{k}": torch.as_tensor(v).detach()  # no pickle
                          for idx, state in sd["state"].items() for k, v in state.items()})
        with _as_oserror(path):
            save_file(tensors, os.path.join(path, "optim.safetensors"))
            save_file({"torch": torch.get_rng_state()}, os.path.join(path, "rng.safetensors"))
        return {"param_groups": sd["param_groups"]}

    def load_state(self, path: str, meta: dict) -> None:
        self._load_weights(load_file(os.path.join(path, "model", "model.safetensors")))
        state: dict[int, dict] = {}
        for key, t in load_file(os.path.join(path, "optim.safetensors")).items():
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = t
        self._load_optim_state({"state": state, "param_groups": meta["param_groups"]})
        torch.set_rng_state(load_file(os.path.join(path, "rng.safetensors"))["torch"])
