"""The tiny base model of a built-in task: pre-trained deterministically on text the task writes (the skill
latent, for RL to elicit), cached under a hash of the recipe, built in a temporary directory renamed into place.
Worked solutions only for the first :data:`METHOD_FRAC` of the steps: long division was learnt from them alone in
~600 steps, not begun after 1200 at 70% bare answers (measured)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F

from core.progress import progress
from model.decoder import ArchConfig, Qwen3
from model.hf import save_pretrained

log = logging.getLogger("driftrl.basemodel")
BUILD_VERSION = 4  # bump when the recipe below changes
# the default recipe's built model ships (bench/base_model.py --ship): same weights on every CPU
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shipped")
METHOD_FRAC = 0.8  # share of the steps in the method stage (module docstring)


def recipe_key(cfg, task_recipe: dict | None = None) -> str:
    """Hash of everything that shapes the model, ``task_recipe`` (``Task.pretrain_recipe``) included."""
    m, t = cfg.model, cfg.task
    recipe = dict(
        v=BUILD_VERSION, seed=m.pretrain_seed, hidden=m.hidden_size, layers=m.num_layers, heads=m.num_heads,
        kv=m.num_kv_heads, inter=m.intermediate_size, steps=m.pretrain_steps, batch=m.pretrain_batch,
        lr=m.pretrain_lr, frac=m.pretrain_correct_frac, task=t.name, digits=t.digits, eval_frac=t.eval_frac,
        max_pos=m.max_position_embeddings, **(task_recipe or {}),
    )
    if m.pretrain_prompt_prefixes:  # only when set: the keys of models built without stay valid
        recipe["prefixes"] = m.pretrain_prompt_prefixes
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _corpus_batch(task, rng: random.Random, n: int, mc):
    """Right-padded token rows ``prompt COMPLETION EOS`` and a mask over the completion tokens."""
    rows, starts = [], []
    tok = task.tok
    for _ in range(n):
        p = task.sample(rng, "train")
        prompt = _prefixed(list(p.tokens), tok, rng, mc.pretrain_prompt_prefixes)
        rows.append([*prompt, *tok.encode(task.pretrain_completion(p, rng, mc)), tok.eos_id])
        starts.append(len(prompt))
    width = max(map(len, rows))
    if width > mc.max_position_embeddings:
        raise ValueError(f"a pre-training row has {width} tokens > model.max_position_embeddings="
                         f"{mc.max_position_embeddings}: raise it or shorten the task's completions")
    ids = torch.full((n, width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros(n, width)
    for i, (r, s) in enumerate(zip(rows, starts)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, s : len(r)] = 1.0  # positions whose token is predicted (completion + EOS)
    return ids, mask


def _prefixed(ids: list[int], tok, rng: random.Random, prefixes: list[str]) -> list[int]:
    """``ids`` with one of ``prefixes`` after BOS, where a plain-text system prompt goes."""
    if not prefixes:
        return ids
    head = 1 if tok.bos_id is not None and ids[:1] == [tok.bos_id] else 0
    return ids[:head] + tok.encode(rng.choice(prefixes)) + ids[head:]


def _train(model, opt, sched, task, rng: random.Random, mc) -> float:
    """The pre-training steps under a progress bar; the last loss."""
    loss_v = float("nan")
    worked = msgspec.structs.replace(mc, pretrain_worked_frac=1.0) if mc.pretrain_worked_frac > 0 else mc
    with progress("building the tiny base model (first use only)", mc.pretrain_steps) as advance:
        for step in range(mc.pretrain_steps):
            stage = worked if step < METHOD_FRAC * mc.pretrain_steps else mc  # the method stage: all worked
            ids, mask = _corpus_batch(task, rng, mc.pretrain_batch, stage)
            pos = torch.arange(ids.shape[1]).expand_as(ids)
            hidden = model(ids[:, :-1], pos[:, :-1], ids[:, :-1] != task.tok.pad_id)
            nll = F.cross_entropy(model.logits(hidden).transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()  # next-token loss on the masked positions
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_v = loss.item()
            advance(1)
    return loss_v


def pretrain(cfg, task, files: dict[str, bytes], special_ids: dict, out_dir: str) -> dict:
    """Pre-train on ``task``'s corpus; write the model, ``files`` and a build record into ``out_dir``."""
    mc = cfg.model
    torch.manual_seed(mc.pretrain_seed)
    rng = random.Random(mc.pretrain_seed)
    model = Qwen3(ArchConfig(
        vocab_size=task.tok.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.hidden_size // mc.num_heads, max_position_embeddings=mc.max_position_embeddings, **special_ids))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=mc.pretrain_lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=mc.pretrain_lr, total_steps=max(mc.pretrain_steps, 1),
                                                pct_start=0.05)
    t0, threads = time.time(), torch.get_num_threads()
    torch.set_num_threads(1)  # a second thread made each tiny-model step 15x slower on shared cores
    try:
        loss_v = _train(model, opt, sched, task, rng, mc)
    finally:
        torch.set_num_threads(threads)
    info = {"pretrain_loss": loss_v, "pretrain_s": time.time() - t0,
            "recipe": recipe_key(cfg, task.pretrain_recipe(mc))}
    save_pretrained(model, out_dir, {**files, "driftrl_base.json": json.dumps(info).encode()})
    return info


def verified(model_dir: str) -> str:
    """``model_dir`` if its weights hash to its build record's ``sha256`` (a shipped model)."""
    want = json.loads(Path(model_dir, "driftrl_base.json").read_text())["sha256"]
    path = os.path.join(model_dir, "model.safetensors")
    with open(path, "rb") as f:
        got = hashlib.file_digest(f, "sha256").hexdigest()
    if got != want:
        raise ValueError(f"{path} is damaged: sha256 {got[:12]}..., its build record says {want[:12]}...")
    return model_dir


def ensure_base_model(cfg, build=None, task_recipe: dict | None = None) -> str:
    """The cached tiny model of a run without ``model.path``, built on first use by ``build(out_dir)``."""
    name = f"base-{cfg.task.name}-{recipe_key(cfg, task_recipe)}"
    if os.path.isdir(os.path.join(SHIPPED, name)):
        return verified(os.path.join(SHIPPED, name))
    final = os.path.abspath(os.path.join(cfg.model.cache_dir, name))
    if os.path.exists(os.path.join(final, "driftrl_base.json")):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=os.path.dirname(final),
                                     ignore_cleanup_errors=True) as tmp:  # nothing left once renamed
        log.info("building the tiny base model into %s (first use only)", final)
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.exists(os.path.join(final, "driftrl_base.json")):
                raise  # someone else's build did not finish either: surface it
    return final
