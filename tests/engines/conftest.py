"""The engines' tests (sglang in with_sglang/, vLLM in with_vllm/, each run by its own pytest process: their
set-ups differ) and what they share (`tiny_models`). They run in the engines' environment, which .ci/run builds
(scripts/engines_env.sh)."""

import pytest
from tiny_models import save_model


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """name -> (name, directory, transformers' greedy ids of PROMPTS, HIT and LONG), each model saved once."""
    models = {}

    def get(name):
        if name not in models:
            directory = tmp_path_factory.mktemp(name)
            models[name] = name, str(directory), save_model(name, directory)
        return models[name]

    return get
