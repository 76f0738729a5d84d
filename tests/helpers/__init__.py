"""Set-ups shared by the test modules: small configs and runs, a kill at a chosen step,
fixture data for the cache, transformers, pre-registration and fault tests.

tests/ is on sys.path (tests/conftest.py's folder, pytest's prepend import mode), so a test
module imports ``helpers.runs`` and the like; no test module imports another
(tests/project/test_layout.py checks it).
"""
