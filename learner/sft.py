"""Self-distillation, the learner's half: supervised fine-tuning of the *base* model on the
shortest-correct corpus (``actor/distill.py`` writes it; this module reads only its JSONL, so
learner/ does not import actor/).

Loss: the mean negative log-likelihood of the completion tokens, EOS included, over every
completion token of the batch (a long answer weighs as many tokens as it has). Prompt tokens are
context only: their targets are masked out, so SFT teaches how to answer, not the task's prompt
distribution. Log-probs come from ``learner/logprobs.py`` :func:`token_logprobs`, the one place
head precision is decided: FP32 head and log-softmax (``learner.fp32_head``), chunked by
``learner.logprob_chunk``.

Precision: the body runs in FP32, whatever ``learner.body_dtype`` says: SFT measures no
engine/learner ratio that a BF16 body would have to reproduce, the result is saved as FP32
master weights anyway, and on a CPU without native BF16 an FP32 body is an order of magnitude
faster.

A batch whose loss is NaN/inf, or whose gradient norm is, is skipped and counted
(``skipped``): it never reaches the optimiser, as in the RL learner. The model is written as an
HF-format directory, with the base's tokenizer files, atomically (``core.files.atomic_dir`` with
the checkpoints' ``COMPLETE`` marker).
"""

from __future__ import annotations

import json
import math
import random
import time

import torch
from torch import Tensor

from core import placement
from learner.checkpoint import write_dir
from learner.logprobs import token_logprobs
from model.hf import load_pretrained, save_pretrained, tokenizer_files


def _ids(value, field: str, where: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(t, int) and t >= 0 for t in value):
        raise ValueError(f"{where}: {field!r} must be a non-empty list of token ids >= 0, got {value!r:.80}")
    return value


def load_corpus(path: str) -> list[tuple[list[int], list[int]]]:
    """``(prompt, completion)`` token ids of every row of a distillation corpus."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            where = f"{path}:{n}"
            rows.append((_ids(row.get("prompt"), "prompt", where), _ids(row.get("completion"), "completion", where)))
    if not rows:
        raise ValueError(f"{path}: the distillation corpus is empty (no prompt had a correct sample)")
    return rows


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Right-padded ``(inputs, key_mask, targets, mask)``, each ``[B, T-1]`` for the longest
    ``T = len(prompt + completion)``: ``inputs[:, i]`` predicts ``targets[:, i]``, and ``mask``
    is 1 exactly where the target is a completion token."""
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1))
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) - 1 : len(p) + len(c) - 1] = 1.0
    key_mask = torch.arange(width - 1)[None, :] < torch.tensor([len(p) + len(c) for p, c in rows])[:, None]
    return ids[:, :-1], key_mask, ids[:, 1:], mask


def masked_nll(model, inputs: Tensor, key_mask: Tensor, targets: Tensor, mask: Tensor, lc) -> Tensor:
    """Mean NLL of ``targets`` where ``mask`` is set; the body in FP32, the head through
    :func:`token_logprobs` (``lc``: ``cfg.learner``, for ``fp32_head`` and ``logprob_chunk``)."""
    pos = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[0], -1)
    hidden = model(inputs, pos, key_mask)
    sel = mask > 0
    logp, _ = token_logprobs(hidden[sel], model.head_weight(), targets[sel], fp32=lc.fp32_head,
                             chunk=lc.logprob_chunk)
    return -logp.mean()


def _on(device, tensors):
    return tuple(t.to(device) for t in tensors)


@torch.no_grad()
def corpus_loss(model, rows, lc, batch: int = 64, device=None) -> float:
    """Token-weighted mean NLL of the completions of ``rows`` under ``model`` (no training)."""
    device = device or next(model.parameters()).device
    total, tokens = 0.0, 0
    for start in range(0, len(rows), batch):
        inputs, key_mask, targets, mask = _on(device, collate(rows[start:start + batch]))
        n = int(mask.sum())
        total += float(masked_nll(model, inputs, key_mask, targets, mask, lc)) * n
        tokens += n
    return total / tokens


def _step(model, opt, params, batch: tuple, lc) -> float | None:
    """One optimiser step on one collated batch; None (and no step) when its loss or gradient is
    not finite."""
    loss = masked_nll(model, *batch, lc)
    if not torch.isfinite(loss):
        return None
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(params, lc.grad_clip or float("inf")))
    if not math.isfinite(norm):
        opt.zero_grad(set_to_none=True)
        return None
    opt.step()
    return float(loss.detach())


def _epoch(model, opt, rows, rng: random.Random, cfg, device, counts: dict) -> list[float]:
    """One shuffled pass over ``rows``; the finite batch losses, in order."""
    order = list(range(len(rows)))
    rng.shuffle(order)
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for start in range(0, len(order), cfg.distill.batch):
        part = [rows[i] for i in order[start:start + cfg.distill.batch]]
        loss = _step(model, opt, params, _on(device, collate(part)), cfg.learner)
        counts["skipped" if loss is None else "steps"] += 1
        if loss is not None:
            losses.append(loss)
    return losses


def check_vocab(rows, vocab_size: int, path: str) -> None:
    """A token id the model has no embedding for is bad input, not an index error mid-training."""
    top = max(max(p + c) for p, c in rows)
    if top >= vocab_size:
        raise ValueError(f"{path}: token id {top} is outside the base model's vocab_size = {vocab_size}")


def _save(model, base_dir: str, out_dir: str) -> None:
    write_dir("the distilled model", out_dir, lambda tmp: save_pretrained(model, tmp, tokenizer_files(base_dir)))


def finetune(cfg, base_dir: str, corpus_path: str, out_dir: str, seed: int) -> dict:
    """Fine-tune the model in ``base_dir`` on the corpus (``cfg.distill``: lr, epochs, batch;
    ``cfg.learner``: betas, weight_decay, grad_clip, threads, device, head precision), write it to
    ``out_dir`` and return its stats."""
    t0 = time.time()
    rows = load_corpus(corpus_path)
    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(seed)
    device = placement.learner_device(cfg)
    model = load_pretrained(base_dir).float().to(device).train()
    model.fp32_attn_softmax = cfg.learner.fp32_attn_softmax
    check_vocab(rows, model.cfg.vocab_size, corpus_path)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.distill.lr, betas=tuple(cfg.learner.betas),
                            weight_decay=cfg.learner.weight_decay)
    rng, counts, epoch_losses, epoch_s = random.Random(seed), {"steps": 0, "skipped": 0}, [], []
    for _ in range(cfg.distill.epochs):
        t_epoch = time.time()
        losses = _epoch(model, opt, rows, rng, cfg, device, counts)
        epoch_losses.append(sum(losses) / len(losses) if losses else float("nan"))
        epoch_s.append(round(time.time() - t_epoch, 2))
    _save(model.eval(), base_dir, out_dir)
    return {"examples": len(rows), "epochs": cfg.distill.epochs, **counts, "epoch_loss": epoch_losses,
            "final_loss": epoch_losses[-1], "epoch_seconds": epoch_s, "seconds": round(time.time() - t0, 2)}
