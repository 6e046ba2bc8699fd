"""Run every test module that does not choose a prefix-caching mode itself twice:
with ``KVCacheManager``'s ``enable_prefix_caching`` defaulting to False (today's
behaviour) and to True. A module that constructs its managers with an explicit
mode sets ``SETS_PREFIX_CACHING = True`` and runs once."""

import pytest

from kvcache import KVCacheManager


def pytest_generate_tests(metafunc):
    if "prefix_caching_default" in metafunc.fixturenames and not getattr(metafunc.module, "SETS_PREFIX_CACHING", False):
        metafunc.parametrize("prefix_caching_default", [False, True], ids=["cache-off", "cache-on"],
                             indirect=True, scope="module")


@pytest.fixture(scope="module", autouse=True)
def prefix_caching_default(request):
    """Module-scoped (hypothesis rejects function-scoped fixtures around @given tests)."""
    value = getattr(request, "param", False)
    defaults = KVCacheManager.__init__.__kwdefaults__
    saved = defaults["enable_prefix_caching"]
    defaults["enable_prefix_caching"] = value
    yield value
    defaults["enable_prefix_caching"] = saved
