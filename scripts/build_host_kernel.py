"""Build the host kernels' C++ now (``make setup`` runs this), so the first optimizer step
does not wait for the compiler; says where each is, or why it is not (the optimizer then
falls back at run time, with one logged line). Always exits 0: a machine without a compiler
still installs."""

from __future__ import annotations

from moestack.kernels import host_adamw, host_build


def main() -> int:
    try:
        kernel = host_adamw.load()
    except RuntimeError as err:
        print(f"fused host step: C++ kernel not built ({err}); OffloadAdamW will fall back")
        return 0
    if host_build.is_private(kernel.path):  # the cache folder was refused (the warning says why)
        print(
            f"fused host step: C++ kernel built in {kernel.path}, a private folder removed at "
            f"exit: {host_build.cache_folder()} was refused, so each run builds it again"
        )
        return 0
    print(f"fused host step: C++ kernel ready at {kernel.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
