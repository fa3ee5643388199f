"""The tiny base model: built by driftrl itself, deterministically, then cached.

No model hub is reachable, so the default run pre-trains its own "base model" on text of the
built-in task. The pre-training corpus states each sum correctly with probability
``pretrain_correct_frac`` and otherwise writes the digits of the sum backwards -- a habit that
leaves the base model knowing the arithmetic but answering correctly only some of the time.
That is the zero-RL setting in miniature: the ability is latent and RL has to elicit it.

The result is an HF-format directory (config.json, model.safetensors, tokenizer.json) keyed by a
hash of everything that shapes it, built into a temporary directory and renamed into place, so a
crash mid-build never leaves a half model behind and concurrent builders don't collide.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time

import torch
import torch.nn.functional as F

from model.decoder import ArchConfig, Qwen3
from model.hf import save_pretrained

log = logging.getLogger("driftrl.basemodel")
BUILD_VERSION = 3  # bump when the recipe below changes


def _arch(mc, vocab_size: int, special_ids: dict) -> ArchConfig:
    return ArchConfig(
        vocab_size=vocab_size,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_heads,
        num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.hidden_size // mc.num_heads,
        max_position_embeddings=mc.max_position_embeddings,
        **special_ids,
    )


def recipe_key(cfg, task_recipe: dict | None = None) -> str:
    """Hash of everything that shapes the model: the architecture, the optimiser schedule and
    the corpus -- the fields every task shares plus ``task_recipe`` (``Task.pretrain_recipe``)."""
    m, t = cfg.model, cfg.task
    recipe = dict(
        v=BUILD_VERSION, seed=cfg.run.seed, hidden=m.hidden_size, layers=m.num_layers, heads=m.num_heads,
        kv=m.num_kv_heads, inter=m.intermediate_size, steps=m.pretrain_steps, batch=m.pretrain_batch,
        lr=m.pretrain_lr, frac=m.pretrain_correct_frac, task=t.name, digits=t.digits, eval_frac=t.eval_frac,
        max_pos=m.max_position_embeddings, **(task_recipe or {}),
    )
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _corpus_rows(task, rng: random.Random, n: int, mc) -> list[tuple[list[int], int]]:
    """``n`` rows ``prompt COMPLETION EOS``, each with where its completion starts; the task
    writes each completion (``pretrain_completion``), so the habits taught are the task's."""
    tok, rows = task.tok, []
    for _ in range(n):
        p = task.sample(rng, "train")
        rows.append(([*p.tokens, *tok.encode(task.pretrain_completion(p, rng, mc)), tok.eos_id], len(p.tokens)))
    width = max(len(r) for r, _ in rows)
    if width > mc.max_position_embeddings:
        raise ValueError(f"a pre-training row has {width} tokens > model.max_position_embeddings="
                         f"{mc.max_position_embeddings}: raise it or shorten the task")
    return rows


def _buckets(rows) -> list[list[int]]:
    """Row indices in one or two micro-batches: split at the length that wastes least padding,
    but only when that saves a third of the padded tokens -- short direct answers padded to a
    long worked one's width would otherwise cost most of a step, while a batch of similar
    lengths stays one pass (and the arithmetic task's build bit for bit what it was)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    lens = [len(rows[i][0]) for i in order]
    n = len(lens)
    if n < 2:
        return [order]
    cost, k = min((k * lens[k - 1] + (n - k) * lens[-1], k) for k in range(1, n))
    return [order[:k], order[k:]] if cost <= n * lens[-1] * 2 / 3 else [list(range(n))]


def _pad(rows, idx: list[int], pad_id: int):
    """Right-padded token ids of ``rows[idx]`` and a mask over their completion tokens."""
    width = max(len(rows[i][0]) for i in idx)
    ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(idx), width)
    for j, i in enumerate(idx):
        r, s = rows[i]
        ids[j, : len(r)] = torch.tensor(r)
        mask[j, s : len(r)] = 1.0  # positions whose token is predicted (completion + EOS)
    return ids, mask


def _init_model(mc, vocab_size: int, special_ids: dict) -> Qwen3:
    model = Qwen3(_arch(mc, vocab_size, special_ids))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model


def _nll_sum(model, ids, mask, pad_id: int):
    """Summed next-token NLL over the masked (completion) positions."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    hidden = model(ids[:, :-1], pos[:, :-1], ids[:, :-1] != pad_id)
    nll = F.cross_entropy(model.logits(hidden).transpose(1, 2), ids[:, 1:], reduction="none")
    return (nll * mask[:, 1:]).sum()


def _backward(model, rows, pad_id: int) -> float:
    """Gradient of the mean completion NLL of ``rows`` (accumulated over its micro-batches)."""
    total = float(sum(len(r) - s for r, s in rows))
    loss = 0.0
    for idx in _buckets(rows):
        part = _nll_sum(model, *_pad(rows, idx, pad_id), pad_id) / total
        part.backward()
        loss += part.item()
    return loss


def _log_progress(step: int, total: int, loss: float, t0: float) -> None:
    """A line every ~10% (at most every 200 steps): a build of minutes shows it is moving."""
    every = max(1, min(200, total // 10))
    if step % every == 0 or step == total - 1:
        elapsed = time.time() - t0
        eta = elapsed / (step + 1) * (total - step - 1)
        log.info("pretrain step %d/%d loss %.3f elapsed %.0fs eta %.0fs", step + 1, total, loss, elapsed, eta)


def pretrain(cfg, task, files: dict[str, bytes], special_ids: dict, out_dir: str) -> dict:
    """Pre-train on ``task``'s prompts and its pre-training completions (its tokenizer:
    ``task.tok``); write the model, ``files`` (the tokenizer's) and a build record into ``out_dir``."""
    mc = cfg.model
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    model = _init_model(mc, task.tok.vocab_size, special_ids)
    opt = torch.optim.AdamW(model.parameters(), lr=mc.pretrain_lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=mc.pretrain_lr, total_steps=max(mc.pretrain_steps, 1),
                                                pct_start=0.05)
    t0, loss_v = time.time(), float("nan")
    for step in range(mc.pretrain_steps):
        opt.zero_grad(set_to_none=True)
        loss_v = _backward(model, _corpus_rows(task, rng, mc.pretrain_batch, mc), task.tok.pad_id)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        _log_progress(step, mc.pretrain_steps, loss_v, t0)
    info = {"pretrain_loss": loss_v, "pretrain_s": time.time() - t0,
            "recipe": recipe_key(cfg, task.pretrain_recipe(mc))}
    save_pretrained(model, out_dir, {**files, "driftrl_base.json": json.dumps(info).encode()})
    return info


def ensure_base_model(cfg, build=None, task_recipe: dict | None = None) -> str:
    """Path of the HF-format base model: ``cfg.model.path`` if set, else the cached tiny model,
    built on first use by ``build(out_dir)`` (the built-in task's :func:`pretrain` call) and
    keyed by :func:`recipe_key` with the task's own recipe fields."""
    if cfg.model.path:
        if not os.path.exists(os.path.join(cfg.model.path, "config.json")):
            raise FileNotFoundError(f"model.path={cfg.model.path!r} has no config.json")
        return cfg.model.path
    name = f"base-{cfg.task.name}-{recipe_key(cfg, task_recipe)}"
    final = os.path.abspath(os.path.join(cfg.model.cache_dir, name))
    if os.path.exists(os.path.join(final, "driftrl_base.json")):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=os.path.dirname(final))
    try:
        log.info("building the tiny base model into %s (first use only)", final)
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.exists(os.path.join(final, "driftrl_base.json")):
                raise  # someone else's build did not finish either: surface it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
