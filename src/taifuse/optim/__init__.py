"""Optimizers with fused single-pass update kernels, learning-rate schedules and gradient clipping.

``SGD``, ``Adam``, ``AdamW`` and ``Lion`` follow ``torch.optim`` (parameter groups,
``zero_grad(set_to_none=True)``, ``state_dict`` / ``load_state_dict`` in PyTorch's layout). A
group's parameters, gradients and state live in flat buffers so that one step is one kernel launch
per group and dtype (NOTE [ Flat buffers ] in ``optimizer.py``); the update rules are the pure
functions of ``_functional.py`` over the kernels specified in ``backends/reference/optim.py``.
"""

from taifuse.optim import lr_scheduler
from taifuse.optim.adam import Adam, AdamW
from taifuse.optim.clip import clip_grad_norm_
from taifuse.optim.lion import Lion
from taifuse.optim.optimizer import Optimizer
from taifuse.optim.sgd import SGD

# Every optimizer class, for registry-driven tests and benchmarks.
OPTIMIZERS = (SGD, Adam, AdamW, Lion)

__all__ = ["OPTIMIZERS", "SGD", "Adam", "AdamW", "Lion", "Optimizer", "clip_grad_norm_", "lr_scheduler"]
