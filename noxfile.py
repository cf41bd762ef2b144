"""Sessions: ``tests`` (the CPU tier, what CI runs, once per supported torch in ``TORCH``), ``demo``
(the main job), ``docs`` (regenerate the generated docs pages). Each creates a fresh virtualenv and
installs what it needs: torch, nvidia-cudnn-frontend 1.28.0 (the oldest supported) and this package.

``TORCH``: the oldest and the newest torch installable on the CPU machines that run CI. 2.13.0 is
a CPU build; 2.14.1 comes as a CUDA build (about 5.5 GB in the venv, results/install-weight.md),
whose CPU tier runs all the same. ``nox -s "tests(torch='2.13.0')"`` runs one of them.
"""

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False

TORCH = ["2.13.0", "2.14.1"]
FRONTEND = "nvidia-cudnn-frontend==1.28.0"


@nox.session
@nox.parametrize("torch", TORCH)
def tests(session, torch):
    session.install(f"torch=={torch}", FRONTEND)
    session.install(".[test,transformers,plot]")  # plot: matplotlib, so the bench's plot tests run
    session.run("python", "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", *session.posargs,
                env={"HYPOTHESIS_PROFILE": "ci"})


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
