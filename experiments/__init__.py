"""moestack.experiments: the pre-registered studies (docs/prereg.md), each a YAML spec with its
lock (``<study>.yaml.lock.json``) beside it, installed with the package.

They are not training configs, so they live outside configs/, hydra's search path: a study is
run with ``moestack prereg run experiments/<study>.yaml``, never as a config group.
"""
