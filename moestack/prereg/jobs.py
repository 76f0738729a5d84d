"""Several runners at once: ``moestack prereg run FILE --jobs N`` starts N runner processes
over the same folder, which share the grid through claims (:func:`.runner.claim`), and shows
one progress bar over the whole study. Runner ``i`` writes its output to
``<out>/runner-<i>.log``. Set the study's ``threads`` so that N runners fit the cores.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from moestack.errors import MoestackError
from moestack.prereg.locking import check_code, verify
from moestack.prereg.runner import default_out_dir, is_finished, plan
from moestack.prereg.signals import sigterm_as_interrupt
from moestack.prereg.spec import load

log = logging.getLogger(__name__)


def run_jobs(
    path: Path | str,
    out_dir: Path | str | None = None,
    jobs: int = 2,
    *,
    poll_s: float = 5.0,
    progress: bool = True,
    amend: str | None = None,
) -> list[Path]:
    """Train every unfinished run of the locked study with ``jobs`` runner processes; returns
    all run dirs. Raises, naming their logs, when a runner fails; Ctrl-C, or a SIGTERM to this
    process (``timeout``, a scheduler, systemd), stops them all (each interrupted run resumes
    later from its last checkpoint). A code change is checked
    (and, with ``amend``, put on record) once, here, before any runner starts."""
    if jobs < 1:
        raise MoestackError(f"--jobs {jobs}: give 1 or more runner processes")
    # a study that is not locked, has changed or runs other code fails here, before any start
    check_code(path, verify(path), amend, out_dir)
    spec = load(path)
    root = Path(out_dir) if out_dir else default_out_dir(spec)
    runs = plan(spec, root)
    root.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "moestack.cli", "prereg", "run", str(path)]
    command += ["--out", str(root), "--quiet"]
    logs = [root / f"runner-{i}.log" for i in range(jobs)]
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as stack, sigterm_as_interrupt():
        files = [stack.enter_context(open(p, "a")) for p in logs]
        try:
            # their own sessions: Ctrl-C reaches this process only, which then stops each
            # runner once (a second signal would cut a runner's own clean-up short)
            for f in files:
                procs.append(subprocess.Popen(
                    command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                ))  # fmt: skip
            log.info("study %s: %d runners (logs: %s)", spec.study, jobs, root / "runner-*.log")
            _watch(procs, runs, spec.study, poll_s, progress)
        except BaseException:  # Ctrl-C or SIGTERM: the runners stop too (they resume later)
            _stop(procs)
            raise
    failed = [f"{logs[i]} (exit {p.returncode})" for i, p in enumerate(procs) if p.returncode]
    if failed:
        raise MoestackError(f"{len(failed)} of {jobs} runners failed; see {', '.join(failed)}")
    return [r.run_dir for r in runs]


def _stop(procs: list[subprocess.Popen], grace_s: float = 30.0) -> None:
    """Stop the runners as Ctrl-C does: SIGTERM, which a runner turns into Ctrl-C's
    KeyboardInterrupt once and then ignores (``signals``: a runner that got its own SIGTERM
    already is not cut short), so each stops between or inside a run, records it as
    interrupted and frees its claim; any still running after ``grace_s``, or all at once on
    a second Ctrl-C here, is killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _watch(
    procs: list[subprocess.Popen], runs: list, study: str, poll_s: float, progress: bool
) -> None:
    """Wait for the runners, counting finished runs on one progress bar."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        done = sum(is_finished(r.run_dir) for r in runs)
        bar = tqdm(total=len(runs), initial=done, desc=study, unit="run")
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(poll_s)
            if bar is not None:
                bar.update(sum(is_finished(r.run_dir) for r in runs) - bar.n)
    finally:
        if bar is not None:
            bar.close()
