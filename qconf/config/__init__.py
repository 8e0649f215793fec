"""qconfigs: YAML (native or lpmm format) -> validated, frozen :class:`QConfig` -> per-parameter
:class:`StatePlan` (which :class:`~qconf.codec.Codec` each optimizer state gets).

    cfg = load_config("configs/default.yml")
    plan = resolve_plan(cfg, "layers.0.attn.weight", (4096, 4096))
    plan.codec("exp_avg_sq")      # Codec(bits=4, map='power-1', signed=False, scale='rank1', ...)

Modules, lowest first: ``frozen`` (FrozenDict), ``report`` (problem reporting), ``rules`` (field
rules, section checks), ``bitnet`` (the ``bitnet`` section), ``model`` (the frozen
dataclasses), ``lpmm`` (lpmm's format -> native), ``yamlfile``
(one file's YAML, read with bounded work), ``loader`` (``base`` chains -> QConfig), ``plan``
(QConfig + parameter -> StatePlan). See docs/config.md for every key and the resolution rules.
"""
from .loader import load_config
from .plan import StatePlan, resolve_plan
from .model import DEFAULT_STATES, STATE_NAMES, BitNetConfig, Override, QConfig, StateConfig, WeightsConfig

__all__ = ["QConfig", "StateConfig", "WeightsConfig", "Override", "BitNetConfig", "StatePlan", "resolve_plan",
           "load_config", "STATE_NAMES", "DEFAULT_STATES"]
