"""Build the fused host step's C++ kernel now (``make setup`` runs this), so the first
offloaded step does not wait for the compiler; says where it is, or why it is not (the
optimizer then falls back at run time, with one logged line). Always exits 0: a machine
without a compiler still installs."""

from __future__ import annotations

from moestack.optim import native


def main() -> int:
    try:
        kernel = native.load()
    except RuntimeError as err:
        print(f"fused host step: C++ kernel not built ({err}); OffloadAdamW will fall back")
        return 0
    if native.is_private(kernel.path):  # the cache folder was refused (the warning says why)
        print(
            f"fused host step: C++ kernel built in {kernel.path}, a private folder removed at "
            f"exit: {native.cache_folder()} was refused, so each run builds it again"
        )
        return 0
    print(f"fused host step: C++ kernel ready at {kernel.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
