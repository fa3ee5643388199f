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
        max_position_embeddings=128,
        **special_ids,
    )


def recipe_key(cfg) -> str:
    m, t = cfg.model, cfg.task
    recipe = dict(
        v=BUILD_VERSION, seed=cfg.run.seed, hidden=m.hidden_size, layers=m.num_layers, heads=m.num_heads,
        kv=m.num_kv_heads, inter=m.intermediate_size, steps=m.pretrain_steps, batch=m.pretrain_batch,
        lr=m.pretrain_lr, frac=m.pretrain_correct_frac, task=t.name, digits=t.digits, eval_frac=t.eval_frac,
    )
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _corpus_batch(task, rng: random.Random, n: int, correct_frac: float):
    """Token rows ``prompt ANSWER EOS`` (right-padded) and a mask over the answer tokens."""
    rows, starts = [], []
    tok = task.tok
    for _ in range(n):
        p = task.sample(rng, "train")
        ans = p.answer if rng.random() < correct_frac else p.answer[::-1]
        rows.append([*p.tokens, *tok.encode(ans), tok.eos_id])
        starts.append(len(p.tokens))
    width = max(map(len, rows))
    ids = torch.full((n, width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros(n, width)
    for i, (r, s) in enumerate(zip(rows, starts)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, s : len(r)] = 1.0  # positions whose token is predicted (answer + EOS)
    return ids, mask


def pretrain(cfg, task, files: dict[str, bytes], special_ids: dict, out_dir: str) -> dict:
    """Pre-train on ``task``'s prompts and answers (its tokenizer: ``task.tok``); write the model,
    ``files`` (the tokenizer's) and a build record into ``out_dir``."""
    mc = cfg.model
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    model = Qwen3(_arch(mc, task.tok.vocab_size, special_ids))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=mc.pretrain_lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=mc.pretrain_lr, total_steps=max(mc.pretrain_steps, 1),
                                                pct_start=0.05)
    t0, loss_v = time.time(), float("nan")
    for step in range(mc.pretrain_steps):
        ids, mask = _corpus_batch(task, rng, mc.pretrain_batch, mc.pretrain_correct_frac)
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        hidden = model(ids[:, :-1], pos[:, :-1], ids[:, :-1] != task.tok.pad_id)
        logits = model.logits(hidden)
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_v = loss.item()
        if step % 200 == 0:
            log.info("pretrain step %d/%d loss %.3f", step, mc.pretrain_steps, loss_v)
    info = {"pretrain_loss": loss_v, "pretrain_s": time.time() - t0, "recipe": recipe_key(cfg)}
    save_pretrained(model, out_dir, {**files, "driftrl_base.json": json.dumps(info).encode()})
    return info


def ensure_base_model(cfg, build=None) -> str:
    """Path of the HF-format base model: ``cfg.model.path`` if set, else the cached tiny model,
    built on first use by ``build(out_dir)`` (the built-in task's :func:`pretrain` call)."""
    if cfg.model.path:
        if not os.path.exists(os.path.join(cfg.model.path, "config.json")):
            raise FileNotFoundError(f"model.path={cfg.model.path!r} has no config.json")
        return cfg.model.path
    final = os.path.abspath(os.path.join(cfg.model.cache_dir, f"base-{cfg.task.name}-{recipe_key(cfg)}"))
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
