"""Make SGLang's request-struct modules importable on a CPU-only torch.

``sglang.srt.managers.io_struct`` imports ``torchvision.transforms`` (through its multimodal
utilities). PyPI's torchvision wheels are CUDA builds: their ``_C`` extension cannot load
against the CPU torch, and torchvision then fails at import on two *unguarded* fake-kernel
registrations (``torchvision::nms`` / ``qnms`` in ``_meta_registrations.py``) -- nothing else in
it needs ``_C``. Declaring those two operator schemas (no kernel) lets the pure-Python part
import; no test calls either operator. Only where SGLang and torchvision are both installed and
the operators are missing, so a full GPU install is untouched and the default venv is unaffected.
"""

from __future__ import annotations

import glob
import importlib.util
import os

NMS_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


def _declare_torchvision_ops() -> None:
    if importlib.util.find_spec("sglang") is None:
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        return
    import torch

    lib = glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so"))
    try:
        torch.ops.load_library(lib[0])  # what torchvision does itself; a no-op when it works later
        return
    except (OSError, IndexError):
        pass
    for op in ("nms", "qnms"):
        torch.library.define(f"torchvision::{op}", NMS_SCHEMA)


_declare_torchvision_ops()
