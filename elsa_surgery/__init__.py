"""elsa_surgery: swap the attention of pretrained models for exact ELSA (linear-scan) attention kernels.

``import elsa_surgery`` needs only torch: model libraries (timm, transformers, open_clip) and Triton
are imported on first use.
"""

from . import monoid
from .api import attention, attention_state, attention_varlen
from .dispatch import BACKENDS, PRECISIONS, BackendUnavailable, Decision, decide
from .registry import Adapter, PatchConfig, get_adapter, list_adapters, register_adapter, unregister_adapter

__version__ = "0.1.0"

__all__ = [
    "attention", "attention_varlen", "attention_state", "monoid",
    "decide", "Decision", "BACKENDS", "PRECISIONS", "BackendUnavailable",
    "Adapter", "PatchConfig", "register_adapter", "unregister_adapter", "list_adapters", "get_adapter",
    "__version__",
]
