"""Mixed precision, with ``torch.amp``'s names and semantics: :class:`autocast` (float16 compute
for the ops where it is safe, float32 for the rest; docs/amp.md has the op lists) and
:class:`GradScaler` (dynamic loss scaling: a step with a non-finite gradient is skipped)."""

from taifuse.amp.autocast import autocast, clear_autocast_cache, get_autocast_dtype, is_autocast_enabled
from taifuse.amp.grad_scaler import GradScaler

__all__ = ["GradScaler", "autocast", "clear_autocast_cache", "get_autocast_dtype", "is_autocast_enabled"]
