"""Low-bit optimizers: one base (:class:`QOptimizer`) and small update rules.

Modules, lowest first: ``spec`` (what a rule declares: StateSpec, Slot, Hyper), ``states`` (state
values), ``weights`` (bf16/fp16 parameter writes), ``fused`` (the native step), ``checkpoint``,
``base`` (QOptimizer), and the rules ``adam``, ``sgd``, ``lion`` and ``muon`` (Muon with AdamW for
the rest of a model: ``newton_schulz``, ``muon_routing``)."""
from .adam import Adam, AdamW
from .base import QOptimizer
from .export import export_torch_state_dict
from .lion import Lion
from .muon import Muon
from .release import prepare_gradient_release, remove_gradient_release
from .sgd import SGD
from .spec import Hyper, Slot, StateSpec

__all__ = ["AdamW", "Adam", "SGD", "Lion", "Muon", "QOptimizer", "StateSpec", "Slot", "Hyper", "export_torch_state_dict",
           "prepare_gradient_release", "remove_gradient_release"]
