"""Self-distillation, the learner's half: fine-tune the *base* model on the shortest-correct corpus
(``actor/distill.py`` writes the JSONL; learner/ does not import actor/). Loss: mean NLL of the
completion tokens (EOS included). The body runs in FP32 whatever ``learner.body_dtype`` says: SFT
has no engine/learner ratio to reproduce, and on a CPU without native BF16 FP32 is far faster.
A batch with a non-finite loss or gradient norm is skipped and counted, never applied.
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
            rows.append(tuple(_ids(row.get(k), k, f"{path}:{n}") for k in ("prompt", "completion")))
    if not rows:
        raise ValueError(f"{path}: the distillation corpus is empty (no prompt had a correct sample)")
    return rows


def collate(rows: list[tuple[list[int], list[int]]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Right-padded ``(inputs, key_mask, targets, mask)``, each ``[B, T-1]``: ``inputs[:, i]`` predicts
    ``targets[:, i]``; ``mask`` is 1 exactly where the target is a completion token."""
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1))
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) - 1 : len(p) + len(c) - 1] = 1.0
    key_mask = torch.arange(width - 1)[None, :] < torch.tensor([len(p) + len(c) for p, c in rows])[:, None]
    return ids[:, :-1], key_mask, ids[:, 1:], mask


def masked_nll(model, inputs: Tensor, key_mask: Tensor, targets: Tensor, mask: Tensor, lc) -> Tensor:
    """Mean NLL of ``targets`` where ``mask`` is set (``lc``: ``cfg.learner``)."""
    pos = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[0], -1)
    hidden = model(inputs, pos, key_mask)
    sel = mask > 0
    logp, _ = token_logprobs(hidden[sel], model.head_weight(), targets[sel], fp32=lc.fp32_head,
                             chunk=lc.logprob_chunk)
    return -logp.mean()


def _step(model, opt, params, batch: tuple, lc) -> float | None:
    """One optimiser step on one collated batch; None (and no step) if not finite."""
    opt.zero_grad(set_to_none=True)  # also what a skipped batch left
    loss = masked_nll(model, *batch, lc)
    if not torch.isfinite(loss):
        return None
    loss.backward()
    if not math.isfinite(float(torch.nn.utils.clip_grad_norm_(params, lc.grad_clip or float("inf")))):
        return None
    opt.step()
    return float(loss.detach())


def finetune(cfg, base_dir: str, corpus_path: str, out_dir: str, seed: int) -> dict:
    """Fine-tune ``base_dir``'s model on a corpus (``cfg.distill``, the learner's optimiser) into ``out_dir``."""
    t0 = time.time()
    rows = load_corpus(corpus_path)
    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(seed)
    device = placement.learner_device(cfg)
    model = load_pretrained(base_dir).float().to(device).train()
    model.fp32_attn_softmax = cfg.learner.fp32_attn_softmax
    if (top := max(max(p + c) for p, c in rows)) >= model.cfg.vocab_size:
        raise ValueError(f"{corpus_path}: token id {top} is outside the base model's vocab_size {model.cfg.vocab_size}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.distill.lr, betas=tuple(cfg.learner.betas),
                            weight_decay=cfg.learner.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    rng, counts, epoch_losses, epoch_s = random.Random(seed), {"steps": 0, "skipped": 0}, [], []
    for _ in range(cfg.distill.epochs):
        t_epoch, losses, order = time.time(), [], list(range(len(rows)))
        rng.shuffle(order)
        for start in range(0, len(order), cfg.distill.batch):
            part = collate([rows[i] for i in order[start:start + cfg.distill.batch]])
            loss = _step(model, opt, params, tuple(t.to(device) for t in part), cfg.learner)
            counts["skipped" if loss is None else "steps"] += 1
            if loss is not None:
                losses.append(loss)
        epoch_losses.append(sum(losses) / len(losses) if losses else float("nan"))
        epoch_s.append(round(time.time() - t_epoch, 2))
    write_dir("the distilled model", out_dir,
              lambda tmp: save_pretrained(model.eval(), tmp, tokenizer_files(base_dir)))
    return {"examples": len(rows), "epochs": cfg.distill.epochs, **counts, "epoch_loss": epoch_losses,
            "final_loss": epoch_losses[-1], "epoch_seconds": epoch_s, "seconds": round(time.time() - t0, 2)}
