"""Build the host kernels' C++ now (``make setup`` runs this), so the first optimizer step
does not wait for the compiler: the fused AdamW host step (OffloadAdamW) and TieredAdamW's
update. Says where each is, or why it is not (the optimizers then fall back at run time,
with one logged line). Always exits 0: a machine without a compiler still installs."""

from __future__ import annotations

from moestack.kernels import host_adamw, host_build, host_tiered


def main() -> int:
    for what, load, fallback in (
        ("fused host step", host_adamw.load, "OffloadAdamW will fall back"),
        ("tiered step", host_tiered.load, "TieredAdamW will run torch ops"),
    ):
        try:
            path = load().path
        except RuntimeError as err:
            print(f"{what}: C++ kernel not built ({err}); {fallback}")
            continue
        if host_build.is_private(path):  # the cache folder was refused (the warning says why)
            print(
                f"{what}: C++ kernel built in {path}, a private folder removed at exit: "
                f"{host_build.cache_folder()} was refused, so each run builds it again"
            )
            continue
        print(f"{what}: C++ kernel ready at {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
