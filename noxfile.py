"""Sessions: ``tests`` (the CPU tier, what CI runs), ``demo`` (the main job), ``docs`` (regenerate
the generated docs pages). Each creates a fresh virtualenv and installs what it needs: the CPU build
of torch 2.13.0, nvidia-cudnn-frontend 1.28.0 (the oldest supported) and this package."""

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False

CPU_DEPS = ["torch==2.13.0", "nvidia-cudnn-frontend==1.28.0"]


@nox.session
def tests(session):
    session.install(*CPU_DEPS)
    session.install(".[test,transformers]")
    session.run("python", "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", *session.posargs,
                env={"HYPOTHESIS_PROFILE": "ci"})


@nox.session
def demo(session):
    session.install(*CPU_DEPS, "numpy")  # numpy: torch warns at import without it
    session.install(".")
    session.run("cudnn-sdpa", "demo", *session.posargs)


@nox.session
def docs(session):
    session.install(*CPU_DEPS)
    session.install(".")
    session.run("python", "-m", "cudnn_sdpa_provider.docgen", "--write")
