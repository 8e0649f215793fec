"""Low-bit optimizers: one base (:class:`QOptimizer`) and small update rules."""
from .adam import Adam, AdamW
from .base import QOptimizer, StateSpec
from .checkpoint import export_torch_state_dict
from .lion import Lion
from .sgd import SGD

__all__ = ["AdamW", "Adam", "SGD", "Lion", "QOptimizer", "StateSpec", "export_torch_state_dict"]
