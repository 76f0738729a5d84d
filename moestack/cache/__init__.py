from moestack.cache.policies import POLICIES, CachePolicy, make_policy  # noqa: F401
