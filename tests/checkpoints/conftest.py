"""Real checkpoints for the loader tests: skipped locally when their files are absent, a failure in CI."""

import pytest

from needs import STORIES, require_file, require_smollm2


@pytest.fixture(scope="session")
def stories():
    require_file(STORIES, "../shared/models/stories260K.gguf")
    from kvlab.checkpoints.resolve import load_checkpoint
    return load_checkpoint(STORIES)


@pytest.fixture(scope="session")
def smollm2_path():
    return require_smollm2()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from kvlab.checkpoints.resolve import load_checkpoint
    return load_checkpoint(smollm2_path)
