"""Sessions: ``tests`` (the CPU tier, what CI runs, once per supported torch in ``TORCH``), ``demo``
(the main job), ``docs`` (regenerate the generated docs pages). Each creates a fresh virtualenv and
installs what it needs: torch, nvidia-cudnn-frontend 1.28.0 (the oldest supported) and this package.

``TORCH``: the oldest supported torch, the previous release and the newest. 2.13.0 is a CPU build;
2.14.1 and 2.15.0 come as CUDA builds (about 5.5-5.8 GB in the venv, results/install-weight.md), whose
CPU tier runs all the same. ``nox -s "tests(torch='2.15.0')"`` runs one of them. Measured on a
2-core CI-like machine (2026-12-04, each session from a fresh virtualenv): 2.13.0 5.6 min, 2.14.1 6.9
min, 2.15.0 6.0 min (about 2 min of install, 4 of tests): about 19 minutes in all, within the
30-minute budget, so 2.15.0 runs in ``tests`` with the others.

The CI machines' pip configuration may cap torch through a constraints file (``torch<=2.14.1`` here);
a session whose torch lies above such a cap installs with ``PIP_CONSTRAINT`` pointing at an empty file
that the session writes itself (CI runs on a fresh clone), so the cap does not downgrade the torch it
tests.

Disk: a CUDA build's session needs about 5.6 GB (2.14.1, from this machine's disk) or 7.9 GB (2.15.0:
5.5 GB installed plus its downloads) while it installs (``NEED_GB``; results/install-weight.md), on
machines whose free disk varies (a CI run on record ran out of space installing 2.14.1 after 2.13.0
had passed). So every session installs without pip's cache and removes its virtualenv when it ends,
and a session of a CUDA build that finds less free disk than it needs is *skipped*, with the free
and needed sizes in nox's summary, instead of failing half-installed. The oldest torch (2.13.0, a
CPU build) is never skipped: without room for it the run fails.
"""

import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False

TORCH = ["2.13.0", "2.14.1", "2.15.0"]
FRONTEND = "nvidia-cudnn-frontend==1.28.0"
#: Free disk (GB, 10^9 bytes) a session needs before it installs: the measured peak while
#: installing (results/install-weight.md) plus about 1 GB for the tests and pip's temporary files.
NEED_GB = {"2.13.0": 2.5, "2.14.1": 6.6, "2.15.0": 9.0}


@nox.session
@nox.parametrize("torch", TORCH)
def tests(session, torch):
    _room_for(session, torch)
    env = {**_no_constraints(session), "PIP_NO_CACHE_DIR": "1"}
    try:
        session.install(f"torch=={torch}", FRONTEND, env=env)
        session.install(".[test,transformers,plot]", env=env)  # plot: matplotlib, so the bench's plot tests run
        session.run("python", "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", *session.posargs,
                    env={"HYPOTHESIS_PROFILE": "ci"})
    finally:
        _remove_venv(session)


def _room_for(session, torch):
    """Skip the session of a CUDA build of torch when the disk cannot hold its install (module doc)."""
    free = shutil.disk_usage(Path(session.virtualenv.location).parent).free / 1e9
    need = NEED_GB[torch]
    if free >= need:
        return
    message = (f"torch {torch} needs about {need:.1f} GB of free disk to install, {free:.1f} GB is free; "
               f"free some and run `nox -s \"tests(torch='{torch}')\"`")
    if torch == TORCH[0]:
        session.error(message)
    session.skip(message)


def _remove_venv(session):
    """Remove this session's virtualenv (several GB for a CUDA build) so the next session has room;
    nox makes a fresh one on every run anyway (``reuse_existing_virtualenvs = False``)."""
    location = getattr(session.virtualenv, "location", None)
    if location and Path(location).is_dir():
        shutil.rmtree(location, ignore_errors=True)


def _no_constraints(session):
    """``{"PIP_CONSTRAINT": <an empty file>}``: lifts a machine-wide cap such as ``torch<=2.14.1`` for
    this session's installs only. The pins of the session's own install commands still hold."""
    empty = Path(session.create_tmp()) / "no-constraints.txt"
    empty.write_text("")
    return {"PIP_CONSTRAINT": str(empty)}


@nox.session
def demo(session):
    session.install(f"torch=={TORCH[0]}", FRONTEND)
    session.install(".")
    session.run("cudnn-sdpa", "demo", *session.posargs)


@nox.session
def docs(session):
    session.install(f"torch=={TORCH[0]}", FRONTEND)
    session.install(".")
    session.run("python", "-m", "cudnn_sdpa_provider.tools.docgen", "--write")
