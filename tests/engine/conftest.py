"""stories260K (a real GQA Llama, 5 layers) for the engine tests: dense fp32, loaded once."""

import pytest

from needs import STORIES, require_file


@pytest.fixture(scope="session")
def stories_loaded():
    require_file(STORIES, "../shared/models/stories260K.gguf")
    from kvlab.checkpoints.resolve import load_checkpoint
    return load_checkpoint(STORIES)


@pytest.fixture(scope="session")
def stories_model(stories_loaded):
    return stories_loaded.model


@pytest.fixture(scope="session")
def stories_tokenizer(stories_loaded):
    return stories_loaded.tokenizer
