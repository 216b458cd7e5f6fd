"""elsa_surgery: swap the attention of pretrained models for exact ELSA (linear-scan) attention kernels.

``import elsa_surgery`` needs only torch: model libraries (timm, transformers, open_clip) and Triton
are imported on first use.
"""

from . import monoid
from .api import attention, attention_state, attention_varlen
from .dispatch import BACKENDS, PRECISIONS, BackendUnavailable, Decision, decide
from .registry import Adapter, PatchConfig, get_adapter, list_adapters, register_adapter, unregister_adapter
from .report import ConversionReport
from .verify import ParityError
from .surgery import convert, revert
from .modules import ElsaAttention, patch_vit_attention
from .io import load, save

__version__ = "0.1.0"


# ``python -m elsa_surgery.convert`` is the CLI module; importing it rebinds ``elsa_surgery.convert`` to that
# module, which is itself callable and forwards to :func:`elsa_surgery.surgery.convert`. (No ModuleType
# subclass on the package: torch.compile cannot trace ``from . import`` on one.)

__all__ = [
    "attention", "attention_varlen", "attention_state", "monoid",
    "decide", "Decision", "BACKENDS", "PRECISIONS", "BackendUnavailable",
    "Adapter", "PatchConfig", "register_adapter", "unregister_adapter", "list_adapters", "get_adapter",
    "convert", "revert", "load", "save", "ConversionReport", "ParityError", "ElsaAttention", "patch_vit_attention",
    "__version__",
]

# transformers: register the "elsa" attention/mask functions as soon as transformers is imported (a post-import
# hook; transformers itself is not imported here), so from_pretrained(..., attn_implementation="elsa") works.
from .adapters import hf_import_hook as _hf_import_hook  # noqa: E402

_hf_import_hook.install()
