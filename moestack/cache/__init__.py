"""moestack.cache: expert store on disk, expert cache, offloaded inference (docs/cache.md)."""

from moestack.cache.expert_cache import CacheConfig, ExpertCache, ExpertCacheStats  # noqa: F401
from moestack.cache.offload import (  # noqa: F401
    CachedExperts,
    evaluate_offloaded,
    generate_offloaded,
    offloaded,
    release_experts,
    restore_experts,
)
from moestack.cache.policies import POLICIES, CachePolicy, make_policy  # noqa: F401
from moestack.cache.store import ExpertStore, open_or_write_store  # noqa: F401
