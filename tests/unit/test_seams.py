"""The seams: every registry entry is a real implementation of its base class, unknown keys are
refused before anything starts, and a new implementation is one class plus one registry line."""

import os
import random

import msgspec
import pytest

import jobs
from actor.engines import ENGINES, Engine
from actor.tasks import TASKS, Prompt, Task, make_task
from core import config as C
from core.launchers import LAUNCHERS, Launcher
from core.registry import resolve
from learner.backends import BACKENDS, Backend
from tests.support.tiny import tiny_cfg, tiny_tokenizer


@pytest.mark.parametrize("registry,base", [(ENGINES, Engine), (TASKS, Task), (BACKENDS, Backend),
                                           (LAUNCHERS, Launcher)])
def test_every_registered_implementation_is_one(registry, base):
    for key in registry:
        cls = resolve(registry, key, "part")
        assert issubclass(cls, base) and cls.name == key


@pytest.mark.parametrize("override,path", [("actor.engine=sglangg", "$.actor.engine"),
                                           ("task.name=gsm8k", "$.task.name"),
                                           ("learner.backend=megatorn", "$.learner.backend"),
                                           ("learner.loss=grpo", "$.learner.loss"),
                                           ("run.launcher=slurm", "$.run.launcher")])
def test_unknown_seam_keys_are_refused_by_field_path(override, path):
    with pytest.raises(C.ConfigError, match=path.replace("$", r"\$")):
        jobs.check_seams(C.load(None, [override]))
    jobs.check_seams(C.load())  # the defaults are all registered


def test_make_functions_name_the_known_keys():
    with pytest.raises(ValueError, match="unknown task 'nope'; known: arith"):
        make_task(msgspec.structs.replace(C.Config().task, name="nope"), tiny_tokenizer())


class EchoTask(Task):
    """A throwaway task: reward 1 for completions that repeat the prompt's last token."""

    name = "echo"

    def sample(self, rng, split="train"):
        t = rng.randrange(4, self.tok.vocab_size)
        return Prompt(f"echo-{t}", (t,), answer=self.tok.decode([t]))

    def reward(self, prompt, completion_ids):
        return float(list(completion_ids[:1]) == [prompt.tokens[-1]])


def test_a_new_task_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(TASKS, "echo", f"{__name__}:EchoTask")
    cfg = tiny_cfg("task.name=echo")
    jobs.check_seams(cfg)
    task = make_task(cfg.task, tiny_tokenizer())
    p = task.sample(random.Random(0))
    assert isinstance(task, EchoTask) and task.reward(p, [p.tokens[0]]) == 1.0 and task.reward(p, []) == 0.0
    assert len(task.eval_set(3)) == 3  # the base class supplies the held-out set


def test_a_swallowed_interrupt_still_stops_the_watch_loop():
    """A Ctrl-C whose KeyboardInterrupt is lost (raised inside a finalizer) is re-raised at the
    launcher's next watch turn."""
    import pytest

    from core.launchers import Interrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            Interrupt._handler(2, None)  # what a finalizer would swallow
        with pytest.raises(KeyboardInterrupt):
            Interrupt.check()
    finally:
        Interrupt.signalled = False
    Interrupt.check()  # no signal: nothing raised


def test_a_signal_after_the_command_line_decided_its_exit_is_recorded_not_raised(monkeypatch):
    """A SIGTERM during the interpreter's teardown raised KeyboardInterrupt into whatever finalizer
    ran (a storm of them printed its traceback); once ``run.cli`` returns, the handler only records."""
    import signal
    import time

    import run
    from core.launchers import Interrupt

    monkeypatch.setattr(run, "main", lambda: 7)
    monkeypatch.setattr(Interrupt, "deferred", True)  # install() starts undeferred: a new run's
    monkeypatch.setattr(Interrupt, "signalled", False)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        Interrupt.install()
        assert not Interrupt.deferred
        assert run.cli() == 7
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs here: without the record-only mode it raises
        assert Interrupt.signalled
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@pytest.mark.parametrize("override, module, extra", [("run.launcher=ray", "ray", "ray"),
                                                     ("metrics.tensorboard=true", "tensorboardX", "tensorboard")])
def test_a_chosen_optional_stack_that_is_not_installed_fails_before_anything_starts(monkeypatch, override,
                                                                                    module, extra):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(C.ConfigError, match=rf"needs {module}: pip install -e '\.\[{extra}\]'"):
        jobs.check_seams(C.load(None, [override]))


def test_an_engine_declares_how_it_receives_weights_and_only_the_driver_pairs_it_with_a_transport(monkeypatch):
    """A new engine is its file, its registry line and its config subsection: it declares what it
    receives (``Engine.receives``), check_seams pairs that with a transport, and neither the worker
    nor weightsync names an engine."""
    from actor.engines import engine_class
    from core import placement

    monkeypatch.setattr(placement, "visible_gpus", lambda: 1)  # torch_dist broadcasts CUDA memory
    assert engine_class("torch").receives == "tensors" and engine_class("sglang").receives == "group"
    jobs.check_seams(C.load(None, ["actor.engine=sglang", "weightsync.transport=torch_dist"]))
    for transport in ("nccl", "shm"):  # an SGLang server cannot take tensors: the error names the fix
        want = rf"`\$.weightsync.transport` = '{transport}'.*set it to 'torch_dist'"
        with pytest.raises(C.ConfigError, match=want):
            jobs.check_seams(C.load(None, ["actor.engine=sglang", f"weightsync.transport={transport}"]))
    with pytest.raises(C.ConfigError, match="set it to 'shm' or 'filesystem'"):
        jobs.check_seams(C.load(None, ["weightsync.transport=torch_dist"]))
    root = os.path.dirname(jobs.__file__)
    with open(os.path.join(root, "actor", "worker.py")) as f:
        assert "sglang" not in f.read().lower()
    for name in os.listdir(os.path.join(root, "weightsync")):
        if name.endswith(".py"):
            with open(os.path.join(root, "weightsync", name)) as f:
                text = f.read().lower()
            assert "sglang" not in text and "actor.engine" not in text, name
