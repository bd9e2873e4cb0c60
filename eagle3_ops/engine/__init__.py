"""The reference decode loop: plain and speculative (chain or tree, greedy or sampled) decoding of a
Target with an EAGLE-3 Drafter, every hot path through torch.ops.eagle3."""

from . import torch_glue  # noqa: F401
from .decode import DecodeStats, PrefillCache, SpecConfig, Timer, generate_plain, generate_speculative  # noqa: F401
from .policy import AdaptivePolicy, Policy  # noqa: F401
from .wiring_check import MiswiringError, WiringCheck, WiringRecord, WiringWarning  # noqa: F401
from .wiring_record import record_wiring  # noqa: F401
