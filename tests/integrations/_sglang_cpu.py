"""Makes SGLang's real host memory pool and HiCacheController importable beside a CPU torch.

Why this is needed, and why it stands in for nothing of SGLang's:

* ``sglang.srt.mem_cache.memory_pool_host`` -> ``pool_host.group`` -> ``memory_pool`` ->
  ``sglang.srt.configs.mamba_utils`` runs ``sglang/srt/configs/__init__.py``, which imports every
  model config SGLang knows; a few of those (Nemotron-VL via ``multimodal.internvl_utils``,
  DeepSeek-OCR) import ``torchvision.transforms`` at module level, and some import ``dill``,
  ``sentencepiece``, ``compressed_tensors``, ``loguru``, ``gguf``.  None of it is used by the
  host pool or the controller; it only has to import.
* PyPI's ``torchvision==0.28.0`` (the release paired with torch 2.13) is a CUDA build: its C
  extension links ``libc10_cuda``/``libtorch_cuda``, absent from the CPU torch, so
  ``torchvision.extension`` cannot load it, and ``torchvision._meta_registrations`` then fails with
  ``operator torchvision::nms does not exist`` (its ``nms``/``qnms`` fake registrations are the two
  not guarded by ``_has_ops()``).  Declaring those two schemas (no kernel) before the import lets
  the real torchvision import; its pure-Python transforms are real, and calling ``nms`` would
  raise, as it would with torchvision's own failed extension.
* The packages live in ``./.engine-site`` (``scripts/dev-install.sh``), appended to ``sys.path``
  only by the SGLang tests and benchmark, so nothing else in the suite sees a torchvision.

A CUDA build of torch (GBs) would make all of this unnecessary; CI does not install one.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SITE = Path(os.environ.get("HOSTKV_ENGINE_SITE", ROOT / ".engine-site"))

_done = False


def prepare() -> bool:
    """Idempotent; ``False`` when the engine site is missing (the SGLang pool tests then skip)."""
    global _done
    if _done:
        return True
    site = str(ENGINE_SITE)
    if not ENGINE_SITE.is_dir():
        return False
    if site not in sys.path:
        sys.path.append(site)  # appended: the shared site-packages wins for anything both have
    # Other tests hide torchvision from transformers with a None entry; SGLang's configs need it.
    if "torchvision" in sys.modules and sys.modules["torchvision"] is None:
        del sys.modules["torchvision"]
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    if "torchvision" not in sys.modules and not hasattr(torch.ops.torchvision, "nms"):
        ext = Path(spec.origin).parent / "_C.so"
        try:
            torch.ops.load_library(str(ext))  # a torchvision built for this torch: nothing to do
        except (OSError, RuntimeError):
            for op in ("nms", "qnms"):
                torch.library.define(f"torchvision::{op}",
                                     "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _done = True
    return True
