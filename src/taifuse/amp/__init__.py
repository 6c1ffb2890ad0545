"""Mixed precision, with ``torch.amp``'s names and semantics: :class:`autocast` (float16 compute
for the ops where it is safe, float32 for the rest; docs/amp.md has the op lists)."""

from taifuse.amp.autocast import autocast, clear_autocast_cache, get_autocast_dtype, is_autocast_enabled

__all__ = ["autocast", "clear_autocast_cache", "get_autocast_dtype", "is_autocast_enabled"]
