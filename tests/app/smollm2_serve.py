"""The SmolLM2 Serve that the test_smollm2*.py modules share (tests.serving.shared_disagg_and_aggregated:
disaggregated with 3 n-gram drafts at ``/disagg``, aggregated at ``/agg``): its engine and the ``urls`` /
``clients`` fixtures those modules import. A module that imports them sets ``SHARES_SERVE = True``."""

from __future__ import annotations

import openai
import pytest

from engine.model_registry import SMOLLM2_NAME
from tests.app.fakes import openai_client
from tests.serving import shared_disagg_and_aggregated

ENGINE = {"model": SMOLLM2_NAME, "tokens_per_block": 16, "num_pages": 160, "max_num_seqs": 8,
          "max_num_batched_tokens": 512, "device": "cpu"}


@pytest.fixture(scope="module")
def urls() -> dict[str, str]:
    return shared_disagg_and_aggregated(ENGINE, SMOLLM2_NAME)


@pytest.fixture(scope="module")
def clients(urls) -> dict[str, openai.OpenAI]:
    return {mode: openai_client(url).with_options(timeout=120) for mode, url in urls.items()}
