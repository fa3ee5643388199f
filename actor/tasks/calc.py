"""Built-in tool task: addition of operands too long for the tiny model to add unaided, with a calculator.
``"<s>48213+90377="``: an episode may call ``[48213+90377]``, get ``=138590\n`` from the environment
(actor/episodes.py) and answer ``138590</s>`` (exact match of the last line). The base model saw the tool used
in ``model.pretrain_worked_frac`` of its answers, else guessing as arith's does: RL has to raise the rate of
correct tool use, and with it the accuracy.
"""

from __future__ import annotations

import ast
import json
import operator
import random

from actor.tasks import Prompt
from actor.tasks.arith import CHARS, ArithTask

MAX_CALL_CHARS = 200
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(call: str) -> str:
    """The tool: an integer expression of + - * and parentheses (or Qwen's JSON call with ``arguments.expression``)."""
    if call.lstrip().startswith("{"):
        call = str(json.loads(call)["arguments"]["expression"])
    if len(call) > MAX_CALL_CHARS:
        raise ValueError(f"expression of {len(call)} characters")
    return str(_eval(ast.parse(call.strip(), mode="eval").body))


def _eval(node) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError(f"not an integer expression: {ast.dump(node)[:80]}")


class CalcTask(ArithTask):
    name = "calc"
    tool = "actor.tasks.calc:calculator"
    chars = [*CHARS, "[", "]"]

    def reward(self, prompt: Prompt, completion_ids) -> float:
        text = self.completion_text(completion_ids)
        return 1.0 if text is not None and text.rsplit("\n", 1)[-1] == prompt.answer else 0.0

    def pretrain_completion(self, prompt: Prompt, rng: random.Random, model_cfg) -> str:
        if rng.random() < model_cfg.pretrain_worked_frac:
            return f"[{prompt.id}]={prompt.answer}\n{prompt.answer}"
        return super().pretrain_completion(prompt, rng, model_cfg)

    def pretrain_recipe(self, model_cfg) -> dict:
        return {"tool_frac": model_cfg.pretrain_worked_frac}

    def episode_metrics(self, items: list[tuple[Prompt, list[int]]]) -> dict[str, float]:
        """``tool/use_rate``: episodes that called the tool; ``tool/correct_rate``: those whose call was the
        prompt's own sum (operands copied right)."""
        texts = [self.tok.decode(ids) for _, ids in items]
        calls = [t[1:t.index("]")] if t.startswith("[") and "]" in t else None for t in texts]
        return {"tool/use_rate": sum(c is not None for c in calls) / max(len(items), 1),
                "tool/correct_rate": sum(c == p.id for c, (p, _) in zip(calls, items)) / max(len(items), 1)}
